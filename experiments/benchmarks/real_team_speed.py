"""The real team's wall time against an earlier commit's, side by side on one machine.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python experiments/benchmarks/real_team_speed.py --base=5272e4c --steps=60 --root=runs/speed

Checks `--base` out into a git worktree (ROOT/base_src) and runs the same command,
`python -m flexmarl.main --config=experiments/real_team.py`, for `--steps` steps from
there and from this checkout, alternating (base first) `--rounds` times, each into a
fresh workdir. Prints per run its wall time (the whole command: start-up, compiles,
evaluations), the median step, the held-out accuracy at the end and, where the commit
reports it, the share of sampled tokens trained on; then the ratio of wall times.
Both share the compile cache (~/.cache/flexmarl/xla): run each once beforehand so that
neither pays a cold cache.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from absl import app, flags

_BASE = flags.DEFINE_string('base', '5272e4c', 'The commit to compare against.')
_STEPS = flags.DEFINE_integer('steps', 60, 'Steps per run.')
_ROUNDS = flags.DEFINE_integer('rounds', 1, 'Base and this checkout, this many times each.')
_ROOT = flags.DEFINE_string('root', 'runs/real_team_speed', 'Worktree and workdirs go here.')
_CONFIG = flags.DEFINE_string('config', 'experiments/real_team.py', 'The experiment.')


def worktree(commit: str, path: str) -> str:
  if not os.path.isdir(path):
    subprocess.run(['git', 'worktree', 'add', '--detach', path, commit], check=True)
  return path


def run(src: str, workdir: str) -> dict:
  """One run of the experiment from checkout `src`; its wall time and summary."""
  command = [sys.executable, '-m', 'flexmarl.main', f'--config={_CONFIG.value}',
             f'--workdir={os.path.abspath(workdir)}', f'--config.steps={_STEPS.value}']
  start = time.perf_counter()
  with open(f'{workdir}.log', 'w', encoding='utf-8') as log:
    subprocess.run(command, cwd=src, stdout=log, stderr=subprocess.STDOUT, check=True)
  wall = time.perf_counter() - start
  with open(os.path.join(workdir, 'summary.json'), encoding='utf-8') as f:
    summary = json.load(f)
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    team = [l for l in map(json.loads, f) if l.get('agent') == 'team' and 'step_time_s' in l]
  return dict(wall_s=wall, median_step_s=statistics.median(l['step_time_s'] for l in team[1:]),
              eval={a: e['last_accuracy'] for a, e in summary.get('eval', {}).items()},
              trained_share={a: s['trained_share'] for a, s in summary['agents'].items()
                             if 'trained_share' in s})


def main(argv) -> None:
  del argv
  os.makedirs(_ROOT.value, exist_ok=True)
  sources = {'base': worktree(_BASE.value, os.path.join(_ROOT.value, 'base_src')),
             'this': os.getcwd()}
  results: dict[str, list[dict]] = {'base': [], 'this': []}
  for r in range(_ROUNDS.value):
    for name, src in sources.items():
      workdir = os.path.join(_ROOT.value, f'{name}{r}')
      result = run(src, workdir)
      results[name].append(result)
      print(f'{name} round {r}: {json.dumps(result)}', flush=True)
  ratio = (statistics.median(x['wall_s'] for x in results['this']) /
           statistics.median(x['wall_s'] for x in results['base']))
  print(f'wall time, this / base ({_BASE.value}): {ratio:.2f}')


if __name__ == '__main__':
  app.run(main)
