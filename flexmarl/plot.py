"""PNG plots of a run: learning curves, utilization per device group, Gantt charts.

  python -m flexmarl.plot WORKDIR [--steps=3,4] [--smooth=N]

reads WORKDIR/metrics.jsonl and WORKDIR/trace.json and writes into WORKDIR/plots/:
  learning.png      reward_mean, accuracy, accuracy above the best constant answer's and
                    held-out accuracy per agent over steps ('team' dashed): a moving
                    mean over --smooth steps (default: about 1/25 of the run), the raw
                    per-step values faint behind it
  utilization.png   busy share per device group over the run, and per step
  gantt_step{N}.png every track's spans in the window of step N (default: the last two)
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import matplotlib
import numpy as np

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
from absl import app, flags  # pylint: disable=g-import-not-at-top

from flexmarl.metrics import utilization as ut  # pylint: disable=g-import-not-at-top
from flexmarl.metrics.spans import TRACE_FILE, Span, load_spans
from flexmarl.metrics.writer import TEAM, read_metrics

# above_constant: accuracy minus the best constant answer's; eval: held-out, greedy
CURVES = ('reward_mean', 'accuracy', 'above_constant', 'eval_accuracy')


def auto_window(points: int) -> int:
  """The default smoothing window: about 1/25 of the points (1, no smoothing, for short runs)."""
  return max(1, round(points / 25))


def moving_mean(values: Sequence[float], window: int) -> np.ndarray:
  """The mean of each value and the `window - 1` before it (fewer at the start); NaN
  values (an agent without answers that step) are left out, NaN where all are NaN."""
  x = np.asarray(values, dtype=float)
  known = ~np.isnan(x)
  sums = np.concatenate([[0.0], np.cumsum(np.where(known, x, 0.0))])
  counts = np.concatenate([[0], np.cumsum(known)])
  hi = np.arange(1, len(x) + 1)
  lo = np.maximum(hi - window, 0)
  n = counts[hi] - counts[lo]
  with np.errstate(invalid='ignore', divide='ignore'):
    return np.where(n > 0, (sums[hi] - sums[lo]) / np.maximum(n, 1), math.nan)


def plot_learning(lines: list[dict], path: str, window: int = 0) -> None:
  """Curves smoothed over `window` steps (0: `auto_window`), raw values faint behind."""
  agents = sorted({line['agent'] for line in lines}, key=lambda a: (a == TEAM, a))
  fig, axes = plt.subplots(1, len(CURVES), figsize=(6 * len(CURVES), 4), squeeze=False)
  for ax, key in zip(axes[0], CURVES):
    for agent in agents:
      points = sorted((l['step'], l[key]) for l in lines if l['agent'] == agent and key in l)
      if points:
        steps, values = zip(*points)
        w = window or auto_window(len(values))
        style = '--' if agent == TEAM else '-'
        if w > 1:
          raw, = ax.plot(steps, values, style, alpha=0.2, linewidth=0.8)
          ax.plot(steps, moving_mean(values, w), style, color=raw.get_color(),
                  label=f'{agent} (mean of {w})')
        else:
          ax.plot(steps, values, style, label=agent)
    ax.set(title=key, xlabel='step')
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a curve no line has stays empty
      ax.legend(fontsize='small')
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def plot_utilization(spans: Sequence[Span], path: str) -> None:
  window = ut.span_window(spans)
  groups = ut.group_usage(ut.track_usage(spans, window))
  report = ut.step_report(spans)
  fig, (bars, lines) = plt.subplots(1, 2, figsize=(13, 4))
  names = sorted(groups)
  bars.barh(names, [groups[g].utilization for g in names], color='tab:blue')
  bars.invert_yaxis()
  bars.set(xlim=(0, 1), xlabel='busy / wall', title='utilization over the run')
  for g in names:
    points = [(step, e['groups'][g].utilization) for step, e in report.items() if g in e['groups']]
    if points:
      lines.plot(*zip(*points), marker='.', label=g)
  lines.set(ylim=(0, 1.05), xlabel='step', ylabel='busy / wall', title='utilization per step')
  lines.grid(alpha=0.3)
  lines.legend(fontsize='small')
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def plot_gantt(spans: Sequence[Span], step: int, path: str) -> None:
  windows = ut.step_windows(spans)
  if step not in windows:
    raise ValueError(f'--steps: step {step} has no spans in the trace; it has '
                     f'steps {sorted(windows)}.')
  t0, t1 = windows[step]
  tracks = sorted({s.track for s in spans})
  inside = [s for s in spans if s.end > t0 and s.start < t1]
  kinds = sorted({s.name for s in inside if s.busy})
  colors = {k: plt.get_cmap('tab10')(i % 10) for i, k in enumerate(kinds)}
  fig, ax = plt.subplots(figsize=(12, 0.45 * len(tracks) + 1.5))
  for s in inside:
    y = tracks.index(s.track)
    left, width = max(s.start, t0) - t0, min(s.end, t1) - max(s.start, t0)
    if s.busy:
      # Other steps' work in this window is drawn lighter.
      ax.barh(y, width, left=left, color=colors[s.name], alpha=1.0 if s.step == step else 0.45,
              edgecolor='black', linewidth=0.3)
    else:
      ax.barh(y, width, left=left, color='none', edgecolor='grey', hatch='//', linewidth=0.3)
  for k in kinds:
    ax.barh(0, 0, color=colors[k], label=k)
  ax.barh(0, 0, color='none', edgecolor='grey', hatch='//', label='wait')
  ax.set_yticks(range(len(tracks)), tracks)
  ax.invert_yaxis()
  ax.set(xlim=(0, t1 - t0), xlabel='seconds since the step began',
         title=f'step {step}: {t1 - t0:.3g} s')
  ax.legend(fontsize='small', loc='upper left', bbox_to_anchor=(1.0, 1.0))
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def plot_workdir(workdir: str, steps: Sequence[int] | None = None, smooth: int = 0
                 ) -> list[str]:
  """Writes the PNGs it has data for; returns their paths. `smooth`: the learning
  curves' window in steps (0: about 1/25 of the run; 1: raw values only)."""
  out = os.path.join(workdir, 'plots')
  os.makedirs(out, exist_ok=True)
  written = []
  metrics = os.path.join(workdir, 'metrics.jsonl')
  if os.path.exists(metrics):
    written.append(os.path.join(out, 'learning.png'))
    plot_learning(read_metrics(metrics), written[-1], smooth)
  trace = os.path.join(workdir, TRACE_FILE)
  spans = load_spans(trace) if os.path.exists(trace) else []
  if spans:
    written.append(os.path.join(out, 'utilization.png'))
    plot_utilization(spans, written[-1])
    for step in steps if steps is not None else sorted(ut.step_windows(spans))[-2:]:
      written.append(os.path.join(out, f'gantt_step{step}.png'))
      plot_gantt(spans, step, written[-1])
  if not written:
    raise FileNotFoundError(f'{workdir} has neither metrics.jsonl nor a non-empty {TRACE_FILE}: '
                            'pass the --workdir of a run.')
  return written


_STEPS = flags.DEFINE_list('steps', None, 'Steps to draw as Gantt charts (default: the last two).')
_SMOOTH = flags.DEFINE_integer('smooth', 0, 'Learning curves: moving mean over this many steps '
                               '(0: about 1/25 of the run; 1: raw values only).', lower_bound=0)


def main(argv: Sequence[str]) -> None:
  if len(argv) != 2:
    raise app.UsageError('usage: python -m flexmarl.plot WORKDIR [--steps=3,4] [--smooth=N]')
  steps = None if _STEPS.value is None else [int(s) for s in _STEPS.value]
  for path in plot_workdir(argv[1], steps, _SMOOTH.value):
    print(path)


if __name__ == '__main__':
  app.run(main)
