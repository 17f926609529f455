"""One agent sorts three digits: the plateau-prone task of the default experiment, harder.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python -m flexmarl.main --config=experiments/sort3.py --workdir=runs/sort3

Smoke run: `--config=experiments/sort3.py:runlocal`. The default experiment's sorter
(two digits) stalled at 0.75-0.80 in long runs; three digits (0..4, 125 prompts, an
answer of three tokens) is what the robustness suite watches for a plateau.
"""

import ml_collections

from flexmarl.config import agent_config, cluster_config, rollout_config


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.steps = 600
  config.schedule = 'flexmarl'
  config.tokenizer = 'char'
  config.max_prompt_len = 6  # '301=' and BOS
  config.checkpoint_every = 200
  config.cluster = cluster_config()
  config.workflow = dict(name='single_task', agent='sorter', family='sort',
                         task_args={'length': 3, 'max_digit': 4})
  config.rollout = rollout_config(devices='shared', query_concurrency=8, max_step_queries=32)
  # GRPO and the optimizer at the library's defaults (no per-agent tuning).
  config.agents = dict(sorter=agent_config(
      'tiny', group_size=8, global_batch=64, micro_batch=32,
      sampling=dict(temperature=1.0, top_p=1.0, max_new_tokens=4)))  # 3 digits + EOS
  if arg == 'runlocal':
    config.steps, config.checkpoint_every = 5, 5
  return config
