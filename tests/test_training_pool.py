"""Four agents take turns on a training pool of two meshes (under `sync`, an agent that
skips a step shifts who lands where, so each runs on both); states go through host
memory and storage (a host budget of one state), checkpoints are taken while some are
swapped out, and the parameters equal those of a run where every agent keeps a mesh of
its own — also under the `flexmarl` pipeline, and across a resume. Bad pool configs fail
before anything compiles."""

import os
import threading
import types

import jax
import numpy as np
import pytest

from experiments import hierarchical_assistant
from flexmarl.config import ConfigError, build_team_spec, training_config
from flexmarl.core.clock import RealClock
from flexmarl.main import train
from flexmarl.metrics.writer import read_metrics
from flexmarl.models import sharding
from flexmarl.models.tokenizer import load_tokenizer
from flexmarl.train import sizing
from flexmarl.train.checkpoint import AgentCheckpointer
from flexmarl.train.engine import TrainingEngine
from flexmarl.train.pool_meshes import PoolMesh
from flexmarl.train.state import OnHost, Transfer
from flexmarl.workflows import build_workflow

STEPS = 3
AGENTS = ('router', 'reverser', 'sorter', 'adder')


def _config(pool_devices=0, host_budget_gb=0.0):
  c = hierarchical_assistant.get_config('runlocal')
  c.steps, c.checkpoint_every, c.schedule = STEPS, 1, 'sync'
  c.rollout.devices, c.rollout.query_concurrency, c.rollout.max_step_queries = 'shared', 8, 8
  for name in AGENTS:
    a = c.agents[name]
    a.mesh_shape, a.mesh_axes = (2,), ('fsdp',)
    a.global_batch, a.micro_batch = 2 * a.group_size, a.group_size  # 2 micro-batches
    a.sampling.max_new_tokens = 2  # one sampler and train width for all: fewer compiles
  c.training = training_config(pool_devices=pool_devices, host_budget_gb=host_budget_gb)
  return c


def _state_gb(c):
  spec = _spec(c)
  return max(sizing.state_nbytes(a.model, a.optimizer, a.grpo) for a in spec.agents.values()) / 1e9


def _spec(c):
  return build_team_spec(c, load_tokenizer(c.tokenizer).vocab_size, [d.id for d in jax.devices()],
                         build_workflow(c.workflow).agent_names())


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  out = {}
  own = _config()
  shared = _config(pool_devices=4)
  shared.training.host_budget_gb = _state_gb(shared) * 1.5  # one state on host at a time
  pipelined = shared.copy_and_resolve_references()
  pipelined.schedule = 'flexmarl'
  pipelined.training.states_per_mesh = 1  # every swap waits for the one before
  for key, config in (('own', own), ('pool', shared), ('pool_flexmarl', pipelined)):
    workdir = str(tmp_path_factory.mktemp(key))
    train(config, workdir, log=lambda *_: None)
    out[key] = workdir
  # The pool run again, stopped after its first step and resumed to the end.
  resumed = shared.copy_and_resolve_references()
  out['pool_resumed'] = workdir = str(tmp_path_factory.mktemp('pool_resumed'))
  resumed.steps = 1
  train(resumed, workdir, log=lambda *_: None)
  resumed.steps = STEPS
  logs = []
  train(resumed, workdir, log=logs.append)
  assert any('resumed from step 1' in str(l) for l in logs)
  return out


def _params(workdir, agent, step=STEPS):
  state, _ = AgentCheckpointer(workdir, agent).read(step)
  return [np.asarray(x) for x in jax.tree.leaves(state['params'])]


def _lines(workdir):
  return [l for l in read_metrics(os.path.join(workdir, 'metrics.jsonl')) if l['agent'] != 'team']


@pytest.mark.parametrize('run, tolerance', [('pool', 1e-6), ('pool_flexmarl', 1e-5),
                                             ('pool_resumed', 1e-6)])
def test_pool_run_equals_agents_on_their_own_meshes(runs, run, tolerance):
  for agent in AGENTS:
    for step in (STEPS - 1, STEPS):
      for x, y in zip(_params(runs['own'], agent, step), _params(runs[run], agent, step),
                      strict=True):
        assert np.abs(x - y).max() <= tolerance, (agent, step, np.abs(x - y).max())
  for a, b in zip(_lines(runs['own']), _lines(runs[run]), strict=True):
    assert (a['step'], a['agent']) == (b['step'], b['agent'])
    for key in ('reward_mean', 'loss', 'grad_norm', 'tokens', 'policy_version'):
      if key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-5, err_msg=key)


def test_agents_took_turns_on_the_meshes_and_swaps_were_counted(runs):
  # An agent goes back to the mesh it left (its state is in that mesh's host memory), so
  # each mesh serves its own agents in turn; moves between meshes are checked bit for bit
  # in test_train_state. Every state starts in host memory: each agent swaps in at least
  # once (an agent expected to train again keeps its state on the mesh it leaves, so
  # some never swap out).
  lines = _lines(runs['pool'])
  served = {'pool0': set(), 'pool1': set()}
  for l in lines:
    for m in filter(None, l['meshes'].split(',')):
      served[m].add(l['agent'])
  assert all(len(agents) >= 2 for agents in served.values()), served
  assert set().union(*served.values()) == set(AGENTS)
  for agent in AGENTS:
    mine = [l for l in lines if l['agent'] == agent]
    assert sum(l['swaps'] for l in mine) >= 1 and sum(l['swap_bytes'] for l in mine) > 0
  assert all('meshes' not in l for l in _lines(runs['own']))
  assert os.listdir(os.path.join(runs['pool'], 'swap'))  # the host budget sent states to storage


def test_bad_pool_configs_name_the_field_and_the_fix():
  c = _config(pool_devices=1)
  with pytest.raises(ConfigError, match=r'agents\.\w+\.mesh_shape=\(2,\).*pool has 1'):
    _spec(c)
  c = _config(pool_devices=4, host_budget_gb=1e-6)
  with pytest.raises(ConfigError, match=r'training\.host_budget_gb=1e-06: agent .* at least'):
    _spec(c)
  c = _config(pool_devices=4)
  c.training.states_per_mesh = 3
  with pytest.raises(ConfigError, match=r'training\.states_per_mesh=3.*one of \[1, 2\]'):
    _spec(c)
  c = _config(pool_devices=16)
  with pytest.raises(ConfigError, match=r'training\.pool_devices: no 16 free devices'):
    _spec(c)
  c = _config(pool_devices=4)
  c.training.mesh_shapes = [(2, 2)]
  with pytest.raises(ConfigError, match=r'agents\.\w+\.mesh_shape=\(2,\): no mesh of '
                     r'training\.mesh_shapes'):
    _spec(c)
  c = _config(pool_devices=4)
  c.agents.adder.train_devices = (6, 7)
  with pytest.raises(ConfigError, match=r'agents\.adder\.train_devices.*remove it'):
    _spec(c)
  c = _config(pool_devices=4)
  c.rollout.devices = 'separate'  # 4 pool devices + 4 instances of 2 devices > 8
  with pytest.raises(ConfigError, match=r'rollout\.instances: no 2 free devices'):
    _spec(c)
  p = _spec(_config(pool_devices=4)).placement
  assert [m.devices for m in p.pool] == [(0, 1), (2, 3)]
  assert [m[0].devices for m in p.rollout.values()] == [(0, 1), (2, 3), (0, 1), (2, 3)]


def _tiny_hf_team(tokenizer: str, steps: int, pool_devices: int):
  """A solver and a verifier of the tiny size with `tokenizer` (a tiny HF folder's),
  on `pool_devices` pool devices (0: devices of their own); they start at random."""
  import ml_collections

  from flexmarl.config import agent_config
  c = ml_collections.ConfigDict()
  c.seed, c.steps, c.schedule, c.tokenizer = 0, steps, 'sync', tokenizer
  c.max_prompt_len, c.checkpoint_every = 10, 1
  c.workflow = dict(name='solver_verifier', solver='solver', verifier='verifier',
                    family='add', task_args={'max_operand': 4})
  c.rollout = dict(query_concurrency=2, max_step_queries=8, devices='shared')
  c.agents = {name: agent_config('tiny', group_size=4, global_batch=8, micro_batch=8,
                                 sampling=dict(temperature=1.0, top_p=1.0, max_new_tokens=2),
                                 # A step even from a batch without signal:
                                 # one step must move the weights.
                                 grpo=dict(kl_coef=0.1, entropy_coef=0.1,
                                           skip_without_signal=False))
              for name in ('solver', 'verifier')}
  c.training = training_config(pool_devices=pool_devices)
  return c


def _lora_checkpoint_team(folder: str, steps: int, pool_devices: int):
  """Two LoRA agents over one base read from the HF folder `folder`."""
  c = _tiny_hf_team(folder, steps, pool_devices)
  for a in c.agents.values():
    a.model.checkpoint = folder
    a.model.lora = dict(rank=4, alpha=8.0)
  return c


def test_pool_agents_start_from_their_checkpoint(tmp_path):
  """In a training pool, an agent with `model.checkpoint` starts from its weights (the
  trainer's state in host memory, its KL reference and its rollout's copy) and trains
  from there, next to an agent initialised at random."""
  from experiments import make_tiny_hf
  from flexmarl.models import hf, sharding, transformer
  from flexmarl.run import build
  folder = make_tiny_hf.make(str(tmp_path / 'tiny_hf'))
  c = _tiny_hf_team(folder, steps=1, pool_devices=2)
  c.agents.solver.model.checkpoint = folder
  team = build(c, str(tmp_path / 'run'), log=lambda *_: None)
  model = team.spec.agents['solver'].model
  expected = jax.device_get(hf.load_params(folder, model, sharding.param_shardings(
      transformer.abstract_model(model)[1], sharding.make_mesh(jax.devices()[:1], (1, 1)))))
  solver = team.agents['solver']
  for tree in (solver.trainer.params, solver.trainer.ref_params, solver.pool.weights.params):
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(tree), expected)
  random_start = jax.tree.leaves(jax.device_get(team.agents['verifier'].trainer.params))
  assert not np.array_equal(random_start[0], jax.tree.leaves(expected)[0])
  team.run(lambda *_: None)
  trained = _params(str(tmp_path / 'run'), 'solver', step=1)
  moved = max(np.abs(x - y).max() for x, y in zip(trained, jax.tree.leaves(expected), strict=True))
  assert 0 < moved < 0.05, moved  # one small step from the checkpoint


def test_lora_agents_of_a_checkpoint_take_turns_over_one_base(tmp_path):
  """The common case of one accelerator: LoRA agents over a pretrained base share a
  training pool of one device, which holds the base once (beside the rollout's use of
  it); they train as they do on devices of their own."""
  from experiments import make_tiny_hf
  from flexmarl.run import build
  folder = make_tiny_hf.make(str(tmp_path / 'tiny_hf'))
  pooled, own = str(tmp_path / 'pooled'), str(tmp_path / 'own')
  team = build(_lora_checkpoint_team(folder, 2, pool_devices=1), pooled, log=lambda *_: None)
  assert [m.devices for m in team.spec.placement.pool] == [(0,)]
  solver, verifier = (team.agents[n].trainer for n in ('solver', 'verifier'))
  assert solver.base is verifier.base
  team.run(lambda *_: None)
  groups = solver.base.groups
  assert len([g for g in groups if g != 'host']) == 1, groups  # device 0's copy, no other
  train(_lora_checkpoint_team(folder, 2, pool_devices=0), own, log=lambda *_: None)
  for agent in ('solver', 'verifier'):
    moved = [np.abs(x - y).max() for x, y in zip(_params(pooled, agent, 2),
                                                  _params(own, agent, 2), strict=True)]
    assert max(moved) < 1e-6, (agent, max(moved))
  state, _ = AgentCheckpointer(pooled, 'solver').read(2)
  lora_b = [x for path, x in jax.tree_util.tree_flatten_with_path(state['params'])[0]
            if 'lora_b' in jax.tree_util.keystr(path)]
  assert lora_b and any(np.any(np.asarray(x)) for x in lora_b)  # trained: B starts at zero


class _GatedTrainer:
  """A PoolTrainer whose copy out (release) blocks until `gate` is set, as a real release
  blocks until the agent's dispatched work is done; records what happened in `events`."""

  def __init__(self, name, gate, events):
    self.name, self.gate, self.events = name, gate, events
    self.layout = sharding.MeshLayout((1,), ('data',))
    self._location = OnHost()

  @property
  def state(self):
    return types.SimpleNamespace(nbytes=8, location=self._location)

  def bind(self, mesh):
    self.events.append(('bind', self.name))
    self._location = 'mesh'
    return Transfer('host', 'mesh', 8, 0.0)

  def release(self, to=OnHost()):
    assert self.gate.wait(timeout=60), 'the release was never let through'
    self.events.append(('released', self.name))
    self._location = to
    return Transfer('mesh', 'host', 8, 0.0)

  def prefetch(self, mesh, executor):
    pass


@pytest.mark.quick
def test_release_runs_off_the_caller_and_the_agent_waits_for_it():
  """One mesh, agents a then b: b's bind does not wait for a's release (run returns
  while it is blocked), a's next bind does, and so do `wait` and `close`."""
  gate, events = threading.Event(), []
  trainers = {n: _GatedTrainer(n, gate, events) for n in 'ab'}
  engine = TrainingEngine(trainers, [PoolMesh('pool0', (0,), (1,))], clock=RealClock(),
                          make_mesh=lambda mesh, layout: mesh.name)
  try:
    for name in 'ab':
      engine.submit(name, lambda name=name: events.append(('work', name)))
      engine.run()
    assert events == [('bind', 'a'), ('work', 'a'), ('bind', 'b'), ('work', 'b')]
    assert isinstance(trainers['a'].state.location, str)  # a's copy out is still blocked
    waiter = threading.Thread(target=lambda: (engine.submit('a', lambda: None), engine.run()))
    waiter.start()
    waiter.join(timeout=0.5)
    assert waiter.is_alive() and ('bind', 'a') not in events[2:]  # a waits for its copy
    gate.set()
    waiter.join(timeout=60)
    engine.wait()  # b's copy out runs on the copy thread; a's bind does not wait for it
    # b's copy out (its own thread's work) and a's bind may come in either order.
    assert events[4] == ('released', 'a')
    assert sorted(events[5:]) == [('bind', 'a'), ('released', 'b')]
  finally:
    gate.set()
    engine.close()
  assert sum(engine.step_stats(n)['swaps'] for n in 'ab') == 5  # 3 binds, 2 releases
