"""The README's two commands share one venv recipe (launchers/venv.sh), a tier at a time:
local.sh makes the base install (requirements.txt, FlexMARL), test.sh adds the test, vllm
and real extras; each finds what the other installed, a step whose requirement files
changed is done again with the steps after it, and an extra that cannot be installed is
named in one line while the tests still run, each test that needs it listed as not run with
the fix (tests/conftest.py). pip and python are stand-ins that log calls."""

import os
import shutil
import stat
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Logs each call; `python3 -m venv DIR` makes DIR/bin/{python,pip} as loggers too. PIP_FAILS
# fails every pip call, PIP_FAILS_ON only those naming that file, as pip's resolver does.
FAKE = '''#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "$CALLS"
if [ "$(basename "$0")" = pip ] && [ -n "${PIP_FAILS:-}" ]; then exit 1; fi
if [ "$(basename "$0")" = pip ] && [ -n "${PIP_FAILS_ON:-}" ] && [[ " $* " == *" $PIP_FAILS_ON "* ]]; then
  echo "Looking in indexes: ..." >&2
  echo "ERROR: No matching distribution found for torch==2.13.0+cpu" >&2
  exit 1
fi
if [ "$1" = -m ] && [ "$2" = venv ]; then
  mkdir -p "$3/bin"
  cp "$0" "$3/bin/python"; cp "$0" "$3/bin/pip"
fi
'''
EXTRA = '--retries 1 --timeout 30'
BASE = ['pip install -q -r requirements.txt', 'pip install -q --no-deps -e .']
TEST = ['pip install -q -r requirements-test.txt']
VLLM = [f'pip install -q {EXTRA} -r requirements-vllm.txt',
        'pip uninstall -y -q torchvision torchaudio torchcodec triton']
REAL = [f'pip install -q {EXTRA} -r requirements-real.txt',
        f'pip install -q {EXTRA} --no-deps -r requirements-real-nodeps.txt']
PYTEST = 'python -m pytest -q --durations=15 -n 2 --dist loadfile'
FILES = ('requirements.txt', 'requirements-test.txt', 'requirements-vllm.txt',
         'requirements-vllm-gpu.txt', 'requirements-real.txt', 'requirements-real-nodeps.txt',
         'setup.py')


def _checkout(tmp_path):
  repo = tmp_path / 'repo'
  (repo / 'launchers').mkdir(parents=True)
  for name in ('venv.sh', 'test.sh', 'local.sh'):
    shutil.copy(os.path.join(ROOT, 'launchers', name), repo / 'launchers' / name)
  for name in FILES:
    shutil.copy(os.path.join(ROOT, name), repo / name)
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  (bin_dir / 'python3').write_text(FAKE)
  (bin_dir / 'python3').chmod(stat.S_IRWXU)
  return repo, bin_dir


def _run(repo, bin_dir, script, *args, **env):
  calls = repo.parent / 'calls.log'
  calls.write_text('')
  env = {**os.environ, 'PATH': f'{bin_dir}:{os.environ["PATH"]}', 'CALLS': str(calls),
         'FLEXMARL_VLLM': 'cpu', **env}
  out = subprocess.run(['bash', f'launchers/{script}', *args], cwd=repo, capture_output=True,
                       text=True, timeout=60, env=env)
  return out, calls.read_text().splitlines()


@pytest.mark.quick
def test_the_readme_commands_share_one_venv_a_tier_at_a_time(tmp_path):
  repo, bin_dir = _checkout(tmp_path)
  out, calls = _run(repo, bin_dir, 'local.sh', 'exp.py', 'runs/x', '--config.steps=2')
  assert out.returncode == 0, out.stderr
  assert calls == ['python3 -m venv .venv', *BASE,
                   'python -m flexmarl.main --config=exp.py --workdir=runs/x --config.steps=2']
  out, calls = _run(repo, bin_dir, 'test.sh', 'tests/test_x.py', '-k', 'x')
  assert out.returncode == 0, out.stderr
  assert calls == [*TEST, *VLLM, *REAL, f'{PYTEST} tests/test_x.py -k x']  # base: there
  out, calls = _run(repo, bin_dir, 'test.sh', 'quick', '-x')
  assert calls == [f'{PYTEST} -m quick -x']  # complete
  out, calls = _run(repo, bin_dir, 'local.sh')
  assert calls == ['python -m flexmarl.main --config=experiments/hierarchical_assistant.py '
                   '--workdir=runs/hierarchical_assistant']


def test_changed_requirements_redo_their_step_and_those_after_it(tmp_path):
  repo, bin_dir = _checkout(tmp_path)
  _run(repo, bin_dir, 'venv.sh', 'test')
  (repo / '.venv' / '.flexmarl-recipe').write_text('f74f4a9ab7339429\n')  # an older recipe
  out, calls = _run(repo, bin_dir, 'test.sh')
  assert out.returncode == 0 and calls == [*BASE, *TEST, *VLLM, *REAL, PYTEST], calls
  with open(repo / 'requirements-vllm.txt', 'a') as f:
    f.write('safetensors==9.9\n')
  out, calls = _run(repo, bin_dir, 'test.sh')
  assert calls == [*VLLM, *REAL, PYTEST], calls
  with open(repo / 'requirements.txt', 'a') as f:
    f.write('numpy==9.9\n')  # puts back a numpy the vllm extra replaces: it follows again
  out, calls = _run(repo, bin_dir, 'local.sh', 'exp.py', 'runs/x')
  assert calls[:-1] == BASE, calls
  out, calls = _run(repo, bin_dir, 'test.sh')
  assert calls == [*TEST, *VLLM, *REAL, PYTEST], calls


def test_a_failed_base_install_stops_and_is_retried_next_time(tmp_path):
  repo, bin_dir = _checkout(tmp_path)
  out, calls = _run(repo, bin_dir, 'test.sh', PIP_FAILS='1')
  assert out.returncode != 0 and calls == ['python3 -m venv .venv', BASE[0]], calls
  assert not (repo / '.venv' / '.flexmarl-recipe').exists()
  out, calls = _run(repo, bin_dir, 'test.sh')
  assert out.returncode == 0 and calls == [*BASE, *TEST, *VLLM, *REAL, PYTEST], calls


def test_an_extra_that_cannot_install_is_one_line_and_the_tests_still_run(tmp_path):
  repo, bin_dir = _checkout(tmp_path)
  out, calls = _run(repo, bin_dir, 'test.sh', PIP_FAILS_ON='requirements-vllm.txt')
  assert out.returncode == 0, out.stderr
  assert calls == ['python3 -m venv .venv', *BASE, *TEST, VLLM[0], *REAL, PYTEST], calls
  said = [l for l in out.stderr.splitlines() if 'vllm' in l and 'Setting up' not in l]
  assert len(said) == 1, out.stderr
  assert said[0].startswith('Not installed: the vllm extra (requirements-vllm.txt): '
                            'ERROR: No matching distribution found for torch==2.13.0+cpu. Fix: ')
  assert 'PIP_FIND_LINKS' in said[0] and 'not run' in said[0]
  missing = (repo / '.venv' / '.flexmarl-missing').read_text()
  assert missing.startswith('vllm ') and 'PIP_FIND_LINKS' in missing
  out, calls = _run(repo, bin_dir, 'test.sh')  # tried again, and found
  assert calls == [*VLLM, PYTEST], calls
  assert (repo / '.venv' / '.flexmarl-missing').read_text() == ''


def test_an_extra_named_alone_must_install(tmp_path):
  repo, bin_dir = _checkout(tmp_path)
  out, calls = _run(repo, bin_dir, 'venv.sh', 'vllm', PIP_FAILS_ON='requirements-vllm.txt')
  assert out.returncode != 0 and calls == ['python3 -m venv .venv', *BASE, VLLM[0]], calls
  out, _ = _run(repo, bin_dir, 'venv.sh', 'everything')
  assert out.returncode == 2 and 'base, test, vllm, real' in out.stderr


def test_a_gpu_machine_gets_the_gpu_vllm_extra(tmp_path):
  repo, bin_dir = _checkout(tmp_path)
  out, calls = _run(repo, bin_dir, 'venv.sh', 'vllm', FLEXMARL_VLLM='gpu')
  assert out.returncode == 0, out.stderr
  assert calls == ['python3 -m venv .venv', *BASE, f'pip install -q {EXTRA} -r requirements-vllm-gpu.txt']


# Stand-ins for the extras, appended to a copy of conftest.py: 'real' needs a distribution
# no one has, 'vllm' one that every test run has.
STAND_INS = '''
EXTRAS['real'] = ('requirements-real.txt', ['no-such-distribution'], ())
EXTRAS['vllm'] = ('requirements-vllm.txt', ['pytest'], ())
'''
MARKED = '''
import pytest

@pytest.mark.extra('real')
def test_needs_the_missing_extra():
  raise AssertionError('ran without its extra')

@pytest.mark.extra('vllm')
def test_needs_the_installed_extra():
  pass
'''


def _pytest(folder):
  return subprocess.run([sys.executable, '-m', 'pytest', '-q', '--strict-markers', '-p',
                         'no:cacheprovider', 'test_marked.py'], cwd=folder, capture_output=True,
                        text=True, timeout=120)


def test_a_test_marked_by_a_missing_extra_is_skipped_and_listed_with_the_fix(tmp_path):
  with open(os.path.join(ROOT, 'tests', 'conftest.py'), encoding='utf-8') as f:
    (tmp_path / 'conftest.py').write_text(f.read() + STAND_INS)
  (tmp_path / 'test_marked.py').write_text(MARKED)
  out = _pytest(tmp_path)
  assert out.returncode == 0, out.stdout + out.stderr
  lines = out.stdout.splitlines()
  said = next(i for i, line in enumerate(lines) if line.startswith('the real extra'))
  assert lines[said].startswith('the real extra (requirements-real.txt) is not installed; '
                                '1 not run. Fix: '), out.stdout
  assert lines[said + 1] == '  test_marked.py::test_needs_the_missing_extra', out.stdout
  assert '1 passed, 1 skipped' in out.stdout and 'the vllm extra' not in out.stdout
  (tmp_path / 'test_marked.py').write_text(MARKED.replace("extra('vllm')", "extra('vlm')"))
  out = _pytest(tmp_path)
  assert out.returncode != 0 and "extra('vlm') names no extra" in out.stdout + out.stderr
