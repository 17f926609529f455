"""A simulated trainer: what `agent.Agent` uses of `AgentTrainer`, answered in simulated time.

Each operation (a micro-batch's forward/backward, an optimizer step) occupies the
device group the trainer is on for a cost-model duration. Operations on one group run
in the order they were dispatched: an operation starts at max(dispatch time, end of the
previous one). Dispatching never moves the clock (as JAX's async dispatch never blocks
the caller); waiting for a step's result advances the clock to the step's end, as a
real `device_get` blocks until the devices are done.

A trainer has a group of its own, or is moved between the meshes of a simulated
training pool by the real `train.engine.TrainingEngine`, as a `PoolTrainer`: `bind`,
`release` and `prefetch` copy its state (`state_bytes`) over a link, one copy at a time
per link, at the link's bandwidth: a mesh's link to host memory (the host bandwidth of
a device times the mesh's devices) for copies between the mesh and host memory, at the
storage bandwidth for reads from storage, and the storage link for writes of host
states to storage. As the engine's copies do, a release starts only after the work
dispatched on the mesh is done (the state is its result) and returns at once (the engine
runs it on a copy thread, so it occupies the link, not the caller): the state's next copy
waits for it, but the agent that takes the mesh does not. `bind` returns (advances the
clock) once the state is there, as the real one blocks; `prefetch` only reserves the
link, so the copy overlaps the resident agent's compute. Memory for two states on a mesh
at once is assumed (a 14B state is 207 GB, a 16-device mesh of 64 GB devices holds 1 TB).

With `overlapped_swaps` (the paper's engine: "swap cost is hidden behind rollout time"),
`bind` returns at once too: the copy is reserved on the link and only the work on the
mesh, and the state's next copy, wait for it. Then a swap holds up the training but
never the rollout.

A colocated trainer (rollout and training on the same devices, as hybrid engines do)
loads its train state onto the devices before the first micro-batch of an update
(`load_s`) and offloads it after the optimizer step (`offload_s`), so the rollout gets
the memory back.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Hashable
from typing import NamedTuple

import numpy as np

from flexmarl.core.clock import SimClock
from flexmarl.metrics import spans
from flexmarl.models import sharding
from flexmarl.sim.costs import transfer_time
from flexmarl.sim.devices import COMPILE, CompileCache, DeviceGroup
from flexmarl.train.state import InStorage, OnHost, OnMesh, Location, Transfer, kind
from flexmarl.train.trainer import TrainBatch


class Link(NamedTuple):
  """A copy path: the group that carries its copies (one at a time) and its bandwidth."""

  group: DeviceGroup
  bytes_per_s: float


class SimMesh(NamedTuple):
  """A mesh of the simulated training pool: the devices that compute and their link to
  host memory (what `TrainingEngine`'s `make_mesh` gives a simulated trainer)."""

  compute: DeviceGroup
  host: Link


@dataclasses.dataclass(frozen=True)
class SimState:
  """What the engine reads of a state: its bytes and where it is (an `OnMesh` holds the
  `SimMesh` in place of a jax Mesh)."""

  nbytes: int
  location: Location


class SimTrainer:
  """One agent's trainer.

  token_s: seconds of forward + backward per token (prompt and response tokens both
  run through the model; e.g. `costs.train_time(model, 1, devices, accel)`).
  optimizer_s: seconds of one optimizer step (`costs.optimizer_time`).
  micro_batch_s: seconds per micro-batch whatever its size (launch; calibrated).
  padded: charge every token slot of the padded micro-batch (as the JAX trainer computes
  it: power-of-two rows, widths rounded up), not only the real tokens.
  group: the device group it runs on (`DeviceGroup`); None in a pool, which binds it.
  load_s / offload_s: a colocated trainer's phase changes (see the module doc); 0: none.
  compile: the team's `CompileCache` and this trainer's key in it (model and mesh shape).
  layout: the mesh shape it trains on (a pool binds it to meshes of that shape).
  state_bytes: its train state, what a swap copies; storage: the link that writes host
  states to storage (its bandwidth also that of reads from storage), None: no storage.
  overlapped_swaps: swaps do not block the caller (see the module doc).
  """

  batch_multiple = 1

  def __init__(self, name: str, clock: SimClock, token_s: float, optimizer_s: float, *,
               group: DeviceGroup | None, micro_batch_s: float = 0.0, padded: bool = False,
               load_s: float = 0.0, offload_s: float = 0.0,
               compile: tuple[CompileCache, Hashable] | None = None,
               layout: sharding.MeshLayout = sharding.MeshLayout((1, 1), ('data', 'model')),
               state_bytes: int = 0, storage: Link | None = None,
               overlapped_swaps: bool = False):
    if min(token_s, optimizer_s, micro_batch_s, load_s, offload_s) < 0:
      raise ValueError(f'SimTrainer {name!r}: token_s={token_s}, optimizer_s={optimizer_s}, '
                       f'micro_batch_s={micro_batch_s}, load_s={load_s}, offload_s={offload_s};'
                       ' durations are seconds and must be >= 0.')
    self.name, self.clock, self.group = name, clock, group
    self.token_s, self.optimizer_s, self.micro_batch_s = token_s, optimizer_s, micro_batch_s
    self.padded, self.load_s, self.offload_s, self.compile = padded, load_s, offload_s, compile
    self.layout, self.state_bytes, self.storage = layout, state_bytes, storage
    self.overlapped_swaps = overlapped_swaps
    self._ready = 0.0  # when the state's last copy (not waited for) ends
    self.mesh: SimMesh | None = None  # the pool mesh it is bound to
    self._location: Location = OnHost() if group is None else OnMesh(group, {})
    self._incoming: tuple[SimMesh, Location, float, float] | None = None  # a prefetch
    # No weights are simulated: `params` says only when the last update's are ready
    # (SimSampler.update_weights syncs them no earlier).
    self.params = {'ready_s': np.zeros((), np.float64)}
    self._update = 0  # the agent's updates before the one being accumulated
    self._tokens = 0  # tokens accumulated since the last optimizer step
    self._micro_batches = 0

  @property
  def state(self) -> SimState:
    return SimState(self.state_bytes, self._location)

  def _run(self, name: str, seconds: float, **args) -> float:
    if self.group is None:
      raise RuntimeError(f'agent {self.name!r} is not bound to a mesh (its state is in '
                         f'{kind(self._location)}): the engine binds it before its work.')
    return self.group.run(name, seconds, self._ready, agent=self.name, version=self._update,
                          **args)

  # -- where the state lives (the engine's PoolTrainer) ---------------------------------

  def _copy(self, link: Link, name: str, bytes_per_s: float, target: Location,
            earliest: float = 0.0) -> tuple[float, float]:
    """Reserve `link` for a copy of the state to `target`; (end time, seconds)."""
    seconds = transfer_time(self.state_bytes, bytes_per_s)
    end = link.group.run(name, seconds, earliest, agent=self.name, bytes=self.state_bytes,
                         source=kind(self._location), target=kind(target))
    return end, seconds

  def _storage(self) -> Link:
    if self.storage is None:
      raise RuntimeError(f'agent {self.name!r}: a copy to or from storage, but the setup '
                         'gives no storage link: set links.storage_bytes_per_s > 0.')
    return self.storage

  def _copy_in(self, mesh: SimMesh) -> tuple[float, float]:
    """Reserve the mesh's link for the state's copy onto it, from host or storage."""
    rate = (self._storage().bytes_per_s if isinstance(self._location, InStorage)
            else mesh.host.bytes_per_s)
    return self._copy(mesh.host, spans.SWAP_IN, rate, OnMesh(mesh, {}), self._ready)

  def _wait(self, end: float) -> None:
    if self.clock.now() < end:
      self.clock.advance_to(end)

  def _settle(self, end: float, wait: bool) -> None:
    """A copy that ends at `end`: wait for it (`wait`), or only keep what comes next
    (work on the mesh, a further copy) from starting before it."""
    if wait:
      self._wait(end)
    else:
      self._ready = end

  def prefetch(self, mesh: SimMesh, executor: concurrent.futures.Executor | None = None
               ) -> None:
    """Start copying the state onto `mesh` (the link is reserved from now; no wait); the
    next `bind(mesh)` takes it."""
    del executor  # a simulated copy needs no thread
    end, seconds = self._copy_in(mesh)
    self._incoming = (mesh, self._location, end, seconds)

  def bind(self, mesh: SimMesh) -> Transfer:
    """Copy the state onto `mesh` (or take the prefetched copy) and wait until it is
    there (with `overlapped_swaps`, return at once: its work on the mesh starts when
    the copy ends); a no-op when it is bound there already."""
    if self.mesh is mesh:
      return Transfer('mesh', 'mesh', 0, 0.0)
    if self.mesh is not None:
      raise RuntimeError(f'agent {self.name!r} is bound to another mesh; release it first.')
    incoming, self._incoming = self._incoming, None
    if self._location == OnMesh(mesh, {}):  # left there by `unbind`
      self.mesh, self.group = mesh, mesh.compute
      return Transfer('mesh', 'mesh', 0, 0.0)
    if incoming is not None and incoming[0] is mesh and incoming[1] == self._location:
      end, seconds = incoming[2:]
    else:
      end, seconds = self._copy_in(mesh)
    self._settle(end, wait=not self.overlapped_swaps)
    source = kind(self._location)
    self.mesh, self.group, self._location = mesh, mesh.compute, OnMesh(mesh, {})
    return Transfer(source, 'mesh', self.state_bytes, seconds)

  def release(self, to: OnHost | InStorage = OnHost()) -> Transfer:
    """Reserve the copy of the state off its mesh (once the work dispatched there is
    done) or from host memory to storage, after the state's previous copy; returns at
    once (the state is at `to` from the copy's end on)."""
    source = self._location
    if source == to:
      return Transfer(kind(source), kind(to), 0, 0.0)
    if isinstance(source, OnMesh):  # bound, or left there by `unbind`
      mesh = source.mesh
      rate = (mesh.host.bytes_per_s if isinstance(to, OnHost) else self._storage().bytes_per_s)
      end, seconds = self._copy(mesh.host, spans.SWAP_OUT, rate, to,
                                earliest=max(mesh.compute.busy_until, self._ready))
    else:
      storage = self._storage()
      end, seconds = self._copy(storage, spans.SWAP_OUT, storage.bytes_per_s, to,
                                earliest=self._ready)
    self._settle(end, wait=False)
    self.mesh = self.group = None
    self._location = to
    return Transfer(kind(source), kind(to), self.state_bytes, seconds)

  def unbind(self) -> None:
    """Leave the mesh, the state staying there (a `bind` back onto it copies nothing)."""
    self.mesh = self.group = None

  def accumulate(self, batch: TrainBatch, update: int = 0) -> None:
    """Queue one micro-batch's forward/backward over its real tokens (its padded token
    slots with `padded`); the first of an update loads a colocated train state."""
    self._update = update
    if self._micro_batches == 0 and self.load_s:
      self._run(spans.SWAP_IN, self.load_s)
    if self.compile is not None:
      cache, key = self.compile
      if seconds := cache.cost(key):
        self._run(COMPILE, seconds)
    tokens = int(batch.prompt_mask.sum()) + batch.tokens
    charged = batch.prompts.size + batch.responses.size if self.padded else tokens
    self._run(spans.MICRO_BATCH, self.micro_batch_s + charged * self.token_s, tokens=tokens)
    self._tokens += tokens
    self._micro_batches += 1

  def count_silent(self, tokens: int, rows: int) -> None:
    """Rows of the batch not run (`grpo.silent`): counted, at no cost."""
    self._tokens += tokens

  def reset(self) -> None:
    """A simulated trainer holds no weights: nothing to reset."""

  def dispatch_apply(self, step: bool = True) -> Callable[[], dict[str, float]]:
    """Queue the optimizer step (and a colocated state's offload). The returned function advances the clock to the step's end and gives
    its stats. `step` is ignored: a simulated step costs the same either way."""
    if self._tokens == 0:
      raise RuntimeError(f'agent {self.name!r}: optimizer step with no accumulated tokens.')
    end = self._run(spans.OPTIMIZER_STEP, self.optimizer_s)
    if self.offload_s:
      end = self._run(spans.SWAP_OUT, self.offload_s)
    stats = dict(trained_tokens=self._tokens, micro_batches=self._micro_batches)
    self._tokens = self._micro_batches = 0
    self.params = {'ready_s': np.asarray(end, np.float64)}

    def result() -> dict[str, float]:
      if self.clock.now() < end:
        self.clock.advance_to(end)
      return stats
    return result
