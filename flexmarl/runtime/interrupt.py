"""Ctrl-C that stops a run at its next safe point instead of tearing it.

A SIGINT raised as KeyboardInterrupt can land anywhere: inside a checkpoint wait,
inside JAX's garbage-collection callback (where Python prints "Exception ignored"
and the run trains on). `StopRequest` turns the first Ctrl-C into a flag that the
run loop checks between steps, where it can save, flush and close; a second Ctrl-C
raises KeyboardInterrupt at once, for a run that does not reach a safe point.

    with StopRequest() as stop:
      while step < steps and not stop.requested:
        ...
"""

from __future__ import annotations

import signal
import sys
import threading


class StopRequest:
  """Context manager: installs the SIGINT handler (main thread only), restores the old one."""

  def __init__(self, message: str = 'stopping after the current step (Ctrl-C again to abort '
               'at once)'):
    self.message = message
    self.requested = False
    self._previous = None

  def _handle(self, signum, frame) -> None:
    if self.requested:
      raise KeyboardInterrupt
    self.requested = True
    print(f'\n{self.message}', file=sys.stderr, flush=True)

  def __enter__(self) -> 'StopRequest':
    # Signal handlers can only be set from the main thread; elsewhere (a notebook's worker
    # thread) Ctrl-C keeps its default behaviour.
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGINT, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGINT, self._previous)
      self._previous = None
