"""Inter-agent load balancing: move rollout instances from cold agents to hot ones.

The decision (`decide`) is a pure function of observed loads, the current instance
counts and the per-agent limits, so tests and a simulator call it unchanged. The
`Balancer` around it keeps the moving averages and the cooldown, reading time from
the engine's clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class Limits:
  min_instances: int
  max_instances: int
  # instances only move between agents of the same group: a mesh shape (and under vLLM,
  # a model architecture too)
  shape: tuple


@dataclasses.dataclass(frozen=True)
class Move:
  source: str  # the cold agent that gives an instance
  target: str  # the hot agent that gets it
  loads: Mapping[str, float]  # the loads the decision saw


def decide(loads: Mapping[str, float], counts: Mapping[str, int],
           limits: Mapping[str, Limits], threshold: float) -> Move | None:
  """Move one instance from the coldest agent that can give one to the hottest that
  can take one, when load per instance differs by more than `threshold`×.

  Load per instance is the agent's load (queued + running tokens, averaged) over its
  instance count; an agent never drops below its minimum nor exceeds its maximum, and
  instances only move between agents of the same group (`Limits.shape`)."""
  per = {a: loads[a] / counts[a] for a in counts}
  for target in sorted(per, key=lambda a: (-per[a], a)):
    if counts[target] >= limits[target].max_instances or loads[target] <= 0:
      continue
    donors = [a for a in per if a != target and counts[a] > limits[a].min_instances
              and limits[a].shape == limits[target].shape]
    if not donors:
      continue
    source = min(donors, key=lambda a: (per[a], a))
    if per[target] > threshold * max(per[source], 1.0):
      return Move(source, target, dict(loads))
  return None


class Balancer:
  """Moving averages of each agent's load, a cooldown between moves, and the log of
  every decision."""

  def __init__(self, limits: Mapping[str, Limits], threshold: float, cooldown_s: float,
               smoothing: float = 0.5):
    self.limits, self.threshold = dict(limits), threshold
    self.cooldown_s, self.smoothing = cooldown_s, smoothing
    self.loads = {a: 0.0 for a in limits}
    self.last_move = -float('inf')
    self.log: list[dict] = []

  def observe(self, loads: Mapping[str, float]) -> None:
    s = self.smoothing
    for a, load in loads.items():
      self.loads[a] = s * self.loads[a] + (1 - s) * load

  def propose(self, counts: Mapping[str, int], now: float) -> Move | None:
    if now - self.last_move < self.cooldown_s:
      return None
    return decide(self.loads, counts, self.limits, self.threshold)

  def moved(self, move: Move, now: float) -> None:
    self.last_move = now
    self.log.append(dict(time=now, source=move.source, target=move.target,
                         loads={a: round(v, 1) for a, v in move.loads.items()}))
