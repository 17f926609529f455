"""Checkpoints store a decoder's layers stacked (one array per kind of leaf, not one per
layer) and restore them exactly, onto the restoring agent's shardings; checkpoints
written before that restore as they were written."""

import jax
import numpy as np
import orbax.checkpoint as ocp

from flexmarl.models import sharding
from flexmarl.models.lora import LoRAConfig
from flexmarl.models.transformer import ModelConfig
from flexmarl.train import grpo, layer_stack
from flexmarl.train.checkpoint import LAYOUT, AgentCheckpointer
from flexmarl.train.trainer import AgentTrainer, OptimizerConfig, TrainBatch

MODEL = ModelConfig(vocab_size=20, layers=3, lora=LoRAConfig(rank=2, alpha=4.0))
OPT = OptimizerConfig(learning_rate=1e-2)


def _trained(mesh, seed=0):
  """A LoRA agent after one update (Adam's moments no longer zero)."""
  t = AgentTrainer('a', MODEL, OPT, grpo.GRPOConfig(), mesh, seed=seed)
  rng = np.random.default_rng(seed)
  rows = 4 * t.batch_multiple
  t.accumulate(TrainBatch.from_rows(
      [list(rng.integers(3, 20, size=4)) for _ in range(rows)],
      [rng.integers(3, 20, size=3) for _ in range(rows)],
      [np.full(3, -1.0, np.float32) for _ in range(rows)],
      rng.normal(size=rows).astype(np.float32), prompt_len=4, response_len=3, pad_id=0,
      batch_multiple=t.batch_multiple))
  t.apply()
  return t


def _pairs(a, b):
  return zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)


def test_layers_are_stored_stacked_and_restore_exactly_on_another_mesh(tmp_path):
  devices = jax.devices()
  saved = _trained(sharding.make_mesh(devices[:2], (2,), ('fsdp',))).train_state()
  ckpt = AgentCheckpointer(str(tmp_path), 'a')
  ckpt.save(3, saved, {'version': 1})
  ckpt.wait()
  stored = ckpt.manager.item_metadata(3)['state']
  assert len(jax.tree.leaves(stored)) < len(jax.tree.leaves(saved)) // 2
  blocks = stored['params']['blocks']
  assert set(blocks) == {layer_stack.STACKED}  # one stacked layer, not layers 0, 1, 2
  assert all(x.shape[0] == MODEL.layers for x in jax.tree.leaves(blocks))
  read, meta = ckpt.read(3)  # without a state to restore onto: the layers split again
  assert meta == {'version': 1} and sorted(read['params']['blocks']) == [0, 1, 2]
  for x, y in _pairs(read['params'], saved['params']):
    np.testing.assert_array_equal(x, np.asarray(y))

  other = _trained(sharding.make_mesh(devices[4:6], (2,), ('fsdp',)), seed=1).train_state()
  restored, meta = ckpt.restore(3, other)
  assert meta == {'version': 1}  # the layout key is the checkpointer's own
  for x, like in _pairs(restored, other):
    assert x.sharding == like.sharding and x.dtype == like.dtype
  for x, y in _pairs(restored, saved):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  ckpt.close()


def test_a_checkpoint_of_unstacked_layers_restores(tmp_path):
  """The layout of checkpoints written before layers were stacked (no layout key)."""
  mesh = sharding.make_mesh(jax.devices()[:1], (1, 1))
  saved = _trained(mesh).train_state()
  ckpt = AgentCheckpointer(str(tmp_path), 'a')
  ckpt.manager.save(2, args=ocp.args.Composite(state=ocp.args.StandardSave(saved),
                                               meta=ocp.args.JsonSave({'version': 4})))
  ckpt.wait()
  assert '0' in ckpt.manager.item_metadata(2)['state']['params']['blocks']  # Orbax's keys
  restored, meta = ckpt.restore(2, _trained(mesh, seed=1).train_state())
  assert meta == {'version': 4} and LAYOUT not in meta
  for x, y in _pairs(restored, saved):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  ckpt.close()


def test_only_dicts_of_identical_layers_are_stacked():
  layer = lambda v: {'w': np.full((2, 3), v, np.float32), 'b': np.full(3, v, np.float32)}
  tree = {'blocks': {0: layer(0), 1: layer(1), 2: layer(2)},
          'ragged': {0: np.zeros(2), 1: np.zeros(3)},  # shapes differ
          'named': {'x': np.zeros(2), 'y': np.zeros(2)},  # not keyed 0..L-1
          'single': {0: np.zeros(2)}, 'n': (np.int32(7),)}
  stacked = layer_stack.stack(tree)
  assert stacked['blocks'][layer_stack.STACKED]['w'].shape == (3, 2, 3)
  np.testing.assert_array_equal(stacked['blocks'][layer_stack.STACKED]['b'][:, 0], [0, 1, 2])
  for key in ('ragged', 'named', 'single', 'n'):
    assert jax.tree.structure(stacked[key]) == jax.tree.structure(tree[key])
  back = layer_stack.unstack(stacked, tree, lambda value, like: np.asarray(value))
  assert jax.tree.structure(back) == jax.tree.structure(tree)
  for x, y in _pairs(back, tree):
    np.testing.assert_array_equal(x, y)
  split = layer_stack.split(stacked)  # without `tree`: what the stored structure says
  assert jax.tree.structure(split) == jax.tree.structure(tree)
