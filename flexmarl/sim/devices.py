"""Simulated devices: a group that runs one operation at a time in dispatch order (a
training mesh), and what a team has compiled (a first call of a kind compiles).
"""

from __future__ import annotations

from collections.abc import Hashable

from flexmarl.core.clock import SimClock
from flexmarl.sim.cores import SharedCores

COMPILE = 'compile'  # span of a first call's compilation (busy: the devices wait for it)


class CompileCache:
  """What has been compiled: the first call of a kind (e.g. a model on a mesh shape)
  costs `seconds`, later ones nothing. Shared by a team, as the real step caches are."""

  def __init__(self, seconds: float = 0.0):
    if seconds < 0:
      raise ValueError(f'compile seconds={seconds}; it is a duration, >= 0.')
    self.seconds = seconds
    self.done: set[Hashable] = set()

  def cost(self, key: Hashable) -> float:
    if key in self.done:
      return 0.0
    self.done.add(key)
    return self.seconds


class DeviceGroup:
  """Devices that run one operation at a time, in dispatch order (a mesh, an instance)."""

  def __init__(self, clock: SimClock, track: str, cores: SharedCores | None = None,
               recorder=None):
    self.clock, self.track, self.cores, self.recorder = clock, track, cores, recorder
    self.busy_until = clock.now()

  def run(self, name: str, seconds: float, earliest: float = 0.0, **args) -> float:
    """Reserve the group for `seconds` after what is queued (and not before
    `earliest`); the end time."""
    start = max(self.clock.now(), self.busy_until, earliest)
    if self.cores is not None:
      start, _ = self.cores.reserve(start, seconds)
    self.busy_until = start + seconds
    if self.recorder is not None:
      self.recorder.add(self.track, name, start, self.busy_until, **args)
    return self.busy_until
