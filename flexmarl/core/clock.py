"""Clock: the one place scheduling code reads time and waits.

The orchestrator, balancer and allocator never call `time` directly: they ask a
clock. `RealClock` is the wall clock of a real run; `SimClock` is the time of a
simulated cluster, which moves only when the simulation says so, so the same
scheduling code can plan a 768-accelerator run in seconds on a laptop.

A *pending* is any object with a non-blocking `done()` (a future, a rollout
request, a simulated job). Simulated pendings also carry `finish_time`, the
simulated time at which they complete; `SimClock.wait_any` jumps there.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar


class Pending(Protocol):

  def done(self) -> bool:
    ...


P = TypeVar('P', bound=Pending)


class Clock(Protocol):
  """Seconds as floats; `now()` never goes backwards."""

  def now(self) -> float:
    ...

  def sleep(self, seconds: float) -> None:
    ...

  def wait_any(self, pendings: Sequence[P], timeout: float | None = None) -> list[P]:
    """The pendings that are done, waiting until at least one is or `timeout` passes
    (then `[]`). Returns at once when one is already done."""
    ...


def _done(pendings: Sequence[P]) -> list[P]:
  return [p for p in pendings if p.done()]


class RealClock:
  """Wall time: `perf_counter`'s resolution and monotonicity, anchored once to the
  epoch so that the timestamps of a resumed run follow those of the run before it."""

  POLL_S = 0.0005  # short enough to add < 1 ms of latency, long enough to leave the core idle

  def __init__(self):
    self._offset = time.time() - time.perf_counter()

  def now(self) -> float:
    return time.perf_counter() + self._offset

  def sleep(self, seconds: float) -> None:
    if seconds > 0:
      time.sleep(seconds)

  def wait_any(self, pendings: Sequence[P], timeout: float | None = None) -> list[P]:
    """Futures (a sampler's batches) are waited on without waking up: a poll every
    POLL_S preempts a CPU sampler's threads (vLLM on CPU: about 13% of its throughput,
    experiments/benchmarks/vllm_in_run.py). Other pendings are polled."""
    if not pendings:
      raise ValueError('wait_any got no pendings: it would wait forever; pass at least one.')
    if all(isinstance(p, concurrent.futures.Future) for p in pendings):
      done, _ = concurrent.futures.wait(pendings, timeout, concurrent.futures.FIRST_COMPLETED)
      return [p for p in pendings if p in done]
    deadline = None if timeout is None else time.perf_counter() + timeout
    while True:
      ready = _done(pendings)
      if ready:
        return ready
      left = None if deadline is None else deadline - time.perf_counter()
      if left is not None and left <= 0:
        return []
      time.sleep(self.POLL_S if left is None else min(self.POLL_S, left))


class SimClock:
  """Simulated time: starts at `start` and advances only through `advance`,
  `advance_to`, `sleep` or `wait_any` (which jumps to the earliest `finish_time`)."""

  def __init__(self, start: float = 0.0):
    self._now = float(start)

  def now(self) -> float:
    return self._now

  def advance(self, dt: float) -> None:
    if dt < 0:
      raise ValueError(f'SimClock.advance(dt={dt}): time cannot go backwards; pass dt >= 0.')
    self._now += dt

  def advance_to(self, t: float) -> None:
    if t < self._now:
      raise ValueError(f'SimClock.advance_to(t={t}) is before now={self._now}: '
                       'time cannot go backwards.')
    self._now = float(t)

  def sleep(self, seconds: float) -> None:
    self.advance(max(0.0, seconds))

  def wait_any(self, pendings: Sequence[P], timeout: float | None = None) -> list[P]:
    if not pendings:
      raise ValueError('wait_any got no pendings: it would wait forever; pass at least one.')
    ready = _done(pendings)
    if ready:
      return ready
    finishes = [p.finish_time for p in pendings if getattr(p, 'finish_time', None) is not None]
    deadline = None if timeout is None else self._now + timeout
    if not finishes:
      if deadline is None:
        raise RuntimeError('SimClock.wait_any: none of the pendings is done and none has a '
                           'finish_time, so simulated time can never make one done.')
      self.advance_to(deadline)
      return []
    target = min(finishes)
    if deadline is not None and deadline < target:
      self.advance_to(deadline)
      return []
    self.advance_to(max(target, self._now))
    return _done(pendings)


class SimPending:
  """A simulated job that completes at `finish_time` with `value`. `result()` waits
  for it in simulated time (it advances the clock), as a real future would block."""

  def __init__(self, clock: SimClock, finish_time: float, value: Any = None):
    self.clock = clock
    self.finish_time = float(finish_time)
    self.value = value

  def done(self) -> bool:
    return self.clock.now() >= self.finish_time

  def result(self) -> Any:
    if not self.done():
      self.clock.advance_to(self.finish_time)
    return self.value
