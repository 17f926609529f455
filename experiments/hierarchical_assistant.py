"""Default experiment: a router and three specialists (add, reverse, sort), GRPO from scratch.

Run (CPU, embedded sampler):
  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python -m flexmarl.main --config=experiments/hierarchical_assistant.py --workdir=runs/ha

A laptop-sized smoke run (big_vision's `runlocal`):
  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python -m flexmarl.main --config=experiments/hierarchical_assistant.py:runlocal \
    --workdir=runs/ha_local

Each agent trains on one device and rolls out on another (`rollout.devices=separate`):
8 devices in all. On fewer, placement fits the team to the devices there are (4: rollout
on the training devices; 1 to 3: the agents take turns on a training pool) and prints
what it chose; `--config.placement=strict` refuses instead.

Fields are overridden with flags, e.g. `--config.steps=50 --config.seed=1`.
"""

import ml_collections

from flexmarl.config import agent_config, cluster_config, rollout_config


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.steps = 1500
  config.schedule = 'flexmarl'  # the micro-batch pipeline: the same parameters as 'sync'
  config.tokenizer = 'char'
  config.max_prompt_len = 8
  config.checkpoint_every = 250
  config.cluster = cluster_config()  # backend=ray: docs/cluster.md
  config.placement = 'fit'  # on too few devices, fit the team to them; 'strict': refuse
  config.trace_steps = 1000  # trace.json keeps the last 1000-1500 steps' spans (0: all)
  config.store_keep_steps = 0  # store retention: rows of the last N steps (0: every row)
  config.compile_cache_dir = '~/.cache/flexmarl/xla'  # compiled steps kept between runs ('': none)

  config.workflow = dict(
      name='hierarchical_assistant',
      router='router',
      # (task family, specialist) pairs, most frequent family first (Zipf skew); a list,
      # because a config sorts a dict's keys.
      specialists=[('reverse', 'reverser'), ('sort', 'sorter'), ('add', 'adder')],
      zipf=1.0,
      router_reward='routing',
      # Answers: reverse 2 letters, sort 2 digits, add 1 digit (+ EOS).
      task_args={'reverse': {'length': 2, 'alphabet': 5}, 'sort': {'length': 2, 'max_digit': 4},
                 'add': {'max_operand': 4}},
  )
  # Rollout instances on devices of their own, as in the paper: generation never waits
  # behind an agent's gradient work (4 training + 4 rollout devices). Up to 24 queries
  # in flight; a step ends as soon as every agent's batch is full.
  config.rollout = rollout_config(devices='separate', query_concurrency=24,
                                  max_step_queries=96)

  def agent(group_size: int, global_batch: int, max_new_tokens: int
            ) -> ml_collections.ConfigDict:
    # GRPO and the optimizer at the library's defaults: no per-agent tuning (the entropy
    # bonus follows each agent's errors; experiments/benchmarks/robustness.py).
    return agent_config(
        'tiny', group_size=group_size, global_batch=global_batch,
        micro_batch=global_batch // 2,
        sampling=dict(temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens))

  # Global batches follow the expected load of a 24-query wave (Zipf 1.0 over 3
  # families: 55/27/18%); the family that learns fastest (add) is the rarest.
  config.agents = dict(
      router=agent(group_size=4, global_batch=96, max_new_tokens=2),
      reverser=agent(group_size=8, global_batch=96, max_new_tokens=3),
      sorter=agent(group_size=8, global_batch=48, max_new_tokens=3),
      adder=agent(group_size=8, global_batch=32, max_new_tokens=2),
  )

  if arg == 'runlocal':
    config.steps = 5
    config.checkpoint_every = 5
  return ml_collections.ConfigDict(config)
