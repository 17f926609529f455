"""The 'your own team' experiment runs from the command line, as the README says."""

import asyncio
import collections
import json
import os
import subprocess
import sys

import pytest

from conftest import FAST_COMPILE
from experiments import team_of_three
from flexmarl.workflows.base import Completion, Query

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


class _Samples:
  """An agent that answers the k-th sample of each call with `answers(prompt)[k]`."""

  def __init__(self, name, answers):
    self.name, self.answers, self.served = name, answers, []

  async def generate(self, prompt, n=None, **_):
    texts = self.answers(prompt)
    out = [Completion(f'{self.name}{len(self.served)}_{j}', self.name, t, 0)
           for j, t in enumerate(texts)]
    self.served += out
    return out


def test_an_outcome_planner_is_paid_by_its_own_plans_final_answer():
  """`dbl:3,1` (answer 6): plans `*`, `+`, `x` (invalid), `*`. Each valid plan is carried
  out once by a worker and a judge that answer right for what they are given: `*` ends
  at 6 (paid 1), `+` at max(4, 2) = 4 (paid 0), an invalid plan earns 0."""
  flow = team_of_three.PlannerWorkersJudge(planner_reward='outcome')
  query = Query('q0', 'dbl:3,1', '6', 'dbl', {'symbol': '*', 'digits': (3, 1)})
  ops = {'*': lambda x: 2 * x, '+': lambda x: x + 1, '-': lambda x: 4 - x}
  agents = {
      'planner': _Samples('planner', lambda p: ['*', '+', 'x', '*']),
      'worker': _Samples('worker', lambda p: [str(ops[p[0]](int(p[1])))] * 2),
      'judge': _Samples('judge', lambda p: [str(max(map(int, p[:-1].split(','))))] * 2)}
  episode = asyncio.run(flow.run(query, agents))
  plans = agents['planner'].served
  assert [episode.rewards[c.sample_id] for c in plans] == [1.0, 0.0, 0.0, 1.0]
  assert [episode.correct[c.sample_id] for c in plans] == [True, False, False, True]
  assert len(agents['worker'].served) == 2 * 4 and len(agents['judge'].served) == 2 * 2
  with pytest.raises(ValueError, match='planner_reward'):
    team_of_three.PlannerWorkersJudge(planner_reward='plans')
