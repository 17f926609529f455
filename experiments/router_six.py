"""A router and six specialists under Zipf-skewed traffic: the rarest specialist sees a
tenth of the queries. GRPO from scratch, on the built-in hierarchical_assistant workflow.

Run (CPU, embedded sampler):
  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python -m flexmarl.main --config=experiments/router_six.py --workdir=runs/router_six

Smoke run: `--config=experiments/router_six.py:runlocal`.
Seven agents need 14 devices for separate rollout devices; on 8 every agent rolls out on
its training device (`rollout.devices=shared`, 7 devices).
"""

import ml_collections

from flexmarl.config import agent_config, cluster_config, rollout_config

# Zipf exponent 0.6 over six families: 30, 20, 15.5, 13, 11.4 and 10.2% of the queries.
ZIPF = 0.6


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.steps = 400
  config.schedule = 'flexmarl'
  config.tokenizer = 'char'
  config.max_prompt_len = 8
  config.checkpoint_every = 100
  config.cluster = cluster_config()  # backend=ray: docs/cluster.md
  config.placement = 'fit'  # on too few devices, fit the team to them; 'strict': refuse
  config.workflow = dict(
      name='hierarchical_assistant',
      router='router',
      # (task family, specialist) pairs, most frequent family first.
      specialists=[('reverse', 'reverser'), ('sort', 'sorter'), ('add', 'adder'),
                   ('successor', 'successor'), ('predecessor', 'predecessor'),
                   ('double', 'doubler')],
      zipf=ZIPF,
      router_reward='routing',
      # Answers: reverse and sort 2 characters, the others 1 (+ EOS).
      task_args={'reverse': {'length': 2, 'alphabet': 5}, 'sort': {'length': 2, 'max_digit': 4},
                 'add': {'max_operand': 4}, 'successor': {'alphabet': 8},
                 'predecessor': {'alphabet': 8}, 'double': {'max_operand': 4}},
  )
  config.rollout = rollout_config(devices='shared', query_concurrency=32,
                                  max_step_queries=128)

  def agent(group_size: int, global_batch: int, micro_batch: int,
            max_new_tokens: int) -> ml_collections.ConfigDict:
    # GRPO and the optimizer at the library's defaults (no per-agent tuning).
    return agent_config(
        'tiny', group_size=group_size, global_batch=global_batch, micro_batch=micro_batch,
        sampling=dict(temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens))

  # Global batches follow the expected load of a 40-query step (the rarest specialist's
  # 32 rows are 4 queries, a tenth of 40): rows = share x 40 queries x group size.
  config.agents = dict(
      router=agent(group_size=4, global_batch=160, micro_batch=80, max_new_tokens=2),
      reverser=agent(group_size=8, global_batch=96, micro_batch=48, max_new_tokens=3),
      sorter=agent(group_size=8, global_batch=64, micro_batch=32, max_new_tokens=3),
      adder=agent(group_size=8, global_batch=48, micro_batch=24, max_new_tokens=2),
      successor=agent(group_size=8, global_batch=40, micro_batch=40, max_new_tokens=2),
      predecessor=agent(group_size=8, global_batch=32, micro_batch=16, max_new_tokens=2),
      doubler=agent(group_size=8, global_batch=32, micro_batch=16, max_new_tokens=2),
  )

  if arg == 'runlocal':
    config.steps, config.checkpoint_every = 5, 5
  return ml_collections.ConfigDict(config)
