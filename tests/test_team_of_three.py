"""The 'your own team' experiment runs from the command line, as the README says."""

import collections
import json
import os
import subprocess
import sys

import pytest

from conftest import FAST_COMPILE
from experiments import team_of_three

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS=f'--xla_force_host_platform_device_count=8 {FAST_COMPILE}')


@pytest.mark.quick
def test_best_constant_accuracies_of_the_docstring():
  assert team_of_three.best_constant_accuracy() == {
      'planner': 1 / 3, 'worker': 3 / 15, 'judge': 21 / 75}


def test_runlocal_trains_all_three_agents_from_the_command_line(tmp_path):
  out = subprocess.run(
      [sys.executable, '-m', 'flexmarl.main',
       '--config=experiments/planner_workers_judge.py:runlocal', f'--workdir={tmp_path}/run',
       '--config.steps=2', '--config.checkpoint_every=2', '--config.rollout.devices=shared'],
      cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = [json.loads(l) for l in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()]
  updates = collections.Counter()
  for line in lines:
    updates[line['agent']] += line.get('updated', 0)
  # Every agent, the worker fed by two parallel calls per query, took one update a step.
  assert {a: updates[a] for a in ('planner', 'worker', 'judge')} == {
      'planner': 2, 'worker': 2, 'judge': 2}
  owner = json.loads((tmp_path / 'run' / 'run.json').read_text())
  assert owner['workflow'] == 'experiments.team_of_three:PlannerWorkersJudge'
