"""Default experiment: a router and three specialists (add, reverse, sort), GRPO from scratch.

Run (CPU, embedded sampler):
  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python -m flexmarl.main --config=experiments/hierarchical_assistant.py --workdir=runs/ha

A laptop-sized smoke run (big_vision's `runlocal`):
  python -m flexmarl.main --config=experiments/hierarchical_assistant.py:runlocal \
    --workdir=runs/ha_local

Fields are overridden with flags, e.g. `--config.steps=50 --config.seed=1`.
"""

import ml_collections

from flexmarl.config import agent_config


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.steps = 150
  config.schedule = 'sync'
  config.tokenizer = 'char'
  config.max_prompt_len = 8
  config.checkpoint_every = 25

  config.workflow = dict(
      name='hierarchical_assistant',
      router='router',
      # task family -> specialist, most frequent family first (Zipf skew).
      specialists={'add': 'adder', 'reverse': 'reverser', 'sort': 'sorter'},
      zipf=1.0,
      router_reward='routing',
      task_args={'add': {'max_operand': 4}, 'reverse': {'length': 3, 'alphabet': 4},
                 'sort': {'length': 2, 'max_digit': 4}},
  )
  config.rollout = dict(queries_per_wave=16, max_waves=4)

  def specialist(max_new_tokens: int, global_batch: int) -> ml_collections.ConfigDict:
    return agent_config(
        'tiny', group_size=8, global_batch=global_batch, micro_batch=global_batch // 2,
        sampling=dict(temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens),
        grpo=dict(clip_eps=0.2, kl_coef=0.0, entropy_coef=0.02, normalize_std=True))

  config.agents = dict(
      router=agent_config(
          'tiny', group_size=4, global_batch=64, micro_batch=32,
          sampling=dict(temperature=1.0, top_p=1.0, max_new_tokens=2),
          grpo=dict(clip_eps=0.2, kl_coef=0.0, entropy_coef=0.02, normalize_std=True)),
      adder=specialist(max_new_tokens=2, global_batch=48),
      reverser=specialist(max_new_tokens=4, global_batch=32),
      sorter=specialist(max_new_tokens=3, global_batch=16),
  )

  if arg == 'runlocal':
    config.steps = 5
    config.checkpoint_every = 5
  return ml_collections.ConfigDict(config)
