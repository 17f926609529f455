"""A run resumed from its checkpoint continues with the same numbers."""

import json
import os
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from flexmarl.data.journal import Journal
from flexmarl.metrics.writer import read_metrics
from flexmarl.run import train
from flexmarl.store.experience_store import ExperienceStore
from flexmarl.train.checkpoint import AgentCheckpointer
from test_team import two_agent_config

AGENTS = ('solver', 'verifier')

NUMBERS = ('reward_mean', 'accuracy', 'loss', 'grad_norm', 'entropy', 'tokens', 'policy_version',
           'rows', 'updated')


def _lines(workdir):
  return [{k: l.get(k) for k in ('step', 'agent', *NUMBERS)}
          for l in read_metrics(os.path.join(workdir, 'metrics.jsonl'))]


def _params(workdir, agent, step):
  path = os.path.join(workdir, 'checkpoints', agent, str(step), 'state')
  return ocp.StandardCheckpointer().restore(os.path.abspath(path))['params']


def assert_same_run(straight: str, resumed: str, steps: int) -> None:
  """The two workdirs' metrics lines and final parameters agree: a resumed run is the
  uninterrupted one."""
  a, b = _lines(straight), _lines(resumed)
  assert len(a) == len(b) == steps * 3
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      if isinstance(x[k], float):
        np.testing.assert_allclose(x[k], y[k], rtol=1e-6, atol=1e-7, err_msg=f'{k} {x}')
      else:
        assert x[k] == y[k], (k, x, y)
  for agent in AGENTS:
    pa, pb = _params(straight, agent, steps), _params(resumed, agent, steps)
    for u, v in zip(jax.tree.leaves(pa), jax.tree.leaves(pb), strict=True):
      np.testing.assert_allclose(u, v, atol=1e-6)


class _Deferred:
  """A future that runs its work only when its result is asked for."""

  def __init__(self, fn, args):
    self._fn, self._args, self._done = fn, args, False

  def done(self):
    return self._done

  def result(self):
    if not self._done:
      self._fn(*self._args)
      self._done = True


class _DeferredExecutor:
  """The journal's store writer, made as slow as it may be: an append lands only once
  the journal waits for it (at a save, or at close)."""

  def submit(self, fn, *args):
    return _Deferred(fn, args)

  def shutdown(self):
    pass


class CheckpointWatch:
  """Watches a run's checkpoints against its store, as a crash would see them; fails the
  run at the first mismatch.

  At every checkpoint save: the rows it carries are in the store already, and the rows
  the store marks consumed are exactly those trained on up to the previous checkpoint.
  Rows are marked consumed only once every agent's checkpoint of the step is written.
  """

  def __init__(self, monkeypatch):
    self.trained = {a: set() for a in AGENTS}  # every row an update trained on so far
    self.consumed = {a: set() for a in AGENTS}  # rows a written checkpoint trained on
    self.saved = {}  # agent -> checkpoint folder saved since the last marking
    self.carried = {}  # (agent, step) -> ids the checkpoint carries
    watch = self
    journal_init, trained, checkpointed = Journal.__init__, Journal.trained, Journal.checkpointed
    save = AgentCheckpointer.save

    def init(journal, *args, **kwargs):
      journal_init(journal, *args, **kwargs)
      journal._writer = _DeferredExecutor()

    def on_trained(journal, name, groups):
      watch.trained[name] |= {s for g in groups for s in g.served.sample_ids}
      trained(journal, name, groups)

    def on_save(checkpointer, step, train_state, meta):
      agent = os.path.basename(checkpointer.directory)
      carried = {s for ref in meta['buffer'] for s in ref['sample_ids']}
      watch.carried[agent, step] = carried
      workdir = os.path.dirname(os.path.dirname(checkpointer.directory))
      with ExperienceStore.open(os.path.join(workdir, 'store'), list(AGENTS)) as store:
        stored = {r.sample_id for r in store.read(agent)}
        consumed = {r.sample_id for r in store.read(agent, consumed=True)}
      assert carried <= stored, f'{agent} step {step}: carries rows the store does not hold yet'
      assert consumed == watch.consumed[agent], (
          f'{agent} step {step}: {len(consumed)} rows consumed, expected '
          f'{len(watch.consumed[agent])} (those trained on up to the last checkpoint)')
      watch.saved[agent] = os.path.join(checkpointer.directory, str(step))
      save(checkpointer, step, train_state, meta)

    def on_checkpointed(journal, *args):
      for agent in AGENTS:
        folder = watch.saved.pop(agent, None)
        assert folder and os.path.isdir(folder), (
            f'{agent}: rows marked consumed before the checkpoint that trained on them '
            f'({folder or "none since the last marking"}) was written')
        watch.consumed[agent] = set(watch.trained[agent])
      checkpointed(journal, *args)

    monkeypatch.setattr(Journal, '__init__', init)
    monkeypatch.setattr(Journal, 'trained', on_trained)
    monkeypatch.setattr(Journal, 'checkpointed', on_checkpointed)
    monkeypatch.setattr(AgentCheckpointer, 'save', on_save)


@pytest.fixture(scope='module', params=['sync', 'flexmarl', 'async:1'])
def straight(request, tmp_path_factory):
  """A 6-step run checkpointed at steps 3 and 6, watched (see CheckpointWatch)."""
  schedule = request.param
  config = two_agent_config(steps=6)
  config.checkpoint_every = 3
  config.schedule = schedule
  if schedule == 'flexmarl':
    # Few queries in flight, so that rows carried over a checkpoint were already
    # accumulated once before it (the resumed run must accumulate them again).
    config.rollout.query_concurrency, config.rollout.max_step_queries = 2, 4
  workdir = str(tmp_path_factory.mktemp(schedule.replace(':', '')))
  with pytest.MonkeyPatch.context() as mp:
    watch = CheckpointWatch(mp)
    train(config, workdir, log=lambda *_: None)
  return config, workdir, watch


def test_checkpoints_carry_stored_rows_and_consumed_flags_follow_them(straight):
  """Bugs: a checkpoint written before the pending store appends are flushed; rows marked
  consumed before the checkpoint that trained on them is written, or at every step."""
  _, workdir, watch = straight  # the watch checked every save and every marking
  assert any(watch.carried[a, 3] for a in AGENTS), 'no checkpoint carried rows'
  with ExperienceStore.open(os.path.join(workdir, 'store'), list(AGENTS)) as store:
    for agent in AGENTS:
      consumed = {r.sample_id for r in store.read(agent, consumed=True)}
      assert consumed == watch.trained[agent] and not consumed & watch.carried[agent, 6]


def test_resume_matches_uninterrupted(straight, tmp_path):
  quiet = lambda *_: None
  config, straight, _ = straight
  config = config.copy_and_resolve_references()
  resumed = str(tmp_path / 'resumed')
  config.steps = 3
  train(config, resumed, log=quiet)
  # A run that died after logging step 4 but before its checkpoint: the line goes.
  with open(os.path.join(resumed, 'metrics.jsonl'), 'a') as f:
    f.write(json.dumps({'step': 4, 'agent': 'solver', 'reward_mean': -1.0}) + '\n{"torn')
  config.steps = 6
  logs = []
  train(config, resumed, log=logs.append)
  assert any('resumed from step 3' in str(l) for l in logs)

  assert_same_run(straight, resumed, 6)


@pytest.mark.quick
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
