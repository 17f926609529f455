"""Step time of the default experiment on 1, 2, 4 and 8 devices, as placement fits it.

  python experiments/benchmarks/fit_devices.py [--devices=1,2,4,8] [--steps=40] [--warmup=20]

The default experiment asks for 8 devices (4 training meshes, 4 rollout instances of
their own). With no placement given, fewer devices are fitted (flexmarl.placement.plan.fit):
4 run the rollout instances on the training devices (`rollout.devices=shared`); 2 and
1 also make the agents take turns on a training pool of 2 and 1 meshes, their states
swapped to host memory between turns. Each device count runs in a process of its own
(`XLA_FLAGS=--xla_force_host_platform_device_count=N`, CPU devices), with the same
config and seed: the same work, so the step times compare what the sharing costs.

Each run warms up (compiles every batch shape it meets) first; the timed steps follow.
Reported per device count: the fitted layout, ms per step (and its rollout and
after-rollout parts), the ratio to 8 devices, the swaps per step and the seconds of
swap copies per step that the schedule waited for. CPU devices share the machine's
cores, so fewer devices mostly cost the lost overlap and the swaps, not compute; on
accelerators the loss of parallel devices adds to it. The last line is JSON.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app, flags, logging

_DEVICES = flags.DEFINE_list('devices', ['1', '2', '4', '8'], 'Device counts to time.')
_STEPS = flags.DEFINE_integer('steps', 40, 'Timed steps per device count.')
_WARMUP = flags.DEFINE_integer('warmup', 20, 'Untimed steps first (compilation).')
_CHILD = flags.DEFINE_boolean('child', False, 'Internal: time this process\'s devices.')

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def time_steps(steps: int, warmup: int) -> dict:
  """Time the default experiment on this process's devices (no placement given)."""
  import jax

  from experiments import hierarchical_assistant
  from flexmarl.run import build

  config = hierarchical_assistant.get_config()
  with tempfile.TemporaryDirectory() as workdir:
    orch = build(config, workdir, log=lambda *_: None)
    fitted = orch.spec.placement.fitted
    for _ in range(warmup):
      orch.run_step()
    rollout = after = swaps = swap_wait = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
      lines = orch.run_step()
      rollout += lines['team']['rollout_s']
      after += lines['team']['train_s']
      agents = [l for name, l in lines.items() if name != 'team']
      swaps += sum(l.get('swaps', 0) for l in agents)
      swap_wait += sum(l.get('swap_wait_s', 0.0) for l in agents)
    elapsed = time.perf_counter() - t0
    orch.close()
  return dict(devices=jax.device_count(),
              layout=dict(fitted.changes) if fitted else 'as asked',
              step_s=elapsed / steps, rollout_s=rollout / steps, after_rollout_s=after / steps,
              swaps_per_step=swaps / steps, swap_wait_s_per_step=swap_wait / steps)


def run_child(devices: int, steps: int, warmup: int) -> dict:
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu',
             XLA_FLAGS=f'--xla_force_host_platform_device_count={devices}')
  out = subprocess.run([sys.executable, os.path.abspath(__file__), '--child',
                        f'--steps={steps}', f'--warmup={warmup}'], env=env, cwd=ROOT,
                       capture_output=True, text=True, check=False)
  if out.returncode:
    raise RuntimeError(f'{devices} devices failed:\n{out.stderr[-3000:]}')
  return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  if _CHILD.value:
    print(json.dumps(time_steps(_STEPS.value, _WARMUP.value)))
    return
  results = {}
  for devices in map(int, _DEVICES.value):
    results[devices] = r = run_child(devices, _STEPS.value, _WARMUP.value)
    print(f"{devices} device(s), {r['layout']}: {r['step_s'] * 1e3:.0f} ms/step (rollout "
          f"{r['rollout_s'] * 1e3:.0f} ms, then training {r['after_rollout_s'] * 1e3:.0f} ms), "
          f"{r['swaps_per_step']:.1f} swaps/step, swap wait "
          f"{r['swap_wait_s_per_step'] * 1e3:.0f} ms/step", flush=True)
  base = results.get(max(results))
  for r in results.values():
    r['ratio_to_most'] = r['step_s'] / base['step_s']
  print('ratio to', max(results), 'devices:', ', '.join(
      f"{d}: {r['ratio_to_most']:.2f}x" for d, r in results.items()))
  print(json.dumps(results))


if __name__ == '__main__':
  app.run(main)
