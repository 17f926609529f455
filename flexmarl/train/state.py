"""An agent's training state as a value that knows where it lives, and one call to move it.

`AgentState` holds params, optimizer state, RNG (and, when present, the frozen
KL reference and a half-accumulated gradient). Its `location` says where the arrays
are: `OnMesh` (device memory, sharded), `OnHost` (pinned host memory where the
platform has that memory kind, else numpy) or `InStorage` (a folder of raw array files;
the state then carries only the arrays' shapes). `move(state, location)` goes from any
location to any other, resharding on the way, and reports bytes and seconds.

Moving does not delete the source arrays: a rollout sampler may still serve them; they
are freed when the last reference goes.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import os
import shutil
import time
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

FIELDS = ('params', 'opt_state', 'ref_params', 'grads', 'rng')
_LIKE_PARAMS = ('params', 'ref_params', 'grads')


@dataclasses.dataclass(frozen=True)
class OnMesh:
  mesh: Mesh
  shardings: dict  # {'params': tree, 'opt_state': tree} of NamedShardings on `mesh`


@dataclasses.dataclass(frozen=True)
class OnHost:
  pass


@dataclasses.dataclass(frozen=True)
class InStorage:
  path: str  # a folder of raw array files (written on move, read on move out)


Location = OnMesh | OnHost | InStorage


@dataclasses.dataclass(frozen=True)
class AgentState:
  params: Any
  opt_state: Any
  rng: Any  # raw key data (uint32), so it moves like any array
  location: Location
  ref_params: Any = None
  grads: Any = None

  def arrays(self) -> dict:
    return {f: getattr(self, f) for f in FIELDS}

  @property
  def nbytes(self) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(self.arrays()))


class Transfer(NamedTuple):
  """What one move did: from where, to where, bytes, seconds (until the arrays were ready)."""
  source: str
  target: str
  bytes: int
  seconds: float


def kind(location: Location) -> str:
  return {OnMesh: 'mesh', OnHost: 'host', InStorage: 'storage'}[type(location)]


def has_pinned_host(device: jax.Device) -> bool:
  return 'pinned_host' in {m.kind for m in device.addressable_memories()}


def _shardings(state: AgentState, to: OnMesh) -> dict:
  """Per-field target shardings; fields absent from the state stay absent."""
  out = {}
  for f, tree in state.arrays().items():
    if tree is None:
      out[f] = None
    elif f == 'rng':
      out[f] = NamedSharding(to.mesh, P())
    else:
      out[f] = to.shardings['params' if f in _LIKE_PARAMS else 'opt_state']
  return out


def _identity(*arrays: jax.Array) -> tuple[jax.Array, ...]:
  return arrays


@functools.lru_cache(maxsize=64)
def _compiled_copy(targets: tuple[NamedSharding, ...]) -> Any:
  """The compiled copy onto `targets`, memoized like jax's own caches (one per state
  layout and place: swaps repeat them, and building the jit wrapper each time would
  cost about as much as the copy)."""
  return jax.jit(_identity, out_shardings=targets)


def _copy(leaves: list, targets: list) -> list:
  """`leaves` (jax arrays or numpy) copied to `targets` (shardings, one each). Where every
  array already lies on its target's mesh (a release to that mesh's host memory, a bind
  back onto it), one compiled copy moves them all: a small state's per-array costs
  would dominate a `device_put` (a release of 80 arrays, 1.3 MB, on CPU: 2.2 ms against
  0.7 ms). Otherwise (another mesh, numpy) one batched `device_put`."""
  if not leaves:
    return []
  meshes = {getattr(t, 'mesh', None) for t in targets}
  if (len(meshes) == 1 and None not in meshes
      and all(isinstance(x, jax.Array) and getattr(x.sharding, 'mesh', None) in meshes
              for x in leaves)):
    return list(_compiled_copy(tuple(targets))(*leaves))
  return jax.device_put(leaves, targets)


def _to_host(arrays: dict) -> dict:
  """Device arrays to pinned host memory (same layout) where the platform has it, else
  numpy; numpy stays numpy."""
  leaves, treedef = jax.tree.flatten(arrays)
  has = {}  # per device: whether it has pinned host memory (asked once)

  def pinnable(x: Any) -> bool:
    if not isinstance(x, jax.Array):
      return False
    device = next(iter(x.sharding.device_set))
    if device not in has:
      has[device] = has_pinned_host(device)
    return has[device]
  pin = [pinnable(x) for x in leaves]
  to_pin = [x for x, p in zip(leaves, pin) if p]
  pinned = iter(_copy(to_pin, [x.sharding.with_memory_kind('pinned_host') for x in to_pin]))
  return jax.tree.unflatten(treedef, [next(pinned) if p else np.asarray(x)
                                      for x, p in zip(leaves, pin)])


def _abstract(arrays: dict) -> dict:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), arrays)


def _files(path: str, arrays: dict) -> list[str]:
  """The file of each array (in tree order) of a state stored at `path`."""
  return [os.path.join(path, 'arrays', f'{i}.bin') for i in range(len(jax.tree.leaves(arrays)))]


def _save(path: str, arrays: dict) -> None:
  """Each array's raw bytes in a file of its own: a swap file is read back only by the
  same agent config (which gives shapes and dtypes), so it needs no format or metadata
  and writes at the speed of a plain file write. (Checkpoints are Orbax's.)"""
  os.makedirs(os.path.join(path, 'arrays'), exist_ok=True)
  for file, x in zip(_files(path, arrays), jax.tree.leaves(arrays), strict=True):
    np.ascontiguousarray(np.asarray(x)).tofile(file)


def _read(file: str, like: Any) -> np.ndarray:
  nbytes = int(np.prod(like.shape)) * np.dtype(like.dtype).itemsize
  size = os.path.getsize(file) if os.path.exists(file) else None
  if size != nbytes:
    raise ValueError(f'stored state file {file}: {size} bytes, expected {nbytes} for an '
                     f'array {like.dtype}{list(like.shape)}; the folder holds another '
                     'agent config\'s state (or none): give the path its own state moved there.')
  return np.fromfile(file, like.dtype).reshape(like.shape)


def _restore(path: str, like: dict, shardings: dict | None) -> dict:
  """Read a saved state into host memory (numpy), then onto the mesh shardings if given
  (resharding)."""
  leaves, treedef = jax.tree.flatten(like)
  arrays = jax.tree.unflatten(treedef, [_read(f, x) for f, x in
                                        zip(_files(path, like), leaves, strict=True)])
  return arrays if shardings is None else jax.device_put(arrays, shardings)


def move(state: AgentState, to: Location, *, wait: bool = True
         ) -> tuple[AgentState, Transfer]:
  """The same state at `to`. With `wait=False` device transfers are only started (jax
  dispatches them asynchronously); storage reads and writes always complete."""
  src = state.location
  if src == to:
    return state, Transfer(kind(src), kind(to), 0, 0.0)
  if not isinstance(src, InStorage):
    return put(state, to, wait=wait)
  start = time.perf_counter()
  if isinstance(to, InStorage):
    os.makedirs(to.path, exist_ok=True)
    shutil.copytree(src.path, to.path, dirs_exist_ok=True)
    arrays = state.arrays()
  else:
    arrays = _restore(src.path, state.arrays(),
                      _shardings(state, to) if isinstance(to, OnMesh) else None)
  return _done(state, to, arrays, start, wait)


def put(state: AgentState, to: Location, *, wait: bool = True
        ) -> tuple[AgentState, Transfer]:
  """`state`'s in-memory arrays (wherever they are: any device, host, numpy) at `to`.
  Waiting, the seconds reported are the copy's alone: the clock starts once the arrays
  are computed (a release follows the agent's last dispatched update)."""
  arrays = state.arrays()
  if wait:
    jax.block_until_ready(arrays)
  start = time.perf_counter()
  if isinstance(to, InStorage):
    os.makedirs(to.path, exist_ok=True)
    _save(to.path, arrays)
    arrays = _abstract(arrays)
  elif isinstance(to, OnMesh):
    leaves, treedef = jax.tree.flatten(arrays)
    arrays = jax.tree.unflatten(treedef, _copy(leaves, treedef.flatten_up_to(
        _shardings(state, to))))
  else:
    arrays = _to_host(arrays)
  return _done(state, to, arrays, start, wait)


def _done(state: AgentState, to: Location, arrays: dict, start: float, wait: bool
          ) -> tuple[AgentState, Transfer]:
  if wait:
    jax.block_until_ready(arrays)
  moved = dataclasses.replace(state, location=to, **arrays)
  return moved, Transfer(kind(state.location), kind(to), state.nbytes,
                         time.perf_counter() - start)


def load(path: str, like: AgentState, to: Location) -> tuple[AgentState, Transfer]:
  """A state saved at `path` by a move to InStorage (this process or an earlier one),
  moved to `to`; `like` gives the structure (any state of the same agent config)."""
  stored = dataclasses.replace(like, location=InStorage(path),
                               **_abstract(like.arrays()))
  return move(stored, to)


def prefetch(state: AgentState, to: Location,
             executor: concurrent.futures.Executor) -> concurrent.futures.Future:
  """Start moving `state` to `to` on `executor` (a thread: storage reads block, device
  copies overlap with whatever the caller dispatches next). The future gives what
  `move` gives."""
  return executor.submit(move, state, to)
