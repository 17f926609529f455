"""TrainingEngine: agents take turns on the training pool's meshes.

An agent holds a mesh only while it has work. The schedule hands the engine work
(`submit`: a micro-batch's gradient, an optimizer step) and `run` carries it out: a
bound agent's work runs at once (dispatched, not awaited); the others wait, and
`train.allocator.allocate` (a pure policy) picks who gets which mesh. A mesh whose
agent has no work left keeps its state until another agent needs the mesh; it is then
released to host memory, and from there to storage, least recently used first, past
`host_budget` bytes (`train.allocator.evict_lru`). While one agent computes, the next
waiting one's state is prefetched onto the mesh it will get. The schedule also says who
will train soon (`expect`: a step's rollout has begun): their states are prefetched
while the meshes serve others or sit idle, and one that leaves a mesh keeps its state
there (`unbind`) rather than be copied out and back. A mesh holds at most two states:
its resident's and one on its way or left there (`_prefetched`).

Copies run off the caller's thread: a release (mesh -> host) on the mesh's copy
executor, once the agent's dispatched work is done, while the next agent computes there;
a write to storage on the storage one; a prefetch on the executor of the mesh it goes
to. A state is never used while a copy of it is in flight: its next bind, prefetch or
write waits for that copy, and so do checkpoints (`wait`) and `close`.

The engine moves nothing itself: it calls the `PoolTrainer` it binds (`bind`,
`release`, `unbind`, `prefetch`) on meshes that `make_mesh` builds, and reads time only
through its `Clock`: one engine serves a real run (`AgentTrainer`s, jax meshes, the wall
clock) and the cluster simulator (simulated trainers and devices, simulated time).

Swaps are recorded per agent (`step_stats`: `swap_s` the copies took, `swap_wait_s` the
caller was blocked by them) and as spans on `recorder` (None records none): a release
spans its copy, a bind the time the caller waited; each carries `copy_s` and `wait_s`,
so the share of swap time hidden is 1 - sum(wait_s) / sum(copy_s).
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import os
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from flexmarl.core.clock import Clock
from flexmarl.metrics import spans
from flexmarl.models import sharding
from flexmarl.train.allocator import FreeMesh, Waiting, allocate, evict_lru
from flexmarl.train.pool_meshes import (MakeExecutor, MakeMesh, PoolMesh, PoolTrainer, copy_thread,
                                 jax_mesh)
from flexmarl.train.state import InStorage, OnHost, Location, Transfer


# How many swaps `TrainingEngine.log` keeps: a long run's memory stays flat.
RECENT_SWAPS = 4096


class TrainingEngine:

  def __init__(self, trainers: Mapping[str, PoolTrainer], meshes: Sequence[PoolMesh],
               host_budget: int = 0, storage_dir: str = '', recorder=None, *,
               clock: Clock, make_mesh: MakeMesh = jax_mesh,
               make_executor: MakeExecutor = copy_thread, states_per_mesh: int = 2):
    """`meshes`: PoolMesh (or plain (name, devices, shape)) tuples. `host_budget`:
    bytes of host memory for released states (0: unlimited); beyond it states go to
    `storage_dir/AGENT`. `clock`: the run's, which times the swaps. `make_executor`:
    the copy executor of each mesh and of storage (`inline` for simulated trainers).
    `states_per_mesh`: 2, or 1 where a mesh's memory holds one state (no state then
    comes onto a mesh before its resident's has left)."""
    self.trainers = dict(trainers)
    self.meshes = {m.name: m for m in (PoolMesh(name, tuple(devices), tuple(shape))
                                       for name, devices, shape in meshes)}
    self.host_budget, self.storage_dir, self.recorder = host_budget, storage_dir, recorder
    self.clock, self.states_per_mesh = clock, states_per_mesh
    self._make_mesh = make_mesh
    self.bound: dict[str, str | None] = {m: None for m in self.meshes}  # mesh -> agent
    self.where: dict[str, str | None] = {a: None for a in self.trainers}  # agent -> mesh
    self.queues = {a: collections.deque() for a in self.trainers}
    self.since = {a: 0 for a in self.trainers}
    self.last_used = {a: 0 for a in self.trainers}
    # The last RECENT_SWAPS swaps (agent, mesh, direction, bytes, seconds).
    self.log: collections.deque[dict] = collections.deque(maxlen=RECENT_SWAPS)
    self._stats = {a: self._empty() for a in self.trainers}
    # agent -> the mesh its state is moving onto, or was left on (`_leave`), while it
    # is bound to none: no other state goes there meanwhile.
    self._prefetched: dict[str, str] = {}
    self._expected: set[str] = set()  # agents that will bring work soon (`expect`)
    # agent -> the mesh it was released from, while its state is in that mesh's host
    # memory: a copy back onto the same devices is one compiled copy (train.state).
    self._near: dict[str, str] = {}
    self._ticks = itertools.count(1)  # orders waits and uses
    self._mesh_cache: dict[tuple[str, sharding.MeshLayout], Any] = {}
    self._lock = threading.RLock()
    self._stats_lock = threading.Lock()  # stats and log: copy threads record swaps too
    self._copies = {m: make_executor(m) for m in self.meshes}
    self._storage_copies = make_executor('storage')
    # agent -> its copy in flight (a release or a write to storage) and where it goes.
    self._moving: dict[str, tuple[concurrent.futures.Future, Location]] = {}

  @staticmethod
  def _empty() -> dict:
    return dict(meshes=[], swaps=0, swap_bytes=0, swap_s=0.0, swap_wait_s=0.0)

  def mesh(self, name: str, layout: sharding.MeshLayout) -> Any:
    """Pool mesh `name` as a trainer of `layout` binds to it (built once)."""
    key = (name, layout)
    if key not in self._mesh_cache:
      self._mesh_cache[key] = self._make_mesh(self.meshes[name], layout)
    return self._mesh_cache[key]

  # -- work -----------------------------------------------------------------------------

  def submit(self, agent: str, work: Callable[[], None]) -> None:
    """Queue `work` (it calls the agent's trainer) to run once the agent is bound."""
    with self._lock:
      if not self.queues[agent]:
        self.since[agent] = next(self._ticks)
      self.queues[agent].append(work)

  def expect(self, agent: str) -> None:
    """`agent` will bring work before long (a step's rollout has begun), until its
    urgent work runs: its state starts moving to the mesh it will get meanwhile."""
    with self._lock:
      self._expected.add(agent)
      self._reap()
      self._prefetch_expected()

  def run(self, urgent: Collection[str] | None = None) -> None:
    """Carry out the queued work of agents that are bound or can bind to a mesh that
    holds no state, and all the work of the `urgent` agents (None: every agent),
    moving another agent's state out for them if need be. Returns once that work is
    dispatched (the devices may still be computing); the rest stays queued for a later
    `run`.

    A micro-batch is not worth a swap: the agent's optimizer step (run as urgent)
    binds it anyway, and every swap in between would be paid twice."""
    with self._lock:
      self._reap()
      self._expected.difference_update(urgent if urgent is not None else self.trainers)
      self._dispatch(urgent)
      self._prefetch_expected()

  def _dispatch(self, urgent: Collection[str] | None) -> None:
    """`run`'s work: bind and run until only agents that must wait are left."""
    while True:
      for agent, mesh in self.where.items():
        if mesh is not None and self.queues[agent]:
          self._run_queue(agent)
      # A waiting agent whose state is being prefetched onto a mesh counts as there.
      waiting = [Waiting(a, len(q), self.trainers[a].layout.shape, self.since[a],
                         self.where[a] or self._prefetched.get(a), self._near.get(a))
                 for a, q in self.queues.items() if q]
      free = [FreeMesh(m, mesh.shape, a, self.last_used[a] if a else 0)
              for m, mesh in self.meshes.items() for a in [self.bound[m]]]
      bindings = allocate(waiting, [m for m in free if m.resident is None])
      if not bindings:  # an urgent agent may take a mesh from one that is not waiting
        must = [w for w in waiting if urgent is None or w.agent in urgent]
        if not must:  # the others wait; their states start moving to where they will go
          plan = allocate(waiting, free)
          self._prefetch([w for w in waiting if w.agent in plan
                          and w.agent not in self._prefetched], plan)
          return
        bindings = allocate(must, free)
        if not bindings:
          shapes = sorted({w.layout for w in must})
          raise RuntimeError(f'no mesh of the training pool has the shapes {shapes} of '
                             f'{[w.agent for w in must]}; config checks should prevent this.')
      for agent, mesh in bindings.items():
        self._bind(agent, mesh)
      self._prefetch([w for w in sorted(waiting, key=lambda w: (w.since, w.agent))
                      if w.agent not in bindings and w.agent not in self._prefetched],
                     {a: m for a, m in bindings.items()})

  def _prefetch_expected(self) -> None:
    """Start moving expected agents, neither bound nor on their way, onto meshes no other
    prefetch targets (`allocate` decides: the one near each state first)."""
    agents = [a for a in self._expected if self.where[a] is None and a not in self._prefetched]
    if not agents:
      return
    targeted = set(self._prefetched.values())
    expected = [Waiting(a, 1, self.trainers[a].layout.shape, self.last_used[a],
                        near=self._near.get(a)) for a in agents]
    free = [FreeMesh(m, mesh.shape, a, self.last_used[a] if a else 0)
            for m, mesh in self.meshes.items() if m not in targeted for a in [self.bound[m]]]
    plan = allocate(expected, free)
    self._prefetch([w for w in sorted(expected, key=lambda w: (w.since, w.agent))
                    if w.agent in plan], plan)

  def _run_queue(self, agent: str) -> None:
    queue = self.queues[agent]
    while queue:
      queue.popleft()()
    self.last_used[agent] = next(self._ticks)
    with self._stats_lock:
      meshes = self._stats[agent]['meshes']
      if not meshes or meshes[-1] != self.where[agent]:
        meshes.append(self.where[agent])

  # -- moves ----------------------------------------------------------------------------

  def _bind(self, agent: str, mesh: str) -> None:
    self._prefetched.pop(agent, None)  # bind takes the prefetched copy if it is this mesh
    resident = self.bound[mesh]
    if resident == agent:
      return
    self._settle(agent)
    if resident is not None:
      self._leave(resident, mesh)
      if self.states_per_mesh == 1:
        self._settle(resident)  # its copy out first: the mesh holds one state
    trainer = self.trainers[agent]
    start = self.clock.now()
    transfer = trainer.bind(self.mesh(mesh, trainer.layout))
    end = self.clock.now()
    self._record(agent, mesh, spans.SWAP_IN, transfer, start, end, wait_s=end - start)
    self.bound[mesh], self.where[agent] = agent, mesh

  def _leave(self, agent: str, mesh: str) -> None:
    """Free the mesh of `agent`. An expected agent's state stays there (copied out and
    back, it would cost two swaps) unless another state is on its way there."""
    if (self.states_per_mesh > 1 and agent in self._expected
        and mesh not in self._prefetched.values()):
      self.trainers[agent].unbind()
      self.bound[mesh], self.where[agent] = None, None
      self._prefetched[agent] = mesh
    else:
      self._release(agent)

  def _release(self, agent: str) -> None:
    """Free the agent's mesh at once; its state moves to host memory on the mesh's copy
    executor (and, past the host budget, the least recently used states to storage)."""
    mesh = self.where[agent]
    self.bound[mesh], self.where[agent] = None, None
    self._start_move(agent, mesh, self._copies[mesh], OnHost())
    self._near[agent] = mesh
    if not self.host_budget:
      return
    on_host = {a: t.state.nbytes for a, t in self.trainers.items()
               if isinstance(self._destination(a), OnHost)}
    keep = {a for a, q in self.queues.items() if q}
    for evicted in evict_lru(on_host, self.last_used, self.host_budget, keep):
      self._near.pop(evicted, None)
      self._start_move(evicted, 'host', self._storage_copies,
                       InStorage(os.path.join(self.storage_dir, evicted)))

  def _destination(self, agent: str) -> Location:
    """Where the agent's state is, or goes if a copy of it is in flight."""
    moving = self._moving.get(agent)
    return moving[1] if moving else self.trainers[agent].state.location

  def _start_move(self, agent: str, track: str, executor: concurrent.futures.Executor,
                  to: OnHost | InStorage) -> None:
    """Release the agent's state to `to` on `executor`, after its copy in flight."""
    before = self._moving.get(agent)
    trainer = self.trainers[agent]

    def move() -> None:
      if before is not None:
        before[0].result()
      start = self.clock.now()
      transfer = trainer.release(to)
      self._record(agent, track, spans.SWAP_OUT, transfer, start, self.clock.now(), 0.0)
    self._moving[agent] = (executor.submit(move), to)

  def _settle(self, agent: str) -> None:
    """Wait for the agent's copy in flight, if any (raising its error); the wait counts
    as the agent's swap wait."""
    moving = self._moving.pop(agent, None)
    if moving is None:
      return
    start = self.clock.now()
    moving[0].result()
    if waited := self.clock.now() - start:
      with self._stats_lock:
        self._stats[agent]['swap_wait_s'] += waited

  def _reap(self) -> None:
    """Settle the copies that are done (so their errors surface at once)."""
    for agent in [a for a, (future, _) in self._moving.items() if future.done()]:
      self._settle(agent)

  def _prefetch(self, unserved: Sequence[Waiting], targets: Mapping[str, str]) -> None:
    """Start moving waiting agents onto meshes (one each) that others work on now: the
    copy overlaps with that work. `targets`: candidate meshes (by agent, for agents
    with a mesh in view; any agent of the mesh's shape may take one), less those
    another prefetch targets already. An agent whose state is still on its way out is
    left for a later `run`."""
    taken = set(self._prefetched.values())
    if self.states_per_mesh == 1:  # only onto a mesh that holds no state
      taken |= {m for m, a in self.bound.items() if a is not None}
    meshes = [m for m in targets.values() if m not in taken]
    for w in unserved:
      if w.agent in self._moving:
        if not self._moving[w.agent][0].done():
          continue
        self._settle(w.agent)
      mesh = targets.get(w.agent)
      if mesh is None or mesh not in meshes:
        mesh = next((m for m in sorted(meshes, key=lambda m: m != self._near.get(w.agent))
                     if self.meshes[m].shape == w.layout), None)
      if mesh is None:
        continue
      meshes.remove(mesh)
      trainer = self.trainers[w.agent]
      trainer.prefetch(self.mesh(mesh, trainer.layout), self._copies[mesh])
      self._prefetched[w.agent] = mesh

  def _record(self, agent: str, track: str, name: str, transfer: Transfer, start: float,
              end: float, wait_s: float) -> None:
    """Account one swap: `transfer.seconds` the copy took, `wait_s` the caller was
    blocked by it; the span is [start, end] on the mesh's (or host's) track."""
    if not transfer.bytes:
      return
    with self._stats_lock:
      stats = self._stats[agent]
      stats['swaps'] += 1
      stats['swap_bytes'] += transfer.bytes
      stats['swap_s'] += transfer.seconds
      stats['swap_wait_s'] += wait_s
      self.log.append(dict(agent=agent, mesh=track, name=name, source=transfer.source,
                           target=transfer.target, bytes=transfer.bytes,
                           seconds=transfer.seconds, wait_s=wait_s))
    if self.recorder is not None:
      self.recorder.add(f'train:{track}', name, start, end, agent=agent, bytes=transfer.bytes,
                        source=transfer.source, target=transfer.target,
                        copy_s=transfer.seconds, wait_s=wait_s)

  # -- reporting ------------------------------------------------------------------------

  def step_stats(self, agent: str) -> dict:
    """Where the agent ran since the last call (mesh names in order, comma-separated)
    and what its swaps cost; resets the counts."""
    with self._stats_lock:
      stats, self._stats[agent] = self._stats[agent], self._empty()
    return dict(stats, meshes=','.join(stats['meshes']))

  def wait(self, agent: str | None = None) -> None:
    """Wait until no copy of the agent's state (None: any agent's) is in flight: before
    its state is read or replaced outside the engine (a checkpoint, a restore)."""
    with self._lock:
      for a in list(self._moving) if agent is None else [agent]:
        self._settle(a)

  def close(self) -> None:
    """Wait for the copies in flight (raising the first error), then stop the threads."""
    try:
      self.wait()
    finally:
      for executor in [*self._copies.values(), self._storage_copies]:
        executor.shutdown(wait=True)
