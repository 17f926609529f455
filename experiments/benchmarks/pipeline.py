"""Step time of the default experiment under `sync`, `sync_parallel`, `flexmarl` and `async:1`.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python experiments/benchmarks/pipeline.py [--steps=60] [--warmup=30] \
      [--concurrency=24,6] [--rollout_devices=separate,shared]

`sync`, `sync_parallel` and `flexmarl` give the same parameters (tests/test_schedules.py),
so each one does exactly the same work; only its timing differs. `async:1` trains each
batch while the next one rolls out (one version of lag, tests/test_staleness.py): about
the same amount of work, not the same numbers.

`--concurrency=C`: `rollout.query_concurrency`, queries in flight. 24 is the default
experiment (a step ends as soon as every agent's batch is full, after at most
`rollout.max_step_queries`=96 queries); 6 streams fewer queries at a time, so global
batches fill over longer and the pipeline has more rows to train on early.
`--rollout_devices`: each agent's rollout
instance on a device of its own (`separate`, the paper's split pools and the default
experiment's setting) or on its training device (`shared`). Each run warms up
(compiles every batch shape it meets) first; the timed steps follow. The last line is
JSON.
"""

import importlib.util
import json
import os
import tempfile
import time

from absl import app, flags, logging

_STEPS = flags.DEFINE_integer('steps', 60, 'Timed steps per run.')
_WARMUP = flags.DEFINE_integer('warmup', 30, 'Untimed steps first (compilation).')
_CONCURRENCY = flags.DEFINE_list('concurrency', ['24', '6'], 'rollout.query_concurrency '
                                  'settings to time.')
_DEVICES = flags.DEFINE_list('rollout_devices', ['separate'], 'rollout.devices settings.')

SCHEDULES = ('sync', 'sync_parallel', 'flexmarl', 'async:1')


def step_time(schedule: str, concurrency: int, rollout_devices: str) -> dict:
  from flexmarl.run import build

  spec_file = os.path.join(os.path.dirname(__file__), '..', 'hierarchical_assistant.py')
  module_spec = importlib.util.spec_from_file_location('hierarchical_assistant', spec_file)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  config = module.get_config()
  config.schedule = schedule
  config.rollout.query_concurrency = concurrency
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
  for devices in _DEVICES.value:
    for concurrency in map(int, _CONCURRENCY.value):
      for schedule in SCHEDULES:
        setting = f'c{concurrency} {devices}'
        name = f'{schedule} {setting}'
        r = results[name] = step_time(schedule, concurrency, devices)
        r['speedup_vs_sync'] = results[f'sync {setting}']['step_s'] / r['step_s']
        print(f"{name:>34}: {r['step_s'] * 1e3:.0f} ms/step (rollout "
              f"{r['rollout_s'] * 1e3:.0f} ms, then training "
              f"{r['after_rollout_s'] * 1e3:.0f} ms), {r['speedup_vs_sync']:.2f}x sync",
              flush=True)
  print(json.dumps(results))


if __name__ == '__main__':
  app.run(main)
