"""Step time of the default experiment under `sync`, `sync_parallel`, `flexmarl` and `async:1`.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python experiments/benchmarks/pipeline.py [--steps=60] [--warmup=30] [--block=10] \
      [--concurrency=24] [--rollout_devices=separate]

`sync`, `sync_parallel` and `flexmarl` give the same parameters (tests/test_schedules.py),
so each one does exactly the same work; only its timing differs. `async:1` trains each
batch while the next one rolls out (one version of lag, tests/test_staleness.py): about
the same amount of work, not the same numbers.

The schedules run side by side in one process, interleaved: each one's run is built
and warmed up (`--warmup` steps: every batch shape compiled), then they take turns,
`--block` steps at a time, in an order that rotates every round, until each has run
`--steps` timed steps. A machine whose speed drifts over minutes (a shared CPU does)
then slows every schedule alike. A run's rollout begun ahead of its next step
(`start_rollout`) is dropped before another schedule takes its turn, and the first step
of each turn is not timed. A step's time is the wall time from the end of the one before
to its own end (what a run takes per step, whatever the schedule overlaps), with the
process's CPU time over it (all threads: JAX's, the rollout's, the store's), which says
how many of the machine's cores the schedule keeps busy, and the CPU time of the thread that
runs the step (the orchestrator's: the rollout loop, the workflows, batch layout and
dispatch), which no schedule can overlap with itself. Per schedule: the median step
time (the issue's measure), its rollout and what follows it, cores busy, and the ratio to
the first schedule in every round.

`--concurrency=C`: `rollout.query_concurrency`, queries in flight. 24 is the default
experiment (a step ends as soon as every agent's batch is full, after at most
`rollout.max_step_queries`=96 queries). `--rollout_devices`: each agent's rollout
instance on a device of its own (`separate`, the default experiment's setting) or on its
training device (`shared`). The last line is JSON.
"""

import importlib.util
import json
import os
import statistics
import tempfile
import time

from absl import app, flags, logging

_STEPS = flags.DEFINE_integer('steps', 60, 'Timed steps per schedule.')
_WARMUP = flags.DEFINE_integer('warmup', 30, 'Untimed steps first (compilation).')
_BLOCK = flags.DEFINE_integer('block', 10, 'Timed steps per turn.')
_CONCURRENCY = flags.DEFINE_list('concurrency', ['24'], 'rollout.query_concurrency settings.')
_DEVICES = flags.DEFINE_list('rollout_devices', ['separate'], 'rollout.devices settings.')
_SCHEDULES = flags.DEFINE_list('schedules', ['sync', 'sync_parallel', 'flexmarl', 'async:1'],
                               'Schedules to compare; the first is the baseline.')


def default_experiment(schedule: str, concurrency: int, rollout_devices: str):
  spec_file = os.path.join(os.path.dirname(__file__), '..', 'hierarchical_assistant.py')
  module_spec = importlib.util.spec_from_file_location('hierarchical_assistant', spec_file)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  config = module.get_config()
  config.schedule = schedule
  config.rollout.query_concurrency = concurrency
  config.rollout.devices = rollout_devices
  return config


def compare(concurrency: int, devices: str) -> dict:
  """Every schedule's timed steps, interleaved (see the module docstring)."""
  from flexmarl.run import build

  schedules = _SCHEDULES.value
  # (round, step_s, rollout_s, train_s, cpu_s, main_cpu_s)
  steps = {s: [] for s in schedules}
  with tempfile.TemporaryDirectory() as workdir:
    runs = {}
    for s in schedules:
      runs[s] = build(default_experiment(s, concurrency, devices),
                      os.path.join(workdir, s.replace(':', '_')))
      for _ in range(_WARMUP.value):
        runs[s].run_step()
      runs[s].serve_from(runs[s].next_query)  # nothing of it generates in another's turn
    rounds = -(-_STEPS.value // _BLOCK.value)
    for r in range(rounds):
      for s in schedules[r % len(schedules):] + schedules[:r % len(schedules)]:
        orch = runs[s]
        orch.run_step()  # its rollout starts afresh: not timed
        wall, cpu, main = time.perf_counter(), time.process_time(), time.thread_time()
        for _ in range(min(_BLOCK.value, _STEPS.value - r * _BLOCK.value)):
          team = orch.run_step()['team']
          last = wall, cpu, main
          wall, cpu, main = time.perf_counter(), time.process_time(), time.thread_time()
          steps[s].append((r, wall - last[0], team['rollout_s'], team['train_s'],
                           cpu - last[1], main - last[2]))
        orch.serve_from(orch.next_query)
      print(f'round {r + 1}/{rounds} done', flush=True)
    for orch in runs.values():
      orch.close()
  base = schedules[0]
  results = {}
  for s in schedules:
    step_s = statistics.median(x[1] for x in steps[s])
    per_round = [statistics.median(x[1] for x in steps[base] if x[0] == r)
                 / statistics.median(x[1] for x in steps[s] if x[0] == r) for r in range(rounds)]
    results[s] = dict(step_s=step_s, rollout_s=statistics.median(x[2] for x in steps[s]),
                      after_rollout_s=statistics.median(x[3] for x in steps[s]),
                      cores_busy=sum(x[4] for x in steps[s]) / sum(x[1] for x in steps[s]),
                      main_thread_busy=sum(x[5] for x in steps[s]) / sum(x[1] for x in steps[s]),
                      speedup=results.get(base, {}).get('step_s', step_s) / step_s,
                      speedup_per_round=per_round)
  return results


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  results = {}
  for devices in _DEVICES.value:
    for concurrency in map(int, _CONCURRENCY.value):
      setting = f'c{concurrency} {devices}'
      results[setting] = compare(concurrency, devices)
      for s, r in results[setting].items():
        rounds = ', '.join(f'{x:.2f}' for x in r['speedup_per_round'])
        print(f"{setting} {s:>14}: median {r['step_s'] * 1e3:.0f} ms/step (rollout "
              f"{r['rollout_s'] * 1e3:.0f} ms, then training {r['after_rollout_s'] * 1e3:.0f}"
              f" ms), {r['cores_busy']:.2f} of {os.cpu_count()} cores busy (the main thread "
              f"{r['main_thread_busy']:.0%} of the time), {r['speedup']:.2f}x "
              f"{_SCHEDULES.value[0]} (per round: {rounds})",
              flush=True)
  print(json.dumps(results))


if __name__ == '__main__':
  app.run(main)
