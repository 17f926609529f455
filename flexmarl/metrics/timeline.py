"""Timeline: spans of the work dispatched to one device group, timed as it finishes."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import jax

from flexmarl.metrics import spans


class Timeline:
  """Spans of work dispatched to one device group, timed when their results are ready.

  Dispatch returns at once (JAX runs the work asynchronously), so a thread waits for
  each result in dispatch order; the device runs them in that order too, so a span
  starts when it was dispatched or when the previous one ended, whichever is later."""

  def __init__(self, recorder: spans.SpanRecorder, track: str):
    self.recorder, self.track = recorder, track
    self._waiter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=track)
    self._last_end = -float('inf')

  def add(self, name: str, outputs: Any, **args: Any) -> None:
    start = self.recorder.clock.now()
    args.setdefault('step', self.recorder.step)  # the step that dispatched it

    def wait() -> None:
      jax.block_until_ready(outputs)
      end = self.recorder.clock.now()
      self.recorder.add(self.track, name, max(start, self._last_end), end, **args)
      self._last_end = end
    self._waiter.submit(wait)

  def drain(self) -> None:
    """Wait until every span dispatched so far is recorded."""
    self._waiter.submit(lambda: None).result()

  def close(self) -> None:
    self._waiter.shutdown(wait=True)
