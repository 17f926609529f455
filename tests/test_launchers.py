"""The README's two commands share one venv recipe (launchers/venv.sh): whichever runs
first makes .venv with every extra, the other finds it complete, and a .venv made
earlier without the extras is completed. pip and python are stand-ins that log calls."""

import os
import shutil
import stat
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Logs each call; `python3 -m venv DIR` makes DIR/bin/{python,pip} as loggers too.
FAKE = '''#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "$CALLS"
if [ "$(basename "$0")" = pip ] && [ -n "${PIP_FAILS:-}" ]; then exit 1; fi
if [ "$1" = -m ] && [ "$2" = venv ]; then
  mkdir -p "$3/bin"
  cp "$0" "$3/bin/python"; cp "$0" "$3/bin/pip"
fi
'''
RECIPE = ['pip install -q -r requirements.txt', 'pip install -q -r requirements-vllm.txt',
          'pip uninstall -y -q torchvision torchaudio torchcodec triton',
          'pip install -q --no-deps -e .']


def _checkout(tmp_path):
  repo = tmp_path / 'repo'
  (repo / 'launchers').mkdir(parents=True)
  for name in ('venv.sh', 'test.sh', 'local.sh'):
    shutil.copy(os.path.join(ROOT, 'launchers', name), repo / 'launchers' / name)
  for name in ('requirements.txt', 'requirements-vllm.txt'):
    shutil.copy(os.path.join(ROOT, name), repo / name)
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  (bin_dir / 'python3').write_text(FAKE)
  (bin_dir / 'python3').chmod(stat.S_IRWXU)
  return repo, bin_dir


def _run(repo, bin_dir, script, *args, **env):
  calls = repo.parent / 'calls.log'
  calls.write_text('')
  out = subprocess.run(['bash', f'launchers/{script}', *args], cwd=repo, capture_output=True,
                       text=True, timeout=60, env=dict(
                           os.environ, PATH=f'{bin_dir}:{os.environ["PATH"]}',
                           CALLS=str(calls), **env))
  return out, calls.read_text().splitlines()


def test_the_readme_commands_share_one_complete_venv(tmp_path):
  repo, bin_dir = _checkout(tmp_path)
  out, calls = _run(repo, bin_dir, 'local.sh', 'exp.py', 'runs/x', '--config.steps=2')
  assert out.returncode == 0, out.stderr
  assert calls == ['python3 -m venv .venv', *RECIPE,
                   'python -m flexmarl.main --config=exp.py --workdir=runs/x --config.steps=2']
  out, calls = _run(repo, bin_dir, 'test.sh', '-k', 'x')
  assert out.returncode == 0, out.stderr
  assert calls == ['python -m pytest -q tests -k x']  # complete already: nothing installed


def test_a_venv_made_without_the_extras_is_completed(tmp_path):
  repo, bin_dir = _checkout(tmp_path)
  _run(repo, bin_dir, 'venv.sh')
  (repo / '.venv' / '.flexmarl-recipe').unlink()  # as an earlier local.sh left it
  out, calls = _run(repo, bin_dir, 'test.sh')
  assert out.returncode == 0 and calls == [*RECIPE, 'python -m pytest -q tests'], calls
  with open(repo / 'requirements-vllm.txt', 'a') as f:
    f.write('safetensors==9.9\n')  # the requirements changed: installed again
  out, calls = _run(repo, bin_dir, 'test.sh')
  assert calls == [*RECIPE, 'python -m pytest -q tests'], calls


def test_a_failed_install_is_retried_next_time(tmp_path):
  repo, bin_dir = _checkout(tmp_path)
  out, calls = _run(repo, bin_dir, 'test.sh', PIP_FAILS='1')
  assert out.returncode != 0 and calls == ['python3 -m venv .venv', RECIPE[0]], calls
  assert not (repo / '.venv' / '.flexmarl-recipe').exists()
  out, calls = _run(repo, bin_dir, 'test.sh')
  assert out.returncode == 0 and calls == [*RECIPE, 'python -m pytest -q tests'], calls
