"""The paper's cluster and training settings, shared by its simulated setups.

Published (FlexMARL, arXiv 2602.09578): 48 nodes x 16 accelerators of 64 GB; Qwen2.5-14B
and 32B agents; global batch 64, micro-batch 16; query parallelism 4, branch parallelism
16; intra-agent balancing threshold Delta = 5; step times per schedule (below).
Assumed here, since the paper does not give them (change them with --config.* flags):
- the split of nodes between the rollout pool (32) and the training pool (16), one
  training mesh per node;
- rollout instances tensor-parallel over 2 devices (14B: 29.5 GB of bf16 weights) or 4
  (32B: 65.5 GB); every agent starts with an equal share of the rollout pool;
- a GRPO group of 16 samples per prompt (so a global batch of 64 rows is 4 queries);
- prompt and response lengths: lognormal with the medians and spread of each agent below.

Config fields the simulator reads: cluster, agents.<name>.{model, rollout_tp,
train_devices, min_instances, group_size, prompt_tokens, response_tokens}, workflow,
global_batch, micro_batch, query_parallelism, query_concurrency, branch_parallelism,
balance_threshold, train_mfu, schedules, steps, seed; `paper` holds the published figures to compare against.
"""

import ml_collections

SCHEDULES = ('sync', 'sync_parallel', 'flexmarl', 'flexmarl_no_pipeline', 'flexmarl_no_balance')
ROLLOUT_TP = {'qwen2.5-14b': 2, 'qwen2.5-32b': 4}


def agent(model: str, response_median: int, response_sigma: float = 0.6,
          prompt_median: int = 1024) -> dict:
  return dict(model=model, rollout_tp=ROLLOUT_TP[model], train_devices=16, min_instances=1,
              group_size=16,
              prompt_tokens=dict(median=prompt_median, sigma=0.3, max=8192),
              response_tokens=dict(median=response_median, sigma=response_sigma, max=8192))


def router_team(router_model: str, specialist_models: list[str], zipf: float = 1.0,
                router_response: int = 64, specialist_response: int = 512) -> dict:
  """A router that sends each query to one specialist, Zipf-skewed over the specialists
  (the hot ones first): the load skew the balancer exists for."""
  agents = {'router': agent(router_model, router_response, response_sigma=0.3)}
  names = [f'specialist{i}' for i in range(len(specialist_models))]
  for name, model in zip(names, specialist_models):
    agents[name] = agent(model, specialist_response)
  return dict(agents=agents,
              workflow=dict(name='hierarchical_assistant', router='router', specialists=names,
                            zipf=zipf))


def paper_config(team: dict, paper_step_time_s: dict[str, float] | None = None
                 ) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.steps = 5
  config.schedules = SCHEDULES
  config.cluster = dict(nodes=48, devices_per_node=16, accelerator='ascend-910c-die',
                        rollout_nodes=32, train_nodes=16)
  config.global_batch = 64
  config.micro_batch = 16
  config.query_parallelism = 4
  # Queries in flight in the rollout engine; 0 takes query_parallelism (the paper's figure).
  config.query_concurrency = 0
  config.branch_parallelism = 16
  config.balance_threshold = 5
  # Training efficiency (model FLOPs utilization) of the cost model; see flexmarl/sim/costs.py.
  config.train_mfu = 0.35
  config.workflow = team['workflow']
  config.agents = team['agents']
  config.paper = dict(step_time_s=dict(paper_step_time_s or {}))
  return config
