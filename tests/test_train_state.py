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
    for x, y in zip(_leaves(one.params), _leaves(t.params)):
      np.testing.assert_allclose(x, y, atol=1e-4)  # 1% of an lr step
    assert t.params['blocks'][0]['mlp']['gate'].sharding.spec == gate_specs[axes]


def _assert_same(a, b):
  assert a.version == b.version
  for x, y in zip(_leaves(a.arrays()), _leaves(b.arrays()), strict=True):
    assert x.dtype == y.dtype and np.array_equal(x, y)


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


def test_trainer_moving_between_meshes_trains_like_one_that_never_moves(tmp_path):
  devices = jax.devices()
  layout = sharding.layout((2,), ('fsdp',))
  mesh_a, mesh_b = (sharding.make_mesh(devices[i:i + 2], (2,), ('fsdp',)) for i in (0, 2))
  cache = StepCache()
  still = _trainer(sharding.make_mesh(devices[4:6], (2,), ('fsdp',)), steps=cache)
  mover = _trainer(layout, steps=cache)
  assert len(cache) == 1 and mover.mesh is None
  executor = concurrent.futures.ThreadPoolExecutor(1)
  for step in range(3):
    mover.bind(mesh_a if step % 2 == 0 else mesh_b)
    for mb in range(2):
      if mb == 1:  # release mid-batch: the accumulator travels through host memory
        mover.release(OnHost())
        mover.bind(mesh_b)
      for t in (still, mover):
        t.accumulate(_batch(10 * step + mb, rows=4, multiple=2))
    assert still.apply() == mover.apply()
    mover.release(InStorage(str(tmp_path / f's{step}')) if step == 1 else OnHost())
    if step == 1:  # prefetch from storage on a thread, then bind takes the moved state
      mover.prefetch(mesh_a, executor)
  mover.bind(mesh_a)
  assert mover.version == still.version == 3
  for x, y in zip(_leaves(still.train_state()), _leaves(mover.train_state()), strict=True):
    assert np.array_equal(x, y)
  assert {d for x in jax.tree.leaves(mover.params) for d in x.sharding.device_set} == set(
      devices[:2])
  executor.shutdown()


def test_prefetch_gives_the_moved_state(tmp_path):
  t = _trainer(sharding.make_mesh(jax.devices()[:2], (2,), ('fsdp',)))
  stored, _ = state_lib.move(t.state, InStorage(str(tmp_path / 's')))
  with concurrent.futures.ThreadPoolExecutor(1) as executor:
    future = state_lib.prefetch(stored, t.state.placement, executor)
    state, transfer = future.result()
  assert transfer.source == 'storage' and transfer.bytes == t.state.nbytes
  _assert_same(t.state, state)
  assert state.placement == t.state.placement


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
  ckpt.save(7, t.train_state(), {'version': t.version})
  ckpt.wait()
  fresh = _trainer(sharding.layout((2,), ('fsdp',)))  # its state in host memory
  state, meta = ckpt.restore(7, fresh.train_state())
  fresh.load_train_state(state, meta['version'])
  assert fresh.version == 1 and isinstance(fresh.state.placement, OnHost)
  for x, y in zip(_leaves(t.train_state()), _leaves(fresh.train_state()), strict=True):
    assert np.array_equal(x, y)
  ckpt.close()
