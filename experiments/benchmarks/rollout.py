"""Rollout only: streaming vs streaming with instance pools.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python -m experiments.benchmarks.rollout [--queries=192] [--repeats=3]

The default experiment's query mix (`experiments/hierarchical_assistant.py`: a router
and three specialists, Zipf-skewed, 24 queries in flight) is rolled out with fixed
(initial) weights, no training, through `orch.rollout_engine.run` of the team `main.build`
makes, under three rollout configs (RESULTS.md records the lockstep `waves` engine,
since removed, against `stream`):

- `stream`: one instance per agent (4 training + 4 rollout devices): a finished query's
  slot is refilled at once, every busy instance generates at the same time.
- `pools`: streaming with 2 instances for the router and 2 for the reverser (the hot
  agents) on devices 4-7, the sorter and adder rolling out on their own (idle)
  training devices 2 and 3 (`rollout.devices=shared`, explicit device lists: 6
  instances on 8 devices), balancer on (Δ=5, 0.5 s cooldown).
- `static`: the same pools with the balancer off (what more instances give without
  moves: a moved instance compiles its new agent's sampler on its devices first).

Each variant warms up (untimed runs of the same queries compile the batch shapes they
meet: at least 2, more while a run still moves instances, up to `max_warmups`), then
runs `repeats` times; each column is the median over the repeats.
Queue time: from the workflow's `generate` call to the start of the batch that serves
it (`Request.enqueued`, logged per request in `Instance.waits`), mean per agent.
The last line is JSON.
"""

import json
import statistics
import tempfile
import time

from absl import app, flags, logging

from experiments import hierarchical_assistant

_QUERIES = flags.DEFINE_integer('queries', 192, 'Queries rolled out per timed run.')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Timed runs per variant; medians reported.')
_MAX_WARMUPS = flags.DEFINE_integer('max_warmups', 4, 'Untimed runs at most (at least 2).')
_VARIANTS = flags.DEFINE_list('variants', ['stream', 'static', 'pools'],
                              'Variants to run.')

AGENTS = ('router', 'reverser', 'sorter', 'adder')


def variant_config(variant: str):
  """The default experiment's config with the variant's rollout settings."""
  config = hierarchical_assistant.get_config()
  r = config.rollout
  r.devices, r.balance = 'separate', False
  if variant in ('pools', 'static'):
    r.devices, r.balance = 'shared', variant == 'pools'
    instance_devices = {'router': ((4,), (5,)), 'reverser': ((6,), (7,)),
                        'sorter': ((2,),), 'adder': ((3,),)}
    for i, name in enumerate(AGENTS):
      a = config.agents[name]
      a.train_devices = (i,)
      a.rollout.instances = len(instance_devices[name])
      a.rollout.devices = instance_devices[name]
  elif variant != 'stream':
    raise ValueError(f'--variants: unknown variant {variant!r}; choose from stream, static, '
                     'pools.')
  return config


def timed_run(orch, queries) -> dict:
  """One rollout of `queries`: makespan, generated tokens/s, queue time per agent, moves."""
  engine = orch.rollout_engine
  for inst in engine.instances:
    inst.waits.clear()
  moves = len(engine.balancer.log) if engine.balancer else 0
  t0 = time.perf_counter()
  results = engine.run(orch.workflow, queries)
  makespan = time.perf_counter() - t0
  tokens = sum(len(t) for r in results for group in r.served for t in group.tokens)
  waits = [w for inst in engine.instances for w in inst.waits]
  queue_ms = {a: 1e3 * statistics.fmean([s for agent, s in waits if agent == a] or [0.0])
              for a in AGENTS}
  return dict(makespan_s=makespan, tokens_per_s=tokens / makespan,
              rebalances=(len(engine.balancer.log) if engine.balancer else 0) - moves,
              **{f'queue_ms_{a}': v for a, v in queue_ms.items()})


def measure(variant: str) -> dict:
  from flexmarl.run import build

  with tempfile.TemporaryDirectory() as workdir:
    orch = build(variant_config(variant), workdir)
    try:
      queries = [orch.query(i) for i in range(_QUERIES.value)]
      t0 = time.perf_counter()
      # Warm-up: compiles the batch shapes these queries meet. A moved instance compiles
      # its new agent's shapes on its devices, so warm up again after a run that moved one.
      moved, warmups = True, 0
      while warmups < 2 or (moved and warmups < _MAX_WARMUPS.value):
        moved = timed_run(orch, queries)['rebalances'] > 0
        warmups += 1
      warmup_s = time.perf_counter() - t0
      runs = [timed_run(orch, queries) for _ in range(_REPEATS.value)]
      instances = {n: len(p.instances) for n, p in orch.rollout_engine.pools.items()}
    finally:
      orch.close()
  out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
  return dict(out, warmup_s=warmup_s, warmups=warmups, instances_at_end=instances,
              makespans_s=[round(r['makespan_s'], 3) for r in runs])


def table(results: dict) -> str:
  head = (f"{'variant':<8} {'makespan s':>10} {'tokens/s':>9} "
          + ' '.join(f'{"queue ms " + a:>17}' for a in AGENTS) + f" {'rebalances':>10}")
  rows = [head]
  for name, r in results.items():
    rows.append(f"{name:<8} {r['makespan_s']:>10.2f} {r['tokens_per_s']:>9.0f} "
                + ' '.join(f"{r[f'queue_ms_{a}']:>17.1f}" for a in AGENTS)
                + f" {r['rebalances']:>10.0f}")
  return '\n'.join(rows)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  results = {}
  for variant in _VARIANTS.value:
    results[variant] = measure(variant)
    r = results[variant]
    print(f"{variant}: makespans {r['makespans_s']} s (warm-up: {r['warmups']} runs, {r['warmup_s']:.1f} s), "
          f"instances at end {r['instances_at_end']}", flush=True)
  print(table(results))
  print(json.dumps(results))


if __name__ == '__main__':
  app.run(main)
