"""Start-up of a run with compiled steps kept between runs (`config.compile_cache_dir`).

  python experiments/benchmarks/compile_cache.py [--experiment=experiments/hierarchical_assistant.py:runlocal] \
    [--steps=3] [--repeats=2]

Each run is a process of its own (as a user's rerun is), with eight CPU devices: build the
team (`flexmarl.run.build`), then `--steps` steps, which compile every program the run
needs. Three kinds, taking turns `--repeats` times: no cache (`compile_cache_dir=''`), an
empty folder (the first run, which writes it), and that folder again (a rerun, which loads
it). Reports, per kind, the median seconds to build and to run the first steps, and how
many of the programs the run asked for were loaded from the cache (the others compiled:
new shapes, or programs that compile in under `compile_cache.MIN_COMPILE_S` and are not
kept). The last line is JSON.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile

from absl import app, flags

_EXPERIMENT = flags.DEFINE_string('experiment', 'experiments/hierarchical_assistant.py:runlocal',
                                  'Experiment file[:arg].')
_STEPS = flags.DEFINE_integer('steps', 3, 'Steps after the build.')
_REPEATS = flags.DEFINE_integer('repeats', 2, 'Rounds of the three kinds.')

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RUN = '''
import importlib.util, json, sys, tempfile, time
t0 = time.perf_counter()
import jax
events = {'/jax/compilation_cache/cache_hits': 0, '/jax/compilation_cache/compile_requests_use_cache': 0}
jax.monitoring.register_event_listener(
    lambda e, **_: events.__setitem__(e, events[e] + 1) if e in events else None)
from flexmarl import run
path, _, arg = sys.argv[1].partition(':')
spec = importlib.util.spec_from_file_location('experiment', path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
config = module.get_config(arg) if arg else module.get_config()
config.compile_cache_dir = sys.argv[2]
with tempfile.TemporaryDirectory() as workdir:
  orch = run.build(config, workdir, log=lambda *_: None)
  t1 = time.perf_counter()
  for _ in range(int(sys.argv[3])):
    orch.run_step()
  t2 = time.perf_counter()
  orch.close()
print(json.dumps(dict(build_s=t1 - t0, steps_s=t2 - t1,
                      loaded=events['/jax/compilation_cache/cache_hits'],
                      programs=events['/jax/compilation_cache/compile_requests_use_cache'])))
'''


def _run(cache: str) -> dict:
  env = {k: v for k, v in os.environ.items() if not k.startswith('JAX_COMPILATION_CACHE')}
  env.update(PYTHONPATH=ROOT, XLA_FLAGS='--xla_force_host_platform_device_count=8')
  out = subprocess.run([sys.executable, '-c', RUN, _EXPERIMENT.value, cache, str(_STEPS.value)],
                       cwd=ROOT, env=env, capture_output=True, text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv):
  del argv
  runs = {'no cache': [], 'first run (writes)': [], 'rerun (loads)': []}
  for r in range(_REPEATS.value):
    with tempfile.TemporaryDirectory() as cache:
      runs['no cache'].append(_run(''))
      runs['first run (writes)'].append(_run(cache))
      runs['rerun (loads)'].append(_run(cache))
    print(f'round {r + 1}/{_REPEATS.value} done', flush=True)
  result = {}
  for kind, rs in runs.items():
    med = {k: statistics.median(x[k] for x in rs) for k in rs[0]}
    result[kind] = med
    print(f"{kind:>20}: build {med['build_s']:.1f} s, first {_STEPS.value} steps "
          f"{med['steps_s']:.1f} s, total {med['build_s'] + med['steps_s']:.1f} s; "
          f"{med['loaded']:.0f} of {med['programs']:.0f} programs loaded, the others compiled")
  print(json.dumps(result))


if __name__ == '__main__':
  app.run(main)
