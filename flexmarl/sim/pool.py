"""A simulated training pool: more agents than meshes, bound on demand, swaps charged.

The same decisions as the real `train.engine.TrainingEngine`, made by the same pure
functions: `train.allocator.allocate` picks which waiting agent gets which mesh, and
`train.allocator.evict_lru` which host-resident states go to storage when the host
budget would be exceeded. Carrying them out costs simulated time on the mesh's link to
host memory (its own track, 'link/MESH'), one transfer at a time, each an agent's
train-state bytes over the link's bandwidth: the bound agent's state arrives
(`SWAP_IN`, from host memory, or from storage if it was evicted there) while the mesh
may still compute for the resident (the real engine prefetches it so), and its work
starts once both are done; the resident's state then leaves (`SWAP_OUT`) once its
work is done, while the new agent computes. Memory for the two states at once is
assumed (a 14B state is 207 GB, a 16-device mesh of 64 GB devices holds 1 TB).

`team.Agent` calls it as it calls the real engine: `submit` work, `run`, `step_stats`.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, Sequence

from flexmarl.clock import SimClock
from flexmarl.metrics import spans
from flexmarl.sim.costs import transfer_time
from flexmarl.sim.devices import DeviceGroup
from flexmarl.sim.trainer import SimTrainer
from flexmarl.train.allocator import FreeMesh, Waiting, allocate, evict_lru

HOST, STORAGE = 'host', 'storage'
LAYOUT = 'pool'  # every mesh of a simulated pool has the one shape its agents train on


class SimTrainingPool:
  """meshes: the pool's device groups (one per mesh, each its own track 'train/MESH').
  state_bytes: each agent's train state (what a swap moves).
  host_bytes_per_s / storage_bytes_per_s: a mesh's link to host memory and to storage.
  host_budget: bytes of host memory for released states (0: unlimited)."""

  def __init__(self, clock: SimClock, trainers: Mapping[str, SimTrainer],
               meshes: Sequence[DeviceGroup], state_bytes: Mapping[str, int],
               host_bytes_per_s: float, storage_bytes_per_s: float = 0.0,
               host_budget: int = 0):
    if host_budget and storage_bytes_per_s <= 0:
      raise ValueError(f'host_budget={host_budget} sends states to storage; give '
                       f'storage_bytes_per_s > 0 (got {storage_bytes_per_s}).')
    self.clock, self.trainers = clock, dict(trainers)
    self.meshes = {m.track: m for m in meshes}
    self.links = {name: DeviceGroup(clock, name.replace('train/', 'link/', 1),
                                    recorder=m.recorder) for name, m in self.meshes.items()}
    self.state_bytes = dict(state_bytes)
    self.bandwidth = {HOST: host_bytes_per_s, STORAGE: storage_bytes_per_s}
    self.host_budget = host_budget
    self.bound: dict[str, str | None] = {m: None for m in self.meshes}  # mesh -> agent
    self.where: dict[str, str] = {a: HOST for a in self.trainers}  # a mesh, HOST or STORAGE
    self.queues = {a: collections.deque() for a in self.trainers}
    self.since = {a: 0 for a in self.trainers}
    self.last_used = {a: 0 for a in self.trainers}
    self._stats = {a: self._empty() for a in self.trainers}
    self._tick = 0

  @staticmethod
  def _empty() -> dict:
    return dict(meshes=[], swaps=0, swap_bytes=0, swap_s=0.0, swap_wait_s=0.0)

  def _next_tick(self) -> int:
    self._tick += 1
    return self._tick

  def submit(self, agent: str, work: Callable[[], None]) -> None:
    if not self.queues[agent]:
      self.since[agent] = self._next_tick()
    self.queues[agent].append(work)

  def run(self) -> None:
    """Dispatch every queued piece of work, binding agents to meshes as `allocate` says."""
    while True:
      for agent, where in self.where.items():
        if where in self.meshes and self.queues[agent]:
          self._run_queue(agent)
      waiting = [Waiting(a, len(q), LAYOUT, self.since[a],
                         self.where[a] if self.where[a] in self.meshes else None)
                 for a, q in self.queues.items() if q]
      if not waiting:
        return
      free = [FreeMesh(m, LAYOUT, a, self.last_used[a] if a else 0)
              for m, a in self.bound.items()]
      for agent, mesh in allocate(waiting, free).items():
        self._bind(agent, mesh)

  def _run_queue(self, agent: str) -> None:
    queue = self.queues[agent]
    while queue:
      queue.popleft()()
    self.last_used[agent] = self._next_tick()
    meshes = self._stats[agent]['meshes']
    if not meshes or meshes[-1] != self.where[agent]:
      meshes.append(self.where[agent])

  def _bind(self, agent: str, mesh: str) -> None:
    resident = self.bound[mesh]
    if resident == agent:
      return
    if self.where[agent] in self.meshes:  # moving: its state goes through the host
      self._release(agent)
    group = self.meshes[mesh]
    arrived = self._swap(agent, mesh, spans.SWAP_IN, self.where[agent])
    if resident is not None:
      self._release(resident)
    group.busy_until = max(group.busy_until, arrived)  # its work waits for its state
    self.bound[mesh], self.where[agent] = agent, mesh
    self.trainers[agent].group = group

  def _release(self, agent: str) -> None:
    """The agent's state leaves its mesh for host memory once its work there is done."""
    mesh = self.where[agent]
    self._swap(agent, mesh, spans.SWAP_OUT, HOST, after=self.meshes[mesh].busy_until)
    self.bound[mesh], self.where[agent] = None, HOST
    if not self.host_budget:
      return
    on_host = {a: self.state_bytes[a] for a, w in self.where.items() if w == HOST}
    keep = {a for a, q in self.queues.items() if q}
    for evicted in evict_lru(on_host, self.last_used, self.host_budget, keep):
      self.where[evicted] = STORAGE  # written by the host; no mesh waits for it

  def _swap(self, agent: str, mesh: str, name: str, other_end: str, after: float = 0.0
            ) -> float:
    """Move `agent`'s state between `mesh` and HOST/STORAGE on the mesh's link, not
    before `after`; the end time."""
    nbytes = self.state_bytes[agent]
    seconds = transfer_time(nbytes, self.bandwidth[other_end])
    compute_free = self.meshes[mesh].busy_until
    end = self.links[mesh].run(name, seconds, after, agent=agent, bytes=nbytes,
                               other_end=other_end)
    stats = self._stats[agent]
    stats['swaps'] += 1
    stats['swap_bytes'] += nbytes
    stats['swap_s'] += seconds
    if name == spans.SWAP_IN:  # how long the agent's work waits for it past the mesh
      stats['swap_wait_s'] += max(0.0, end - max(compute_free, self.clock.now()))
    return end

  def step_stats(self, agent: str) -> dict:
    stats, self._stats[agent] = self._stats[agent], self._empty()
    return dict(stats, meshes=','.join(stats['meshes']))

  def close(self) -> None:
    pass
