"""Logical axes → device meshes.

Parameters name their axes logically ('embed', 'mlp', 'heads', ...). A rule table
maps each logical name onto a mesh *role*: 'tensor' (tensor parallelism) or 'fsdp'
(parameters sharded along their embedding dim, gathered for each use). Batches split
over 'data' and 'fsdp' together. A mesh declares its shape and which of the axes
'data', 'fsdp', 'tensor' it has; axes it lacks replicate. `('data', 'model')` is the
older two-axis layout: 'model' is another name for 'tensor'.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P

AXES = ('data', 'fsdp', 'tensor', 'model')
ALIASES = {'model': 'tensor'}  # mesh axis name -> role
DEFAULT_AXES = ('data', 'model')  # what a 2-dim `mesh_shape` means without axes

# Logical parameter axis -> role (None: replicated).
LOGICAL_RULES: dict[str, str | None] = {
    'vocab': 'tensor',
    'embed': 'fsdp',
    'mlp': 'tensor',
    'heads': 'tensor',
    'kv_heads': 'tensor',
}
BATCH_ROLES = ('data', 'fsdp')


class MeshLayout(NamedTuple):
  """A mesh's shape and axis names, without devices: what an agent declares, and what
  compiled steps are keyed by."""

  shape: tuple[int, ...]
  axes: tuple[str, ...]

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def batch_multiple(self) -> int:
    """Batch rows must be a multiple of this (the batch splits over data × fsdp)."""
    return math.prod(n for n, a in zip(self.shape, self.axes) if ALIASES.get(a, a) in BATCH_ROLES)

  def abstract(self) -> AbstractMesh:
    return AbstractMesh(self.shape, self.axes)


def layout(shape: Sequence[int], axes: Sequence[str] | None = None) -> MeshLayout:
  """A checked MeshLayout; `axes=None` means ('data', 'model') for two dims."""
  shape = tuple(int(n) for n in shape)
  if axes is None:
    if len(shape) != len(DEFAULT_AXES):
      raise ValueError(f'mesh shape {shape}: give its axes (a subset of {AXES[:3]}, in order), '
                       f'or two dims for {DEFAULT_AXES}.')
    axes = DEFAULT_AXES
  axes = tuple(axes)
  roles = [ALIASES.get(a, a) for a in axes]
  if len(axes) != len(shape) or any(a not in AXES for a in axes) or len(set(roles)) != len(roles):
    raise ValueError(f'mesh axes {axes} for shape {shape}: give one distinct name per dim '
                     f"from {AXES[:3]} ('model' is 'tensor').")
  if any(n < 1 for n in shape):
    raise ValueError(f'mesh shape {shape}: every dim must be >= 1 device.')
  return MeshLayout(shape, axes)


def make_mesh(devices: Sequence[jax.Device], shape: Sequence[int],
              axes: Sequence[str] | None = None) -> Mesh:
  """A mesh over exactly `devices` with the given shape and axes (see `layout`)."""
  lay = layout(shape, axes)
  if len(devices) != lay.size:
    raise ValueError(f'mesh shape {lay.shape} needs {lay.size} devices, got {len(devices)}.')
  return Mesh(np.asarray(devices).reshape(lay.shape), lay.axes)


def layout_of(mesh: Mesh | AbstractMesh) -> MeshLayout:
  return MeshLayout(tuple(mesh.axis_sizes), tuple(mesh.axis_names))


def _axis_for(role: str | None, mesh: Mesh | AbstractMesh) -> str | None:
  """The mesh axis that plays `role`, or None where the mesh has no such axis."""
  for name in mesh.axis_names:
    if role is not None and ALIASES.get(name, name) == role:
      return name
  return None


def _mesh_spec(logical: P, mesh: Mesh | AbstractMesh, shape: tuple[int, ...]) -> P:
  """Map a logical spec to mesh axes, replicating dims the mesh does not divide."""
  axes = []
  for name, dim in zip(logical, shape):
    axis = _axis_for(LOGICAL_RULES.get(name) if name is not None else None, mesh)
    if axis is not None and dim % mesh.shape[axis]:
      axis = None
    axes.append(axis)
  return P(*axes)


def param_specs(state: nnx.State, mesh: Mesh | AbstractMesh) -> dict:
  """PartitionSpecs (as a pure dict) for a state whose Params carry logical axes.
  `state` may be abstract (`nnx.eval_shape`); `mesh` may be a MeshLayout's abstract mesh."""
  logical = nnx.to_pure_dict(nnx.get_partition_spec(state))
  params = nnx.to_pure_dict(state)
  return jax.tree.map(lambda spec, x: _mesh_spec(spec, mesh, x.shape),
                      logical, params, is_leaf=lambda x: isinstance(x, P))


def param_shardings(state: nnx.State, mesh: Mesh) -> dict:
  """NamedShardings (as a pure dict) for a state whose Params carry logical axes."""
  return on_mesh(param_specs(state, mesh), mesh)


def on_mesh(specs, mesh: Mesh):
  """A tree of PartitionSpecs as NamedShardings on `mesh`."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda x: isinstance(x, P))


def same_layout(shardings, mesh: Mesh):
  """The same partition specs on another mesh of the same shape (a rollout instance's
  copy of its trainer's parameters)."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s.spec), shardings)


def batch_spec(mesh: Mesh | AbstractMesh) -> P:
  """Leading (batch) dim over the mesh's data and fsdp axes, the rest replicated."""
  axes = tuple(a for a in (_axis_for(r, mesh) for r in BATCH_ROLES) if a is not None)
  return P(axes[0] if len(axes) == 1 else axes or None)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, batch_spec(mesh))


def global_batch(arrays: dict, mesh: Mesh) -> dict:
  """Host batch arrays for a step over `mesh`. In one process, as they are (the step
  places them); across processes (a `jax.distributed` mesh), each process gives its own
  devices' rows of the batch, which every process holds whole."""
  if jax.process_count() == 1:
    return arrays
  where = batch_sharding(mesh)
  return {k: jax.make_array_from_callback(x.shape, where, lambda i, x=x: x[i])
          for k, x in arrays.items()}


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
