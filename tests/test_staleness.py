"""`async:k`: rollout runs ahead of training, but no row trains parameters more than
k versions newer than the ones that sampled it; older rows are dropped and counted."""

import os

import numpy as np
import pytest

from flexmarl.agent import Agent
from flexmarl.metrics.writer import read_metrics
from flexmarl.run import train
from flexmarl.store.experience_store import ExperienceStore
from test_team import two_agent_config

K, STEPS = 2, 8


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  """An `async:2` run, with every accumulated micro-batch seen from outside the
  orchestrator: (agent, version of the parameters it updates, its rows' versions)."""
  seen = []
  original = Agent.accumulate

  def spy(self, micro):
    seen.append((self.name, self.version,
                 [(sid, g.served.version) for g in micro for sid in g.served.sample_ids]))
    original(self, micro)

  workdir = str(tmp_path_factory.mktemp('async'))
  config = two_agent_config(steps=STEPS)
  config.schedule = f'async:{K}'
  # The verifier is served 128 rows every two steps and trains 48 a step: its buffer
  # over-fills, so rows reach the bound and some go stale.
  config.agents.verifier.global_batch, config.agents.verifier.micro_batch = 48, 16
  config.checkpoint_every = STEPS
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(Agent, 'accumulate', spy)
    train(config, workdir, log=lambda *_: None)
  return workdir, seen


@pytest.mark.quick
def test_no_trained_row_is_older_than_the_bound(run):
  _, seen = run
  lags = [version - v for _, version, rows in seen for _, v in rows]
  assert lags and min(lags) >= 0
  assert max(lags) == K  # the verifier's buffer over-fills: its oldest rows reach the bound


def test_every_served_row_is_trained_once_dropped_or_still_buffered(run):
  workdir, seen = run
  lines = read_metrics(os.path.join(workdir, 'metrics.jsonl'))
  with ExperienceStore.open(os.path.join(workdir, 'store'), ['solver', 'verifier']) as store:
    for agent in ('solver', 'verifier'):
      trained = {sid: v for name, _, rows in seen if name == agent for sid, v in rows}
      assert len(trained) == sum(len(rows) for name, _, rows in seen if name == agent), \
          'a row was trained on twice'
      # the version each trained row carries is the one the store recorded at serving
      stored = store.read(agent, sample_ids=list(trained))
      assert {r.sample_id: r.policy_version for r in stored} == trained
      mine = [l for l in lines if l['agent'] == agent]
      dropped = sum(l['stale_dropped'] for l in mine)
      served = store.count(agent)
      assert served == len(trained) + dropped + mine[-1]['buffered_rows'], agent
      assert store.count(agent, consumed=True) == len(trained)
      assert sum(l.get('rows', 0) for l in mine) == len(trained)
      assert max(l.get('staleness_max', 0) for l in mine) <= K
  verifier = [l for l in lines if l['agent'] == 'verifier']
  assert sum(l['stale_dropped'] for l in verifier) > 0


def test_training_overlaps_the_rollout_of_the_next_version(run):
  """Nothing is served before the first step, so no agent updates in it; each agent's
  first update trains only on version-0 rows; versions count the agent's updates."""
  workdir, seen = run
  lines = read_metrics(os.path.join(workdir, 'metrics.jsonl'))
  for agent in ('solver', 'verifier'):
    first = [rows for name, version, rows in seen if name == agent and version == 0]
    assert first and all(v == 0 for rows in first for _, v in rows)
    mine = [l for l in lines if l['agent'] == agent]
    assert mine[0]['updated'] == 0  # nothing served before the first step
    versions = [l['policy_version'] for l in mine]
    assert versions == list(np.cumsum([0] + [l['updated'] for l in mine[:-1]]))
