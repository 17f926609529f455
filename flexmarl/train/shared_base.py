"""Frozen bases of LoRA agents: one copy per (base, device group), shared by agents.

A LoRA agent trains only its adapters; its base never changes. So agents whose base is
the same (`base_key`: the same architecture and the same HF checkpoint, or the same
random initialisation) hold one `SharedBase`, and each device group that needs it (a
training mesh, a rollout instance's devices) holds one copy, made on first use and
referenced by every trainer and sampler there. An agent's movable state (swaps,
host, storage, checkpoints) is then its adapters and their optimizer state only.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import jax
import numpy as np
from jax.sharding import Mesh

from flax import nnx

from flexmarl.models import hf, source, transformer
from flexmarl.models.transformer import ModelConfig

# shardings (a tree like the base, or None: host memory) -> the base's params there
LoadBase = Callable[[dict | None], dict]


def agent_seed(team_seed: int, index: int) -> int:
  """The init seed of the team's `index`-th agent (its adapters, or its full model)."""
  return team_seed * 1000 + index


def base_key(model: ModelConfig, checkpoint: str, seed: int) -> Hashable:
  """What makes two agents' bases the same: the architecture (adapters aside) and the
  HF checkpoint folder, or without one the random initialisation's seed."""
  return model.without_adapters, source.identity(checkpoint) if checkpoint else f'seed:{seed}'


def load_base(model: ModelConfig, checkpoint: str, seed: int) -> LoadBase:
  """How a base is made onto shardings (None: host memory): read from the HF
  checkpoint, or the random initialisation of the model without adapters from `seed`
  (which is a LoRA model's base of that seed: adapters draw their keys after it)."""
  cfg = model.without_adapters

  def load(shardings: dict | None) -> dict:
    if checkpoint:
      on = shardings
      if on is None:
        host = jax.sharding.SingleDeviceSharding(jax.devices('cpu')[0])
        on = jax.tree.map(lambda _: host, nnx.to_pure_dict(transformer.abstract_model(cfg)[1]))
      params = hf.load_params(checkpoint, cfg, on)
    else:  # eager, as an agent's own random init is
      params = nnx.to_pure_dict(nnx.state(transformer.Decoder(cfg, nnx.Rngs(params=seed))))
    return jax.device_get(params) if shardings is None else jax.device_put(params, shardings)
  return load


def shared(registry: dict, model: ModelConfig, checkpoint: str, seed: int) -> SharedBase:
  """The base of `registry` (one team's) that an agent of this model, checkpoint and
  base seed uses, made (lazily) when no agent before it had it."""
  key = base_key(model, checkpoint, seed)
  if key not in registry:
    registry[key] = SharedBase(load_base(model, checkpoint, seed))
  return registry[key]


def group_of(mesh: Mesh) -> Hashable:
  """A device group: the mesh's devices in order, its shape and axis names."""
  return tuple(d.id for d in mesh.devices.flat), mesh.devices.shape, mesh.axis_names


class SharedBase:
  """One frozen base and its copies, by device group. Copies are made on first use:
  from an existing copy when there is one (a device copy), else by `load`."""

  def __init__(self, load: LoadBase):
    self._load = load
    self._copies: dict[Hashable, dict] = {}

  @classmethod
  def holding(cls, params: dict) -> SharedBase:
    """A base whose params are given (in host memory or on devices)."""
    return cls(lambda shardings: jax.device_get(params) if shardings is None
               else jax.device_put(params, shardings))

  def on(self, mesh: Mesh, shardings: dict) -> dict:
    """The base on `mesh` with `shardings` (a tree like the base), one copy per group."""
    return self._copy(group_of(mesh), shardings)

  def host(self) -> dict:
    """The base in host memory (numpy)."""
    return self._copy('host', None)

  def _copy(self, group: Hashable, shardings: dict | None) -> dict:
    if group not in self._copies:
      if not self._copies:
        self._copies[group] = self._load(shardings)
      else:
        source = next(iter(self._copies.values()))
        self._copies[group] = (jax.device_get(source) if shardings is None
                               else jax.device_put(source, shardings))
    return self._copies[group]

  @property
  def groups(self) -> list[Hashable]:
    """The device groups (and 'host') holding a copy."""
    return list(self._copies)

  @property
  def nbytes(self) -> int:
    """Bytes of one copy (0 before the first is made)."""
    if not self._copies:
      return 0
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(next(iter(self._copies.values()))))
