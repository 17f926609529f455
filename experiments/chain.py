"""Three agents in a chain, each working on the previous one's answer. GRPO from scratch.

The workflow is a user's class, `experiments/chain_team.py` (`Chain`). Run from the
repository root:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python -m flexmarl.main --config=experiments/chain.py --workdir=runs/chain

Smoke run: `--config=experiments/chain.py:runlocal`.
Each agent trains on one device and rolls out on another (6 devices); on fewer, add
`--config.rollout.devices=shared` (3 devices).
"""

import ml_collections

from flexmarl.config import agent_config, cluster_config, rollout_config


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.steps = 500
  config.schedule = 'flexmarl'
  config.tokenizer = 'char'
  config.max_prompt_len = 6  # '3+1=' and BOS
  config.checkpoint_every = 100
  config.cluster = cluster_config()  # backend=ray: docs/cluster.md
  config.workflow = dict(name='experiments.chain_team:Chain', adder='adder',
                         flipper='flipper', speller='speller')
  # 8 queries fill every batch: 8 rows per agent per query.
  config.rollout = rollout_config(devices='separate', query_concurrency=8,
                                  max_step_queries=32)

  def agent() -> ml_collections.ConfigDict:
    # GRPO and the optimizer at the library's defaults (no per-agent tuning).
    return agent_config(
        'tiny', group_size=8, global_batch=64, micro_batch=32,
        sampling=dict(temperature=1.0, top_p=1.0, max_new_tokens=2))  # 1 token + EOS

  config.agents = dict(adder=agent(), flipper=agent(), speller=agent())

  if arg == 'runlocal':
    config.steps, config.checkpoint_every = 5, 5
  return ml_collections.ConfigDict(config)
