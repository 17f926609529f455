"""The training pool's meshes, carved from its devices. (What must fit in the pool is
checked with the config: flexmarl.train.sizing.)"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import Mesh

from flexmarl.errors import ConfigError
from flexmarl.models import sharding


def carve(devices: Sequence[jax.Device], layouts: Sequence[sharding.MeshLayout]) -> list[Mesh]:
  """Consecutive, disjoint meshes of the given layouts over the pool's devices."""
  needed = sum(lay.size for lay in layouts)
  if needed > len(devices):
    raise ConfigError(f'config.training.meshes={[lay.shape for lay in layouts]}: they need '
                      f'{needed} devices together, the training pool has {len(devices)}; '
                      'declare fewer or smaller meshes, or give the pool more devices.')
  out, start = [], 0
  for lay in layouts:
    out.append(sharding.make_mesh(devices[start:start + lay.size], lay.shape, lay.axes))
    start += lay.size
  return out
