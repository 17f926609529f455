"""The default experiment (experiments/hierarchical_assistant.py) as a simulator setup, at
the rates measured on this machine:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python -m experiments.benchmarks.calibrate          # writes this_machine.json
  python -m flexmarl.simulate --config=experiments/sim/this_machine.py \
      --schedules=sync,sync_parallel,flexmarl

Mirrored from the experiment: the agents (router + reverser/sorter/adder), group sizes,
global and micro batches, max_new_tokens, Zipf 1.0 over the specialists, 24 queries in
flight, at most 96 queries a step, one rollout instance per agent on a device of its own
(4 training + 4 rollout devices), batches padded as the embedded JAX backends pad them.
Rates: every agent is the same tiny model, so all share the measured `rates` of
this_machine.json (`calibrate.py`: EmbeddedSampler and AgentTrainer timed here). The 8
forced host devices share this machine's cores: `shared_cores` comes from the measured
`contention` (flexmarl/sim/cores.py).

The simulated step is device time. The host's own Python work (orchestrator, engine,
workflow, store, metrics) is not in it; on a machine whose devices share the host
thread's cores it adds up with it (experiments/benchmarks/sim_vs_real.py measures it).

Workload, as the real run sees it: prompts of 2-3 characters plus '?' (router) or '='
(specialist) and BOS; responses as long as max_new_tokens (an untrained tiny policy
rarely draws EOS early). Where the router sends queries is learned in the real run, so
`:mix=R,S,A` replaces the Zipf mix by measured shares (the real run's routed queries per
specialist, from its metrics: rows + surplus_rows over group size). `:json=PATH` reads
the rates from another file.
"""

import json
import os

import ml_collections

from flexmarl.sim.cores import cores_from_contention

HERE = os.path.dirname(__file__)
RATE_KEYS = ('decode_step_s', 'decode_token_s', 'prefill_token_s', 'call_s', 'train_token_s',
             'micro_batch_s', 'optimizer_s', 'sync_s')


def parse(arg: str) -> dict[str, str]:
  out = dict(kv.split('=', 1) for kv in arg.split(':') if kv)
  unknown = sorted(set(out) - {'mix', 'json'})
  if unknown:
    raise ValueError(f'experiments/sim/this_machine.py:{arg}: unknown keys {unknown}; use '
                     'mix=R,S,A (shares of reverser, sorter, adder) and json=PATH.')
  return out


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  args = parse(arg)
  path = args.get('json', os.path.join(HERE, 'this_machine.json'))
  if not os.path.exists(path):
    raise FileNotFoundError(f'{path} is missing: run experiments/benchmarks/calibrate.py on '
                            'this machine first (it writes the measured rates there).')
  with open(path) as f:
    measured = json.load(f)
  rates = {k: float(measured[k]) for k in RATE_KEYS}

  def agent(group_size: int, global_batch: int, new_tokens: int) -> dict:
    return dict(model='tiny', rollout_tp=1, train_devices=1, instances=1, min_instances=1,
                group_size=group_size, global_batch=global_batch, micro_batch=global_batch // 2,
                # The query (2-3 characters) and its '?' or '='; BOS is added by the workflow.
                prompt_tokens=dict(median=3.5, sigma=0.15, max=4),
                response_tokens=dict(median=new_tokens, sigma=0.0, max=new_tokens),
                rates=rates)

  config = ml_collections.ConfigDict()
  config.seed = 0
  config.steps = 40
  config.schedules = ('sync', 'sync_parallel', 'flexmarl')
  # 8 forced host devices: 4 training (node 0) and 4 rollout (node 1). The accelerator
  # is unused: every agent gives its measured rates.
  config.cluster = dict(nodes=2, devices_per_node=4, accelerator='ascend-910c-die',
                        rollout_nodes=1, train_nodes=1)
  config.padded_batches = True
  config.shared_cores = cores_from_contention(float(measured['contention']))
  config.global_batch = 96
  config.micro_batch = 48
  config.query_parallelism = 24
  config.query_concurrency = 24
  config.max_step_queries = 96
  config.branch_parallelism = 8
  config.balance_threshold = 5
  config.workflow = dict(name='hierarchical_assistant', router='router',
                         specialists=['reverser', 'sorter', 'adder'], zipf=1.0)
  if 'mix' in args:
    config.workflow.mix = [float(x) for x in args['mix'].split(',')]
  config.agents = dict(router=agent(4, 96, 2), reverser=agent(8, 96, 3),
                       sorter=agent(8, 48, 3), adder=agent(8, 32, 2))
  config.measured = measured
  config.paper = dict(step_time_s={})
  return config
