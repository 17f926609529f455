"""A solver answers sums; a verifier says y/n to each answer. GRPO from scratch.

Run (CPU, embedded sampler):
  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python -m flexmarl.main --config=experiments/solver_verifier.py --workdir=runs/sv

Smoke run: `--config=experiments/solver_verifier.py:runlocal`.
"""

import ml_collections

from flexmarl.config import agent_config, cluster_config, rollout_config


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.steps = 400
  config.schedule = 'flexmarl'
  config.tokenizer = 'char'
  config.max_prompt_len = 10
  config.checkpoint_every = 100
  config.cluster = cluster_config()  # backend=ray: docs/cluster.md
  config.workflow = dict(name='solver_verifier', solver='solver', verifier='verifier',
                         family='add', task_args={'max_operand': 4})
  config.rollout = rollout_config(devices='separate', query_concurrency=8,  # 2 + 2 devices
                                  max_step_queries=32)
  # GRPO and the optimizer at the library's defaults (no per-agent tuning).
  config.agents = dict(
      solver=agent_config('tiny', group_size=8, global_batch=64, micro_batch=32,
                          sampling=dict(temperature=1.0, top_p=1.0, max_new_tokens=2)),
      verifier=agent_config('tiny', group_size=2, global_batch=128, micro_batch=32,
                            sampling=dict(temperature=1.0, top_p=1.0, max_new_tokens=2)),
  )
  if arg == 'runlocal':
    config.steps, config.checkpoint_every = 5, 5
  return ml_collections.ConfigDict(config)
