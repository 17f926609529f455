"""Compiled steps kept between runs (`config.compile_cache_dir`, flexmarl.runtime.compile_cache):
a second run loads them instead of compiling, and trains exactly as the first did."""

import json
import os
import subprocess
import sys

import pytest

from conftest import FAST_COMPILE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# As a user's shell has it: no cache that JAX was given already (the test session's).
ENV = {k: v for k, v in os.environ.items()
       if k not in ('JAX_COMPILATION_CACHE_DIR', 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS')}
ENV.update(PYTHONPATH=ROOT, JAX_PLATFORMS='cpu',
           XLA_FLAGS=f'--xla_force_host_platform_device_count=8 {FAST_COMPILE}')

# A short run of a two-agent experiment that counts JAX's loads from the cache.
RUN = '''
import json, sys
import jax
loads = []
jax.monitoring.register_event_listener(
    lambda event, **_: loads.append(event) if event == '/jax/compilation_cache/cache_hits' else None)
from flexmarl import run
from experiments import solver_verifier
config = solver_verifier.get_config('runlocal')
config.steps, config.compile_cache_dir = 2, sys.argv[1]
orch = run.build(config, sys.argv[2], log=lambda *_: None)
lines = [orch.run_step() for _ in range(2)]
orch.close()
print(json.dumps(dict(loads=len(loads), cache=jax.config.jax_compilation_cache_dir,
                      losses=[{n: l[n].get('loss') for n in l if n != 'team'} for l in lines])))
'''


def _run(tmp_path, cache: str, workdir: str, env=ENV) -> dict:
  out = subprocess.run([sys.executable, '-c', RUN, cache, str(tmp_path / workdir)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def _entries(folder) -> set[str]:
  return set(os.listdir(folder)) if os.path.isdir(folder) else set()


def test_a_second_run_loads_its_steps_and_trains_alike(tmp_path):
  cache = tmp_path / 'xla'
  first = _run(tmp_path, str(cache), 'a')
  written = _entries(cache)
  assert first['cache'] == str(cache) and first['loads'] == 0
  steps = {e for e in written if not e.startswith('jit_generate_tokens-')}
  assert any(e.startswith('jit_accumulate-') for e in steps), written
  second = _run(tmp_path, str(cache), 'b')
  # The train steps compiled once: the second run wrote none of its own. (Other programs
  # may be new: the rollout batches what is queued when an instance frees up, so a run
  # may meet a generate batch size the first did not, and a program that compiles in
  # about MIN_COMPILE_S is written by one run and not the other.)
  new = _entries(cache) - written
  assert not any(e.startswith(('jit_accumulate-', 'jit_apply-')) for e in new), new
  assert second['loads'] >= len(steps), (second['loads'], len(steps))
  assert second['losses'] == first['losses']  # the loaded programs compute the same numbers


USE = '''
import json, sys
import jax
from flexmarl.runtime import compile_cache
print(json.dumps([compile_cache.use(sys.argv[1]), jax.config.jax_compilation_cache_dir]))
'''


def _use(path: str, env=ENV) -> list:
  out = subprocess.run([sys.executable, '-c', USE, path], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.quick
def test_no_cache_when_turned_off_and_a_cache_jax_was_given_is_kept(tmp_path):
  assert _use('') == [None, None]
  assert _use('~/x') == [os.path.expanduser('~/x')] * 2
  given = str(tmp_path / 'given')
  assert _use(str(tmp_path / 'ignored'), dict(ENV, JAX_COMPILATION_CACHE_DIR=given)) == [given] * 2
