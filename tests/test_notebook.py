"""Runs colab/quickstart.ipynb top to bottom and checks that its solver learned."""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import pytest

nbformat = pytest.importorskip('nbformat')
nbclient = pytest.importorskip('nbclient')

COLAB = pathlib.Path(__file__).resolve().parent.parent / 'colab'
NOTEBOOK = COLAB / 'quickstart.ipynb'


def test_quickstart_notebook_trains_the_solver(tmp_path, monkeypatch):
  # The kernel inherits this environment: the notebook trains into tmp_path.
  monkeypatch.setenv('FLEXMARL_NB_WORKDIR', str(tmp_path))
  nb = nbformat.read(NOTEBOOK, as_version=4)
  # 'python3' resolves to the interpreter running the test (jupyter_client swaps a bare
  # 'python' in the kernelspec for sys.executable), i.e. the venv's.
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name='python3',
                                   resources={'metadata': {'path': str(COLAB)}})
  client.execute()

  from flexmarl.metrics.writer import read_metrics  # pylint: disable=import-outside-toplevel
  lines = read_metrics(os.path.join(tmp_path, 'metrics.jsonl'))
  solver = [l['reward_mean'] for l in sorted(lines, key=lambda l: l['step'])
            if l['agent'] == 'solver']
  assert len(solver) >= 20, f'expected a run of 20+ steps, got {len(solver)}'
  first, last = float(np.mean(solver[:10])), float(np.mean(solver[-10:]))
  assert last > first + 0.2, f'solver reward did not improve: first 10 steps {first:.3f}, last 10 {last:.3f}'

  # The notebook's own summary agrees with the metrics it plotted.
  with open(os.path.join(tmp_path, 'quickstart_summary.json'), encoding='utf-8') as f:
    summary = json.load(f)
  assert summary['workdir'] == str(tmp_path)
  assert summary['steps'] == len(solver)
  assert summary['solver']['first10_reward'] == pytest.approx(first)
  assert summary['solver']['last10_reward'] == pytest.approx(last)
  assert {'checker', 'solver'} <= set(summary)
