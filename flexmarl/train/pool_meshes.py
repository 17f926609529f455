"""The training pool's meshes, carved from its devices, and what the TrainingEngine
(flexmarl.train.engine) meets them with: the mesh record, the trainer it moves, the
executors its copies run on. (What must fit in the pool is checked with the config:
flexmarl.train.sizing.)"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import jax
from jax.sharding import Mesh

from flexmarl.core.errors import ConfigError
from flexmarl.models import sharding
from flexmarl.train.state import InStorage, Location, OnHost, Transfer


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


class PoolMesh(NamedTuple):
  """One mesh of the training pool: its name, devices (jax devices, or ids in a
  simulation) and shape."""

  name: str
  devices: Sequence[Any]
  shape: tuple[int, ...]


class StateInfo(Protocol):
  """What the engine reads of a trainer's state: its size and where it lives."""

  @property
  def nbytes(self) -> int:
    ...

  @property
  def location(self) -> Location:
    ...


class PoolTrainer(Protocol):
  """What the engine moves: one agent's trainer (`train.trainer.AgentTrainer`,
  `sim.trainer.SimTrainer`). `bind` and `release` return once the state is there (as
  the real copies block; the engine calls `release` on a copy executor); `unbind`
  leaves the mesh but keeps the state on its devices (a later `bind` there moves
  nothing); `prefetch` only starts the copy on the executor it is given."""

  @property
  def layout(self) -> sharding.MeshLayout:
    ...

  @property
  def state(self) -> StateInfo:
    ...

  def bind(self, mesh: Any) -> Transfer:
    ...

  def release(self, to: OnHost | InStorage = OnHost()) -> Transfer:
    ...

  def unbind(self) -> None:
    ...

  def prefetch(self, mesh: Any, executor: concurrent.futures.Executor) -> None:
    ...


# Builds the mesh object a trainer binds to, from a pool mesh and the trainer's layout.
MakeMesh = Callable[[PoolMesh, sharding.MeshLayout], Any]

# Builds the executor that carries one link's copies (a mesh's, or 'storage').
MakeExecutor = Callable[[str], concurrent.futures.Executor]


def copy_thread(link: str) -> concurrent.futures.Executor:
  """One thread per link: its copies run one at a time, in the order they were asked."""
  return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f'swap-{link}')


class InlineExecutor(concurrent.futures.Executor):
  """Runs each call at once on the caller's thread: for simulated trainers, whose copies
  only reserve simulated time (so they need no thread, and the run stays deterministic)."""

  def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    try:
      future.set_result(fn(*args, **kwargs))
    except BaseException as e:  # pylint: disable=broad-except  # the future carries it
      future.set_exception(e)
    return future


def inline(link: str) -> concurrent.futures.Executor:
  del link
  return InlineExecutor()


def jax_mesh(mesh: PoolMesh, layout: sharding.MeshLayout):
  """A jax Mesh over the pool mesh's devices with `layout`'s axis names (agents of one
  shape may name their axes differently; the devices are the same)."""
  return sharding.make_mesh(mesh.devices, mesh.shape, layout.axes)
