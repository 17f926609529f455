"""Two agents debate a sum over two turns, each reading the other's claims. GRPO from scratch.

The workflow is a user's class, `experiments/debate_team.py` (`Debate`). Run from the
repository root:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python -m flexmarl.main --config=experiments/debate.py --workdir=runs/debate

Smoke run: `--config=experiments/debate.py:runlocal`.
Each agent trains on one device and rolls out on another (4 devices).
"""

import ml_collections

from flexmarl.config import agent_config, cluster_config, rollout_config


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.steps = 400
  config.schedule = 'flexmarl'
  config.tokenizer = 'char'
  config.max_prompt_len = 12  # '3+1|4|5|4=' and BOS
  config.checkpoint_every = 100
  config.cluster = cluster_config()  # backend=ray: docs/cluster.md
  config.workflow = dict(name='experiments.debate_team:Debate', first='a', second='b')
  # 8 queries fill both batches: per query each agent answers twice, 8 rows a turn.
  config.rollout = rollout_config(devices='separate', query_concurrency=8,
                                  max_step_queries=32)

  def agent() -> ml_collections.ConfigDict:
    # GRPO and the optimizer at the library's defaults (no per-agent tuning).
    return agent_config(
        'tiny', group_size=8, global_batch=128, micro_batch=64,
        sampling=dict(temperature=1.0, top_p=1.0, max_new_tokens=2))  # 1 token + EOS

  config.agents = dict(a=agent(), b=agent())

  if arg == 'runlocal':
    config.steps, config.checkpoint_every = 5, 5
  return ml_collections.ConfigDict(config)
