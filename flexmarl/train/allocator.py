"""Which waiting agent trains on which free mesh, and which host states go to storage.

Both are pure decisions over observed state, so the orchestrator, the tests and the
cluster simulator call them unchanged; carrying them out (bind, release, move) is the
caller's plumbing.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Collection, Hashable, Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class Waiting:
  """An agent with work for a mesh."""

  agent: str
  ready: int  # micro-batches ready to train (0: nothing to do yet)
  layout: Hashable  # the mesh layout it trains on (a sharding.MeshLayout)
  since: float  # when it was last served (or began waiting): the oldest goes first
  location: str | None = None  # the free mesh its state still sits on, if any
  near: str | None = None  # the mesh whose host memory holds its state (a cheaper copy)


@dataclasses.dataclass(frozen=True)
class FreeMesh:
  name: str
  layout: Hashable
  resident: str | None = None  # an agent whose released state still sits on it
  idle_since: float = 0.0  # when its resident last worked there


def allocate(waiting: Sequence[Waiting], free: Sequence[FreeMesh]) -> dict[str, str]:
  """Bindings agent -> mesh name.

  Who is served is decided first, fairly: oldest `since` first, ties by more ready
  micro-batches, then by name; an agent is served while a free mesh of its layout
  remains. Then where: each served agent keeps the mesh its state is on (no move);
  the others take, in queue order, a free mesh of their layout, preferring one that
  holds no state, then one holding the state of an agent that is not waiting (so a
  waiting agent's state stays put for its next turn), then the one `near` its state,
  then the one idle longest. One agent per mesh.
  """
  queue = sorted((w for w in waiting if w.ready > 0), key=lambda w: (w.since, -w.ready, w.agent))
  if len({w.agent for w in queue}) != len(queue):
    raise ValueError(f'allocate: an agent waits twice in {[w.agent for w in queue]}.')
  capacity = collections.Counter(m.layout for m in free)
  served = []
  for w in queue:
    if capacity[w.layout]:
      capacity[w.layout] -= 1
      served.append(w)
  by_name = {m.name: m for m in free}
  bindings: dict[str, str] = {}
  for w in served:
    home = by_name.get(w.location)
    if home is not None and home.layout == w.layout:
      bindings[w.agent] = home.name
  waiting_agents = {w.agent for w in queue}
  order = {m.name: i for i, m in enumerate(free)}
  for w in served:
    if w.agent in bindings:
      continue
    taken = set(bindings.values())
    options = [m for m in free if m.layout == w.layout and m.name not in taken]
    best = min(options, key=lambda m: (m.resident is not None, m.resident in waiting_agents,
                                       m.name != w.near, m.idle_since, order[m.name]))
    bindings[w.agent] = best.name
  return bindings


def evict_lru(sizes: Mapping[str, int], last_used: Mapping[str, float], budget: int,
              keep: Collection[str] = ()) -> list[str]:
  """The host-resident states to move to storage so the rest fit in `budget` bytes:
  least recently used first (ties by name), never one in `keep` (e.g. about to be bound).
  If even evicting everything allowed leaves too much, evicts all of those."""
  total = sum(sizes.values())
  evict = []
  for agent in sorted((a for a in sizes if a not in keep), key=lambda a: (last_used[a], a)):
    if total <= budget:
      break
    evict.append(agent)
    total -= sizes[agent]
  return evict
