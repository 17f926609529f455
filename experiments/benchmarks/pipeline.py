"""Step time of the default experiment under `sync`, `sync_parallel`, `flexmarl` and `async:1`.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python experiments/benchmarks/pipeline.py [--steps=60] [--warmup=30] \
      [--queries_per_wave=6] [--max_waves=8]

`sync`, `sync_parallel` and `flexmarl` give the same parameters (tests/test_schedules.py),
so each one does exactly the same work; only its timing differs. `async:1` trains each
batch while the next one rolls out (one version of lag, tests/test_staleness.py): the
same amount of work, not the same numbers. Waves are smaller than in the
default experiment so that a global batch fills over several waves, as it does when
rollout concurrency is bounded: that is where micro-batches can start early. Each
schedule runs twice: with each agent's rollout instance on its training device
(`rollout.devices=shared`) and on a device of its own (`separate`, the paper's split
pools; the default experiment's setting). Each run warms up (compiles every batch shape
it meets) first; the timed steps follow. The last line is JSON.
"""

import importlib.util
import json
import os
import tempfile
import time

from absl import app, flags, logging

_STEPS = flags.DEFINE_integer('steps', 60, 'Timed steps per schedule.')
_WARMUP = flags.DEFINE_integer('warmup', 30, 'Untimed steps first (compilation).')
_QUERIES = flags.DEFINE_integer('queries_per_wave', 6, 'Rollout concurrency (queries).')
_WAVES = flags.DEFINE_integer('max_waves', 8, 'Waves a step may take to fill batches.')

SCHEDULES = ('sync', 'sync_parallel', 'flexmarl', 'async:1')
ROLLOUT_DEVICES = ('shared', 'separate')


def step_time(schedule: str, rollout_devices: str) -> dict:
  from flexmarl.main import build

  spec_file = os.path.join(os.path.dirname(__file__), '..', 'hierarchical_assistant.py')
  module_spec = importlib.util.spec_from_file_location('hierarchical_assistant', spec_file)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  config = module.get_config()
  config.schedule = schedule
  config.rollout.queries_per_wave, config.rollout.max_waves = _QUERIES.value, _WAVES.value
  config.rollout.devices = rollout_devices
  with tempfile.TemporaryDirectory() as workdir:
    orch = build(config, workdir)
    for _ in range(_WARMUP.value):
      orch.run_step()
    rollout = train = 0.0
    t0 = time.perf_counter()
    for _ in range(_STEPS.value):
      team = orch.run_step()['team']
      rollout += team['rollout_s']
      train += team['train_s']
    elapsed = time.perf_counter() - t0
    orch.close()
  n = _STEPS.value
  return dict(step_s=elapsed / n, rollout_s=rollout / n, after_rollout_s=train / n)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  results = {}
  for devices in ROLLOUT_DEVICES:
    for schedule in SCHEDULES:
      r = results[f'{schedule}/{devices}'] = step_time(schedule, devices)
      print(f"{schedule:>14} {devices:>8}: {r['step_s'] * 1e3:.0f} ms/step (rollout "
            f"{r['rollout_s'] * 1e3:.0f} ms, then training {r['after_rollout_s'] * 1e3:.0f} ms)",
            flush=True)
  base = results['sync/shared']['step_s']
  for r in results.values():
    r['speedup_vs_sync'] = base / r['step_s']
  print(' '.join(f"{name}: {r['speedup_vs_sync']:.2f}x" for name, r in results.items()))
  print(json.dumps(results))


if __name__ == '__main__':
  app.run(main)
