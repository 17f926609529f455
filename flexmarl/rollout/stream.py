"""RolloutStream: a rollout in progress, driven from plain code.

The RolloutEngine runs a rollout as an async generator on its private event loop; this
object drives it from synchronous code: iterating gives each query's result in stream
order. `start` runs it only until its first requests are dispatched to the instances
and returns, so that their generation runs on the devices while the caller finishes
other host work (the step's stats and metrics, the store's queue); iterating goes on
from there. Closing it abandons the queries in flight.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any


class RolloutStream:
  """Iterator over a rollout's results; see the module docstring."""

  def __init__(self, make: Callable[[Callable[[], Awaitable[None]]], AsyncIterator[Any]],
               loop: asyncio.AbstractEventLoop):
    """`make(dispatched)`: the rollout, which awaits `dispatched()` each time it has
    dispatched requests: where a `start` leaves it."""
    self._loop = loop
    self._results = make(self._dispatched)
    self._next: asyncio.Future | None = None  # the pending step of `results`
    self._starting = False
    self._paused: asyncio.Future | None = None  # set: `start` has returned
    self._resume: asyncio.Future | None = None  # what the paused rollout waits on
    try:  # inside a running event loop (a notebook): the rollout's loop gets a thread
      asyncio.get_running_loop()
      self._worker: concurrent.futures.ThreadPoolExecutor | None = (
          concurrent.futures.ThreadPoolExecutor(1))
    except RuntimeError:
      self._worker = None

  async def _dispatched(self) -> None:
    if self._starting:
      self._starting = False
      self._resume = self._loop.create_future()
      self._paused.set_result(None)
      await self._resume

  def _run(self, awaitable: Awaitable[Any]) -> Any:
    if self._worker is None:
      return self._loop.run_until_complete(awaitable)
    return self._worker.submit(self._loop.run_until_complete, awaitable).result()

  def _pending(self) -> asyncio.Future:
    if self._resume is not None:
      self._resume.set_result(None)
      self._resume = None
    if self._next is None:
      self._next = asyncio.ensure_future(self._results.__anext__(), loop=self._loop)
    return self._next

  def start(self) -> None:
    """Run the rollout until it has dispatched its first requests (or produced a result,
    or failed: iterating then gives it); their generation goes on after this returns."""
    if self._next is not None:
      return  # started, or iterated, already
    self._starting = True
    self._paused = self._loop.create_future()
    pending = self._pending()
    self._run(asyncio.wait([self._paused, pending], return_when=asyncio.FIRST_COMPLETED))
    self._starting = False

  def __iter__(self) -> RolloutStream:
    return self

  def __next__(self) -> Any:
    pending = self._pending()
    try:
      return self._run(pending)
    except StopAsyncIteration:
      raise StopIteration from None
    finally:
      self._next = None

  def close(self) -> None:
    """Abandon the queries in flight (the rollout's own cleanup runs)."""
    try:
      if self._next is not None and not self._next.done():
        self._next.cancel()
        self._run(asyncio.wait([self._next]))
      self._next = None
      self._run(self._results.aclose())
    finally:
      if self._worker is not None:
        self._worker.shutdown()
        self._worker = None
