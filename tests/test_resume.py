"""A run resumed from its checkpoint continues with the same numbers."""

import json
import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from flexmarl.run import train
from flexmarl.metrics.writer import read_metrics
from test_team import two_agent_config

NUMBERS = ('reward_mean', 'accuracy', 'loss', 'grad_norm', 'entropy', 'tokens', 'policy_version',
           'rows', 'updated')


def _lines(workdir):
  return [{k: l.get(k) for k in ('step', 'agent', *NUMBERS)}
          for l in read_metrics(os.path.join(workdir, 'metrics.jsonl'))]


def _params(workdir, agent, step):
  path = os.path.join(workdir, 'checkpoints', agent, str(step), 'state')
  return ocp.StandardCheckpointer().restore(os.path.abspath(path))['params']


@pytest.mark.parametrize('schedule', ['sync', 'flexmarl', 'async:1'])
def test_resume_matches_uninterrupted(tmp_path, schedule):
  quiet = lambda *_: None
  straight, resumed = str(tmp_path / 'straight'), str(tmp_path / 'resumed')
  config = two_agent_config(steps=6)
  config.checkpoint_every = 3
  config.schedule = schedule
  if schedule == 'flexmarl':
    # Several waves a step, so that rows carried over a checkpoint were already
    # accumulated once before it (the resumed run must accumulate them again).
    config.rollout.query_concurrency, config.rollout.max_step_queries = 2, 4
  train(config, straight, log=quiet)

  config.steps = 3
  train(config, resumed, log=quiet)
  # A run that died after logging step 4 but before its checkpoint: the line goes.
  with open(os.path.join(resumed, 'metrics.jsonl'), 'a') as f:
    f.write(json.dumps({'step': 4, 'agent': 'solver', 'reward_mean': -1.0}) + '\n{"torn')
  config.steps = 6
  logs = []
  train(config, resumed, log=logs.append)
  assert any('resumed from step 3' in str(l) for l in logs)

  a, b = _lines(straight), _lines(resumed)
  assert len(a) == len(b) == 6 * 3
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      if isinstance(x[k], float):
        np.testing.assert_allclose(x[k], y[k], rtol=1e-6, atol=1e-7, err_msg=f'{k} {x}')
      else:
        assert x[k] == y[k], (k, x, y)
  for agent in ('solver', 'verifier'):
    pa, pb = _params(straight, agent, 6), _params(resumed, agent, 6)
    for u, v in zip(jax.tree.leaves(pa), jax.tree.leaves(pb), strict=True):
      np.testing.assert_allclose(u, v, atol=1e-6)


def test_resume_without_the_store_says_it_drops_the_carried_rows(tmp_path):
  """Rows carried over a checkpoint live in the ExperienceStore: a workdir that lost its
  store does not resume silently with a different batch; it says it goes on without them."""
  config = two_agent_config(steps=1)  # the solver's 48 rows wait for its next batch
  config.checkpoint_every = 1
  workdir = str(tmp_path / 'run')
  train(config, workdir, log=lambda *_: None)
  # the first run's summary names the agent that has not updated yet
  with open(os.path.join(workdir, 'summary.json')) as f:
    solver = json.load(f)['agents']['solver']
  assert solver['updates'] == 0 and np.isnan(solver['first_reward'])
  shutil.rmtree(os.path.join(workdir, 'store'))
  config.steps = 2
  logged = []
  assert train(config, workdir, log=logged.append)['steps'] == 2
  warning = next(l for l in logged if "agent 'solver'" in l and 'store does not hold' in l)
  assert 'Way forward taken' in warning and 'without these 48 carried rows' in warning
