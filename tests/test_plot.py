"""`python -m flexmarl.plot WORKDIR` writes PNGs that decode as non-trivial images."""

import json
import os
import subprocess
import sys

import matplotlib.image
import numpy as np
import pytest

from flexmarl import plot
from flexmarl.core.clock import SimClock
from flexmarl.metrics import spans as sp
from flexmarl.metrics.spans import SpanRecorder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _workdir(path) -> str:
  """Six steps of two agents: metrics lines, and a pipelined trace on four tracks."""
  rng = np.random.default_rng(0)
  with open(path / 'metrics.jsonl', 'w') as f:
    for step in range(1, 7):
      for agent in ('solver', 'verifier'):
        f.write(json.dumps({'step': step, 'agent': agent, 'reward_mean': step / 6 + rng.normal(0, .05),
                            'accuracy': min(1.0, step / 5), 'tokens': 512}) + '\n')
      f.write(json.dumps({'step': step, 'agent': 'team', 'reward_mean': step / 6,
                          'step_time_s': 2.0}) + '\n')
  clock = SimClock(1000.0)
  rec = SpanRecorder.for_workdir(clock, str(path))
  for step in range(1, 7):
    t = clock.now()
    for i in range(2):
      for agent in ('solver', 'verifier'):
        rec.add(f'rollout:{agent}/{i}', sp.GENERATE, t, t + rng.uniform(0.5, 1.0), agent=agent,
                version=step - 1, tokens=256, step=step)
    for agent, lag in (('solver', 0.2), ('verifier', 0.6)):
      rec.add(f'train:{agent}', sp.WAIT, t, t + lag, agent=agent, step=step)
      rec.add(f'train:{agent}', sp.MICRO_BATCH, t + lag, t + lag + 0.5, agent=agent,
              version=step - 1, step=step)
      rec.add(f'train:{agent}', sp.OPTIMIZER_STEP, t + lag + 0.5, t + lag + 0.6, agent=agent,
              version=step - 1, step=step)
      rec.add(f'rollout:{agent}/0', sp.WEIGHT_SYNC, t + 1.2, t + 1.3, agent=agent, version=step,
              bytes=1 << 20, step=step)
    clock.advance(1.4)
  rec.close()
  return str(path)


def _check_png(path):
  image = matplotlib.image.imread(path)
  assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 300
  colours = np.unique(image[..., :3].reshape(-1, 3).round(2), axis=0)
  assert len(colours) > 10, f'{path} is nearly blank ({len(colours)} colours)'


@pytest.mark.quick
def test_plot_workdir_writes_decodable_images(tmp_path):
  paths = plot.plot_workdir(_workdir(tmp_path))
  assert [os.path.basename(p) for p in paths] == ['learning.png', 'utilization.png',
                                                 'gantt_step5.png', 'gantt_step6.png']
  for p in paths:
    _check_png(p)
  with pytest.raises(ValueError, match='step 9 has no spans'):
    plot.plot_workdir(str(tmp_path), steps=[9])


def test_moving_mean_smooths_and_skips_nan():
  np.testing.assert_allclose(plot.moving_mean([1, 2, 3, 4], 2), [1, 1.5, 2.5, 3.5])
  np.testing.assert_allclose(plot.moving_mean([1, 2, 3, 4], 1), [1, 2, 3, 4])
  np.testing.assert_allclose(plot.moving_mean([np.nan, 2, np.nan, 4, 6], 3),
                             [np.nan, 2, 2, 3, 5])
  assert (plot.auto_window(6), plot.auto_window(1500)) == (1, 60)


def test_learning_curves_are_smoothed_with_the_raw_values_behind(tmp_path, monkeypatch):
  lines = [{'step': s, 'agent': 'solver', 'reward_mean': float(s % 2), 'accuracy': 1.0}
           for s in range(1, 101)]
  drawn = []
  monkeypatch.setattr(plot.plt, 'close', drawn.append)  # keep the figure to look at it
  plot.plot_learning(lines, str(tmp_path / 'learning.png'), window=10)
  reward = drawn[0].axes[0]
  faint, smooth = reward.get_lines()
  assert faint.get_alpha() < 0.5 and smooth.get_label() == 'solver (mean of 10)'
  np.testing.assert_array_equal(faint.get_ydata(), [s % 2 for s in range(1, 101)])
  assert np.ptp(smooth.get_ydata()[10:]) <= 0.1  # the alternation averaged out
  _check_png(str(tmp_path / 'learning.png'))


def test_plot_command_line(tmp_path):
  workdir = _workdir(tmp_path)
  out = subprocess.run([sys.executable, '-m', 'flexmarl.plot', workdir, '--steps=2',
                        '--smooth=3'], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, check=True).stdout
  assert out.split() == [os.path.join(workdir, 'plots', n)
                         for n in ('learning.png', 'utilization.png', 'gantt_step2.png')]
  _check_png(os.path.join(workdir, 'plots', 'gantt_step2.png'))
