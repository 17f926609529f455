"""Sharded training equals unsharded; agent states move between meshes, host and storage
bit-identically; a trainer that moves between meshes trains exactly like one that never
moves."""

import concurrent.futures
import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from flexmarl.models import sharding
from flexmarl.models.transformer import ModelConfig
from flexmarl.train import grpo
from flexmarl.train import state as state_lib
from flexmarl.train.allocator import FreeMesh, Waiting, allocate
from flexmarl.train.state import InStorage, OnHost
from flexmarl.train.step import StepCache
from flexmarl.train.trainer import AgentTrainer, OptimizerConfig, TrainBatch

MODEL = ModelConfig(vocab_size=20, layers=1)
OPT = OptimizerConfig(learning_rate=1e-2)
GRPO = grpo.GRPOConfig(entropy_coef=0.1, kl_coef=0.05)


def _batch(seed, rows=8, multiple=1):
  rng = np.random.default_rng(seed)
  prompts = [list(rng.integers(3, 20, size=rng.integers(2, 6))) for _ in range(rows)]
  lengths = rng.integers(1, 5, size=rows)
  responses = [rng.integers(3, 20, size=n) for n in lengths]
  logprobs = [np.log(rng.uniform(0.05, 0.9, size=n)).astype(np.float32) for n in lengths]
  return TrainBatch.from_rows(prompts, responses, logprobs, rng.normal(size=rows).astype(np.float32),
                              prompt_len=5, response_len=4, pad_id=0, batch_multiple=multiple)


def _trainer(mesh_or_layout, steps=None):
  return AgentTrainer('a', MODEL, OPT, GRPO, mesh_or_layout, seed=3, steps=steps)


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_sharded_numbers_match_unsharded():
  devices = jax.devices()
  one = _trainer(sharding.make_mesh(devices[:1], (1, 1)))
  one.accumulate(_batch(0))
  ref_grads = _leaves(one.state.grads)
  ref_stats = one.apply()
  gate_specs = {('fsdp',): P('fsdp', None), ('fsdp', 'tensor'): P('fsdp', 'tensor'),
                ('data',): P(None, None)}  # gate is (embed, mlp)
  for (shape, axes) in (((2,), ('fsdp',)), ((2, 2), ('fsdp', 'tensor')), ((4,), ('data',))):
    mesh = sharding.make_mesh(devices[4:4 + int(np.prod(shape))], shape, axes)
    t = _trainer(mesh)
    t.accumulate(_batch(0, multiple=t.batch_multiple))
    for x, y in zip(ref_grads, _leaves(t.state.grads)):
      np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)
    stats = t.apply()
    np.testing.assert_allclose(stats['loss'], ref_stats['loss'], rtol=1e-5)
    np.testing.assert_allclose(stats['grad_norm'], ref_stats['grad_norm'], rtol=1e-5)
    # Adam's first step moves each parameter by about ±lr, sign-like: a near-zero gradient
    # may round to another size or sign: allow a few elements (< 0.1%) up to 2 lr.
    diff = np.concatenate([np.abs(x - y).ravel() for x, y in zip(_leaves(one.params),
                                                                 _leaves(t.params))])
    assert diff.max() <= 2 * OPT.learning_rate and np.mean(diff > 1e-5) < 1e-3, axes
    assert t.params['blocks'][0]['mlp']['gate'].sharding.spec == gate_specs[axes]


def _assert_same(a, b):
  for x, y in zip(_leaves(a.arrays()), _leaves(b.arrays()), strict=True):
    assert x.dtype == y.dtype and np.array_equal(x, y)


@pytest.mark.quick
def test_state_moves_mesh_host_storage_and_reshards(tmp_path):
  devices = jax.devices()
  t = _trainer(sharding.make_mesh(devices[:4], (2, 2), ('fsdp', 'tensor')))
  t.accumulate(_batch(1, multiple=t.batch_multiple))  # a half-accumulated batch moves too
  t.apply()
  t.accumulate(_batch(2, multiple=t.batch_multiple))
  start = t.state
  host, moved = state_lib.move(start, OnHost())
  assert moved.bytes == start.nbytes > 0 and moved.source == 'mesh' and moved.target == 'host'
  stored, _ = state_lib.move(host, InStorage(str(tmp_path / 'a')))
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(stored.arrays()))
  target = t._steps.shardings  # the layout's specs ...
  other = sharding.make_mesh(devices[4:8], (4,), ('fsdp',))
  steps = _trainer(sharding.layout(*sharding.layout_of(other)))._steps  # ... of another layout
  back, _ = state_lib.move(stored, state_lib.OnMesh(other, steps.shardings(other)))
  _assert_same(start, back)
  gate = back.params['blocks'][0]['mlp']['gate'].sharding
  assert gate.spec == P('fsdp', None) and gate.device_set == set(devices[4:8])
  # mesh -> mesh directly, and a state reloaded from its files in a fresh call
  other2 = sharding.make_mesh(devices[:4], (2, 2), ('fsdp', 'tensor'))
  again, _ = state_lib.move(back, state_lib.OnMesh(other2, target(other2)))
  _assert_same(start, again)
  loaded, _ = state_lib.load(str(tmp_path / 'a'), t.state, OnHost())
  _assert_same(start, loaded)


def test_prefetch_gives_the_moved_state(tmp_path):
  t = _trainer(sharding.make_mesh(jax.devices()[:2], (2,), ('fsdp',)))
  stored, _ = state_lib.move(t.state, InStorage(str(tmp_path / 's')))
  with concurrent.futures.ThreadPoolExecutor(1) as executor:
    future = state_lib.prefetch(stored, t.state.location, executor)
    state, transfer = future.result()
  assert transfer.source == 'storage' and transfer.bytes == t.state.nbytes
  _assert_same(t.state, state)
  assert state.location == t.state.location


def test_a_stored_state_loads_its_own_arrays(tmp_path):
  """Bug: the arrays taken from the `like` state instead of the saved ones."""
  like = state_lib.AgentState(params={'w': np.arange(6.0)}, opt_state={'m': np.ones(6)},
                              rng=np.zeros(2, np.uint32), location=OnHost())
  start = dataclasses.replace(like, params={'w': np.arange(6.0) * 2})
  state_lib.move(start, InStorage(str(tmp_path / 's')))
  loaded, _ = state_lib.load(str(tmp_path / 's'), like, OnHost())
  _assert_same(start, loaded)


def test_unbound_trainer_and_wrong_layout_fail_clearly():
  t = _trainer(sharding.layout((2,), ('fsdp',)))
  with pytest.raises(RuntimeError, match="agent 'a' is not bound.*call bind"):
    t.accumulate(_batch(0, multiple=2))
  with pytest.raises(ValueError, match=r'layout.*bind to a mesh of that shape'):
    t.bind(sharding.make_mesh(jax.devices()[:2], (2, 1)))
  with pytest.raises(ValueError, match="mesh axes.*'model' is 'tensor'"):
    sharding.layout((2, 2), ('fsdp', 'model', 'tensor'))


def test_checkpoint_of_a_stored_state_restores_onto_a_host_state(tmp_path):
  from flexmarl.train.checkpoint import AgentCheckpointer
  t = _trainer(sharding.make_mesh(jax.devices()[:2], (2,), ('fsdp',)))
  t.accumulate(_batch(5, multiple=2))
  t.apply()
  t.release(InStorage(str(tmp_path / 'swap')))  # swapped out at checkpoint time
  ckpt = AgentCheckpointer(str(tmp_path), 'a')
  ckpt.save(7, t.train_state(), {'version': 1})
  ckpt.wait()
  fresh = _trainer(sharding.layout((2,), ('fsdp',)))  # its state in host memory
  state, meta = ckpt.restore(7, fresh.train_state())
  fresh.load_train_state(state)
  assert meta['version'] == 1 and isinstance(fresh.state.location, OnHost)
  for x, y in zip(_leaves(t.train_state()), _leaves(fresh.train_state()), strict=True):
    assert np.array_equal(x, y)
  ckpt.close()


def test_four_agents_take_turns_on_two_meshes_like_agents_on_their_own_meshes(tmp_path):
  """The allocator binds 4 agents to 2 meshes, 2 micro-batches a step, releasing them
  between micro-batches (one through storage, mid-batch) and prefetching the second
  agent of a round while the first trains: each agent runs on both meshes and ends
  bit-identical to an agent that never moved."""
  devices, cache = jax.devices(), StepCache()
  fsdp = lambda i: sharding.make_mesh(devices[2 * i:2 * i + 2], (2,), ('fsdp',))
  names = 'abcd'
  pinned = {n: AgentTrainer(n, MODEL, OPT, GRPO, fsdp(i), seed=i, steps=cache)
            for i, n in enumerate(names)}
  movers = {n: AgentTrainer(n, MODEL, OPT, GRPO, sharding.layout((2,), ('fsdp',)), seed=i,
                            steps=cache) for i, n in enumerate(names)}
  pool_meshes = {'m0': fsdp(0), 'm1': fsdp(1)}
  served = {n: 0 for n in names}  # micro-batches trained
  last = {n: 0.0 for n in names}
  ran_on = {n: set() for n in names}
  executor = concurrent.futures.ThreadPoolExecutor(1)
  for rnd in range(4):
    order = ['m0', 'm1'] if rnd < 2 else ['m1', 'm0']  # the order meshes came free
    waiting = [Waiting(n, 1, movers[n].layout, last[n]) for n in names]
    bindings = allocate(waiting, [FreeMesh(m, movers['a'].layout) for m in order])
    assert len(bindings) == 2 and len(set(bindings.values())) == 2
    (first, _), (second, second_mesh) = bindings.items()
    movers[second].prefetch(pool_meshes[second_mesh], executor)
    for n, m in bindings.items():
      movers[n].bind(pool_meshes[m])
      ran_on[n].add(m)
      batch = _batch(100 * names.index(n) + served[n], rows=4, multiple=2)
      for t in (pinned[n], movers[n]):
        t.accumulate(batch)
      served[n] += 1
      if served[n] == 2:
        assert pinned[n].apply() == movers[n].apply()
      to_storage = n == 'd' and served[n] == 1  # its half-accumulated gradient too
      movers[n].release(InStorage(str(tmp_path / n)) if to_storage else OnHost())
      last[n] = float(rnd + 1)
  executor.shutdown()
  assert ran_on == {n: {'m0', 'm1'} for n in names} and served == {n: 2 for n in names}
  assert len(cache) == 1
  for n in names:
    for x, y in zip(_leaves(pinned[n].train_state()), _leaves(movers[n].train_state()),
                    strict=True):
      assert np.array_equal(x, y)
