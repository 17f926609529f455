"""Clock: the one place scheduling code reads time and waits.

The rollout engine, the balancer and the schedules take a clock instead of calling
`time` directly, so a simulated clock can drive the same code.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol


class Pending(Protocol):
  def done(self) -> bool: ...


class Clock(Protocol):

  def now(self) -> float:
    """Seconds since an arbitrary origin."""

  def sleep(self, seconds: float) -> None:
    ...

  def wait_any(self, pendings: Sequence[Pending], timeout: float | None = None) -> list:
    """Block until at least one of `pendings` is done (or `timeout` passed); those done."""


class RealClock:
  """Wall time; waits poll every `poll_s` seconds (no core spins)."""

  def __init__(self, poll_s: float = 0.0005):
    self.poll_s = poll_s

  def now(self) -> float:
    return time.perf_counter()

  def sleep(self, seconds: float) -> None:
    time.sleep(seconds)

  def wait_any(self, pendings: Sequence[Pending], timeout: float | None = None) -> list:
    deadline = None if timeout is None else self.now() + timeout
    while True:
      done = [p for p in pendings if p.done()]
      if done or not pendings or (deadline is not None and self.now() >= deadline):
        return done
      time.sleep(self.poll_s)
