"""Long runs: does what is learned stay learned, and do memory and files stay bounded?

  .venv/bin/python experiments/benchmarks/long_run.py --workdir=/tmp/long   # hours
  .venv/bin/python experiments/benchmarks/long_run.py --quick               # a minute or two

Runs the default experiment (hierarchical_assistant) and the three-agent one
(planner_workers_judge) for `--factor` × their default steps (3 by default; `--steps`
sets a number, `--experiments` picks them), each in a process of its own (so that each
has its own resident memory), everything else as shipped (`--store_keep_steps` sets
store retention). Reports per experiment:

- per agent: exact-match accuracy per window of `--window` steps, the largest drop of the
  windowed accuracy below its best so far after it first passed 0.9, and the steps in
  which no row reached it (in all, and the longest run of them);
- over time (at each progress line, 100 a run): resident memory (RSS), the Python heap
  (with `--tracemalloc`; slower), and the sizes of trace.json and of the store folder.

Prints a table per experiment; the last line is JSON (also written to
WORKDIR/long_run.json). `--quick` runs 12 steps of each, windows of 4 steps.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import numpy as np  # pylint: disable=wrong-import-position
from absl import app, flags  # pylint: disable=wrong-import-position

EXPERIMENTS = ('hierarchical_assistant', 'planner_workers_judge')
PASS = 0.9

_WORKDIR = flags.DEFINE_string('workdir', None, 'Where the runs go (default: a temporary '
                               'folder). A workdir with checkpoints resumes them.')
_FACTOR = flags.DEFINE_integer('factor', 3, "Steps: this many times each experiment's default.")
_STEPS = flags.DEFINE_integer('steps', 0, 'Steps of each experiment (0: --factor × its default).')
_EXPERIMENTS = flags.DEFINE_multi_enum('experiments', list(EXPERIMENTS), EXPERIMENTS,
                                       'The experiments to run, in this order.')
_WINDOW = flags.DEFINE_integer('window', 500, 'Steps per accuracy window.')
_KEEP = flags.DEFINE_integer('store_keep_steps', 0, 'config.store_keep_steps (0: every row).')
_QUICK = flags.DEFINE_bool('quick', False, 'A check that it runs: 12 steps, windows of 4.')
_TRACEMALLOC = flags.DEFINE_bool('tracemalloc', False, 'Also record the Python heap (slower).')
_ONLY = flags.DEFINE_enum('only', None, EXPERIMENTS, 'Run this experiment in this process '
                          '(what each child process is started with).')


def _folder_mb(path: str) -> float:
  """The folder's size; read while the store's thread appends, so a file listed may be
  gone (TensorStore's temporary `*.__lock` files) by the time it is measured."""
  total = 0
  for d, _, files in os.walk(path):
    for f in files:
      try:
        total += os.path.getsize(os.path.join(d, f))
      except FileNotFoundError:
        pass
  return total / 2**20


def _rss_mb() -> float:
  with open('/proc/self/status', encoding='utf-8') as f:
    kb = next(int(line.split()[1]) for line in f if line.startswith('VmRSS:'))
  return kb / 1024


def _config(name: str):
  module = __import__(f'experiments.{name}', fromlist=['get_config'])
  config = module.get_config()
  config.steps = 12 if _QUICK.value else _STEPS.value or _FACTOR.value * config.steps
  if _QUICK.value:
    config.checkpoint_every = 4
  if _KEEP.value:
    config.store_keep_steps = max(_KEEP.value, config.checkpoint_every)
  return config


def _run_one(name: str, workdir: str) -> dict:
  """Trains `name` in this process, sampling resources at each progress line."""
  from flexmarl.run import train  # pylint: disable=import-outside-toplevel
  config = _config(name)
  samples = []
  t0 = time.time()
  if _TRACEMALLOC.value:
    tracemalloc.start()

  def log(line) -> None:
    text = str(line)
    if text.startswith('step ') and '/' in text.split()[1]:
      samples.append(dict(
          step=int(text.split()[1].split('/')[0]), wall_s=round(time.time() - t0, 1),
          rss_mb=round(_rss_mb(), 1),
          py_heap_mb=(round(tracemalloc.get_traced_memory()[0] / 2**20, 1)
                      if _TRACEMALLOC.value else None),
          trace_mb=round(os.path.getsize(os.path.join(workdir, 'trace.json')) / 2**20, 2)
          if os.path.exists(os.path.join(workdir, 'trace.json')) else 0.0,
          store_mb=round(_folder_mb(os.path.join(workdir, 'store')), 2)))
    elif text.startswith('warning'):
      print(text, flush=True)

  train(config, workdir, log=log)
  return dict(experiment=name, steps=config.steps, wall_s=round(time.time() - t0),
              samples=samples)


def _agents_report(metrics_path: str, window: int) -> dict:
  """Per agent: accuracy per window, the largest drop after passing 0.9, steps without rows."""
  from flexmarl.metrics.writer import TEAM, read_metrics  # pylint: disable=import-outside-toplevel
  lines = [l for l in read_metrics(metrics_path) if l['agent'] != TEAM]
  report = {}
  for agent in dict.fromkeys(l['agent'] for l in lines):
    mine = sorted((l for l in lines if l['agent'] == agent), key=lambda l: l['step'])
    windows = []
    for lo in range(0, len(mine), window):
      acc = [l['accuracy'] for l in mine[lo:lo + window] if not np.isnan(l['accuracy'])]
      windows.append(round(float(np.mean(acc)), 3) if acc else None)
    drop, best, passed = 0.0, -1.0, False
    for acc in windows:
      if acc is None:
        continue
      best = max(best, acc)
      passed = passed or acc >= PASS
      if passed:
        drop = max(drop, best - acc)
    starved = [l['tokens'] == 0 for l in mine]
    longest = run = 0
    for s in starved:
      run = run + 1 if s else 0
      longest = max(longest, run)
    report[agent] = dict(accuracy_per_window=windows, passed_0_9=passed,
                         largest_drop_after_0_9=round(drop, 3) if passed else None,
                         steps_without_rows=int(sum(starved)),
                         longest_without_rows=longest)
  return report


def _table(result: dict) -> str:
  rows = [f"{result['experiment']}: {result['steps']} steps in {result['wall_s']} s, "
          f"windows of {result['window']} steps"]
  for agent, r in result['agents'].items():
    windows = ' '.join('-' if a is None else f'{a:.2f}' for a in r['accuracy_per_window'])
    drop = '-' if r['largest_drop_after_0_9'] is None else f"{r['largest_drop_after_0_9']:.2f}"
    rows.append(f"  {agent:<10} acc/window {windows}  drop after 0.9: {drop}  steps without "
                f"rows: {r['steps_without_rows']} (longest {r['longest_without_rows']})")
  samples = result['samples']
  for s in ([samples[0], samples[len(samples) // 2], samples[-1]] if samples else []):
    heap = '' if s['py_heap_mb'] is None else f", Python heap {s['py_heap_mb']} MB"
    rows.append(f"  step {s['step']:>6}: RSS {s['rss_mb']} MB{heap}, trace.json "
                f"{s['trace_mb']} MB, store {s['store_mb']} MB")
  return '\n'.join(rows)


def main(argv) -> None:
  del argv
  window = 4 if _QUICK.value else _WINDOW.value
  workdir = _WORKDIR.value or tempfile.mkdtemp(prefix='long_run_')
  if _ONLY.value:  # a child: train one experiment, write its samples
    folder = os.path.join(workdir, _ONLY.value)
    result = _run_one(_ONLY.value, folder)
    with open(os.path.join(folder, 'samples.json'), 'w', encoding='utf-8') as f:
      json.dump(result, f)
    return
  results = []
  for name in _EXPERIMENTS.value:
    flags_through = [f'--{f.name}={f.value}'
                     for f in (_FACTOR, _STEPS, _KEEP, _QUICK, _TRACEMALLOC)]
    subprocess.run([sys.executable, os.path.abspath(__file__), f'--only={name}',
                    f'--workdir={workdir}', *flags_through], check=True, cwd=ROOT)
    folder = os.path.join(workdir, name)
    with open(os.path.join(folder, 'samples.json'), encoding='utf-8') as f:
      result = json.load(f)
    result['window'] = window
    result['agents'] = _agents_report(os.path.join(folder, 'metrics.jsonl'), window)
    print(_table(result), flush=True)
    results.append(result)
  with open(os.path.join(workdir, 'long_run.json'), 'w', encoding='utf-8') as f:
    json.dump(results, f)
  print(json.dumps(results))


if __name__ == '__main__':
  app.run(main)
