"""`sync`, `sync_parallel` and `flexmarl` train to the same parameters, whether each
agent's rollout instance shares its training devices or has its own."""

import os

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from flexmarl.metrics.writer import read_metrics
from flexmarl.run import build, train
from test_team import two_agent_config

STEPS = 4


def _config(schedule, rollout_devices='shared'):
  c = two_agent_config(steps=STEPS)
  c.schedule = schedule
  c.rollout.devices = rollout_devices
  c.checkpoint_every = STEPS
  # Streaming admission, two instances for the solver and a balancer that moves them
  # eagerly. At most 3 queries a step: the verifier (16 rows a query, batch 48) fills
  # on the third; the solver (8 rows a query, batch 32) carries 24 rows over, then
  # fills on the next step's first query and is served surplus rows after that. Global
  # and micro batches differ between agents.
  c.rollout.query_concurrency, c.rollout.max_step_queries = 2, 3
  c.rollout.balance, c.rollout.balance_threshold, c.rollout.balance_cooldown_s = True, 1.0, 0.0
  c.agents.solver.rollout.instances = 2
  c.agents.solver.global_batch, c.agents.solver.micro_batch = 32, 16  # 2 micro-batches
  c.agents.verifier.global_batch, c.agents.verifier.micro_batch = 48, 16  # 3 micro-batches
  return c


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  out = {}
  for schedule, devices in (('sync', 'shared'), ('flexmarl', 'shared'),
                            ('sync_parallel', 'shared'), ('flexmarl', 'separate')):
    workdir = str(tmp_path_factory.mktemp(schedule))
    train(_config(schedule, devices), workdir, log=lambda *_: None)
    out[schedule if devices == 'shared' else f'{schedule}/{devices}'] = workdir
  return out


def _params(workdir, agent, step=STEPS):
  path = os.path.abspath(os.path.join(workdir, 'checkpoints', agent, str(step), 'state'))
  return jax.tree.leaves(ocp.StandardCheckpointer().restore(path)['params'])


def _lines(workdir):
  return read_metrics(os.path.join(workdir, 'metrics.jsonl'))


@pytest.mark.parametrize('schedule', ['flexmarl', 'sync_parallel', 'flexmarl/separate'])
def test_same_parameters_as_sync(runs, schedule):
  for agent in ('solver', 'verifier'):
    for x, y in zip(_params(runs['sync'], agent), _params(runs[schedule], agent), strict=True):
      assert np.abs(x - y).max() <= 1e-5, (agent, np.abs(x - y).max())
  for a, b in zip(_lines(runs['sync']), _lines(runs[schedule]), strict=True):
    for key in ('reward_mean', 'loss', 'grad_norm', 'tokens', 'policy_version'):
      if key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-5, err_msg=key)


def test_flexmarl_trains_during_rollout(runs):
  def early(workdir):
    return sum(l['early_micro_batches'] for l in _lines(workdir) if l['agent'] != 'team')
  assert early(runs['sync']) == 0
  assert early(runs['flexmarl']) >= STEPS * 2


def test_the_config_exercises_carried_rows_surplus_and_moves(runs):
  lines = _lines(runs['flexmarl'])
  solver = [l for l in lines if l['agent'] == 'solver']
  assert [l['updated'] for l in solver] == [0, 1] * (STEPS // 2)  # carried, then full
  assert sum(l.get('surplus_rows', 0) for l in solver) > 0
  assert sum(l['rebalances'] for l in lines if l['agent'] == 'team') > 0


@pytest.mark.quick
def test_separate_rollout_devices_serve_the_published_weights(tmp_path):
  """With rollout.devices=separate, each sampler holds its own copy of its trainer's
  weights, on devices no trainer uses, and gets the new ones at every update."""
  orch = build(_config('flexmarl', 'separate'), str(tmp_path))
  try:
    train_devices = {d for a in orch.agents.values() for d in a.trainer.mesh.devices.flat}
    for _ in range(2):
      orch.run_step()
    for name, agent in orch.agents.items():
      trainer = agent.trainer
      for instance in agent.pool.instances:
        sampler = instance.sampler
        assert sampler.version == agent.version >= 1
        for w, p in zip(jax.tree.leaves(sampler.state), jax.tree.leaves(trainer.params),
                        strict=True):
          assert not w.sharding.device_set & train_devices
          np.testing.assert_array_equal(np.asarray(w), np.asarray(p))
  finally:
    orch.close()


@pytest.fixture(scope='module')
def dynamic_runs(tmp_path_factory):
  """DAPO dynamic sampling: groups with equal rewards are dropped and later queries
  fill their place, in stream order, so the batch cut is the same under every schedule."""
  out = {}
  for schedule in ('sync', 'flexmarl'):
    c = _config(schedule)
    c.steps = c.checkpoint_every = 3
    # Untrained agents score most groups alike: small batches, and room for the many
    # queries it takes to fill them.
    c.rollout.query_concurrency, c.rollout.max_step_queries = 8, 64
    c.agents.solver.global_batch, c.agents.solver.micro_batch = 16, 8
    c.agents.verifier.global_batch, c.agents.verifier.micro_batch = 8, 4
    for agent in ('solver', 'verifier'):
      c.agents[agent].grpo.dynamic_sampling = True
    out[schedule] = str(tmp_path_factory.mktemp(f'dynamic_{schedule}'))
    train(c, out[schedule], log=lambda *_: None)
  return out


def test_dynamic_sampling_keeps_sync_equal_to_flexmarl(dynamic_runs):
  lines = [l for l in _lines(dynamic_runs['flexmarl']) if l['agent'] != 'team']
  assert sum(l['filtered_rows'] for l in lines) > 0
  assert sum(l['updated'] for l in lines) >= 3
  for schedule in ('sync', 'flexmarl'):  # the dropped groups are never trained on
    updates = [l for l in _lines(dynamic_runs[schedule]) if l['agent'] != 'team' and l['updated']]
    assert [l['zero_spread'] for l in updates] == [0.0] * len(updates), schedule
  # The same rows, cut the same way; behaviour logprobs computed in sampler batches of
  # other sizes differ in their last bits, which Adam's normalisation of near-zero
  # gradient entries can magnify on these tiny batches (8 and 16 rows).
  for agent in ('solver', 'verifier'):
    for x, y in zip(_params(dynamic_runs['sync'], agent, 3),
                    _params(dynamic_runs['flexmarl'], agent, 3), strict=True):
      assert np.abs(x - y).max() <= 1e-4, (agent, np.abs(x - y).max())
