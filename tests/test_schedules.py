"""`sync`, `sync_parallel` and `flexmarl` train to the same parameters, whether each
agent's rollout instance shares its training devices or has its own."""

import os

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from flexmarl.run import build, train
from flexmarl.metrics.writer import read_metrics
from test_team import two_agent_config

STEPS = 4


def _config(schedule, rollout_devices='shared'):
  c = two_agent_config(steps=STEPS)
  c.schedule = schedule
  c.rollout.devices = rollout_devices
  c.checkpoint_every = STEPS
  # Small waves, so that a batch fills over several of them and the pipeline has
  # micro-batches to start early. Global and micro batches differ between agents.
  c.rollout.queries_per_wave, c.rollout.max_waves = 2, 8
  c.agents.solver.global_batch, c.agents.solver.micro_batch = 32, 16  # 2 waves, 2 micro
  c.agents.verifier.global_batch, c.agents.verifier.micro_batch = 64, 16  # 2 waves, 4 micro
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


def _params(workdir, agent):
  path = os.path.abspath(os.path.join(workdir, 'checkpoints', agent, str(STEPS), 'state'))
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
  # the solver's first micro-batch (of two) and the verifier's first two (of four)
  # are ready before the last wave of each step
  assert early(runs['flexmarl']) >= STEPS * (1 + 2)
  updates = [l['updated'] for l in _lines(runs['flexmarl']) if l['agent'] != 'team']
  assert sum(updates) == 2 * STEPS


def test_separate_rollout_devices_serve_the_published_weights(tmp_path):
  """With rollout.devices=separate, each sampler holds its own copy of its trainer's
  weights, on devices no trainer uses, and gets the new ones at every update."""
  orch = build(_config('flexmarl', 'separate'), str(tmp_path))
  try:
    train_devices = {d for t in orch.trainers.values() for d in t.mesh.devices.flat}
    for _ in range(2):
      orch.run_step()
    for name, trainer in orch.trainers.items():
      sampler = orch.samplers[name]
      assert sampler.version == trainer.version >= 1
      for w, p in zip(jax.tree.leaves(sampler.state), jax.tree.leaves(trainer.params),
                      strict=True):
        assert not w.sharding.device_set & train_devices
        np.testing.assert_array_equal(np.asarray(w), np.asarray(p))
  finally:
    orch.close()
