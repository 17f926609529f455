"""Logical axes → device meshes.

Parameters name their axes logically ('embed', 'mlp', 'heads', ...). A rule table
maps each logical name onto a mesh axis, so the same model shards over any mesh
shape: `('data', 'model')` here, with the model axis carrying tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ('data', 'model')

# Logical parameter axis -> mesh axis (None: replicated).
LOGICAL_RULES: dict[str, str | None] = {
    'vocab': 'model',
    'embed': None,
    'mlp': 'model',
    'heads': 'model',
    'kv_heads': 'model',
}


def make_mesh(devices: Sequence[jax.Device], shape: tuple[int, int]) -> Mesh:
  """A ('data', 'model') mesh over exactly `devices`."""
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def _mesh_spec(logical: P, mesh: Mesh, shape: tuple[int, ...]) -> P:
  """Map a logical spec to mesh axes, replicating dims the mesh does not divide."""
  axes = []
  for name, dim in zip(logical, shape):
    axis = LOGICAL_RULES.get(name) if name is not None else None
    if axis is not None and dim % mesh.shape[axis]:
      axis = None
    axes.append(axis)
  return P(*axes)


def param_shardings(state: nnx.State, mesh: Mesh) -> dict:
  """NamedShardings (as a pure dict) for a state whose Params carry logical axes."""
  specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
  params = nnx.to_pure_dict(state)
  return jax.tree.map(
      lambda spec, x: NamedSharding(mesh, _mesh_spec(spec, mesh, x.shape)),
      specs, params, is_leaf=lambda x: isinstance(x, P))


def same_layout(shardings, mesh: Mesh):
  """The same partition specs on another mesh of the same shape (a rollout instance's
  copy of its trainer's parameters)."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s.spec), shardings)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) dim over 'data', the rest replicated."""
  return NamedSharding(mesh, P('data'))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
