"""Step time of the default experiment under `sync`, `sync_parallel`, `flexmarl` and `async:1`.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python experiments/benchmarks/pipeline.py [--steps=60] [--warmup=30] \
      [--waves=24x1,6x8] [--rollout_devices=separate,shared]

`sync`, `sync_parallel` and `flexmarl` give the same parameters (tests/test_schedules.py),
so each one does exactly the same work; only its timing differs. `async:1` trains each
batch while the next one rolls out (one version of lag, tests/test_staleness.py): about
the same amount of work, not the same numbers.

`--waves=QxW`: Q queries a wave, at most W waves a step. `24x1` is the default
experiment (one wave fills every batch, so micro-batches cannot start early); `6x8`
bounds rollout concurrency so that a global batch fills over several waves, where the
pipeline can start micro-batches early. `--rollout_devices`: each agent's rollout
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
_WAVES = flags.DEFINE_list('waves', ['24x1', '6x8'], 'QUERIESxMAX_WAVES settings to time.')
_DEVICES = flags.DEFINE_list('rollout_devices', ['separate'], 'rollout.devices settings.')

SCHEDULES = ('sync', 'sync_parallel', 'flexmarl', 'async:1')


def step_time(schedule: str, waves: str, rollout_devices: str) -> dict:
  from flexmarl.run import build

  spec_file = os.path.join(os.path.dirname(__file__), '..', 'hierarchical_assistant.py')
  module_spec = importlib.util.spec_from_file_location('hierarchical_assistant', spec_file)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  config = module.get_config()
  config.schedule = schedule
  config.rollout.queries_per_wave, config.rollout.max_waves = map(int, waves.split('x'))
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
    for waves in _WAVES.value:
      for schedule in SCHEDULES:
        name = f'{schedule} {waves} {devices}'
        r = results[name] = step_time(schedule, waves, devices)
        r['speedup_vs_sync'] = results[f'sync {waves} {devices}']['step_s'] / r['step_s']
        print(f"{name:>26}: {r['step_s'] * 1e3:.0f} ms/step (rollout {r['rollout_s'] * 1e3:.0f} "
              f"ms, then training {r['after_rollout_s'] * 1e3:.0f} ms), "
              f"{r['speedup_vs_sync']:.2f}x sync", flush=True)
  print(json.dumps(results))


if __name__ == '__main__':
  app.run(main)
