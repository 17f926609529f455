"""Clocks: real waits return when a pending is done without spinning; simulated time
moves only when told, and wait_any jumps to the earliest finish."""

import threading
import time

import pytest

from flexmarl.core.clock import RealClock, SimClock, SimPending


class _Flag:

  def __init__(self):
    self.event = threading.Event()

  def done(self) -> bool:
    return self.event.is_set()


@pytest.mark.quick
def test_real_clock_wait_any_returns_the_done_ones_soon_after_they_finish():
  clock = RealClock()
  slow, fast = _Flag(), _Flag()
  threading.Timer(0.05, fast.event.set).start()
  cpu0, t0 = time.process_time(), clock.now()
  assert clock.wait_any([slow, fast]) == [fast]
  waited, cpu = clock.now() - t0, time.process_time() - cpu0
  assert 0.045 <= waited < 0.5
  assert cpu < 0.5 * waited, f'wait_any used {cpu:.3f} s of CPU in {waited:.3f} s: it spins'


def test_real_clock_wait_any_times_out_with_nothing_done():
  clock = RealClock()
  t0 = clock.now()
  assert clock.wait_any([_Flag()], timeout=0.02) == []
  assert 0.02 <= clock.now() - t0 < 0.3
  with pytest.raises(ValueError, match='no pendings'):
    clock.wait_any([])


def test_real_clock_is_epoch_anchored_and_monotonic():
  clock = RealClock()
  a, b = clock.now(), clock.now()
  assert b >= a and abs(a - time.time()) < 1.0


def test_sim_clock_moves_only_when_told():
  clock = SimClock()
  assert clock.now() == 0.0
  clock.advance(1.5)
  clock.sleep(0.5)
  clock.advance_to(3.0)
  assert clock.now() == 3.0
  with pytest.raises(ValueError, match='backwards'):
    clock.advance_to(2.0)
  with pytest.raises(ValueError, match='backwards'):
    clock.advance(-1)


@pytest.mark.quick
def test_sim_clock_wait_any_jumps_to_the_earliest_finish():
  clock = SimClock(10.0)
  a, b, c = SimPending(clock, 14.0, 'a'), SimPending(clock, 12.0, 'b'), SimPending(clock, 12.0, 'c')
  assert clock.wait_any([a, b, c]) == [b, c] and clock.now() == 12.0
  assert clock.wait_any([a], timeout=1.0) == [] and clock.now() == 13.0
  assert clock.wait_any([a, b]) == [b] and clock.now() == 13.0  # b already done: no move
  assert a.result() == 'a' and clock.now() == 14.0


def test_sim_clock_refuses_a_wait_that_can_never_end():
  clock = SimClock()
  with pytest.raises(RuntimeError, match='finish_time'):
    clock.wait_any([_Flag()])
  assert clock.wait_any([_Flag()], timeout=2.0) == [] and clock.now() == 2.0


def test_real_clock_waits_on_futures_without_polling(monkeypatch):
  """A sampler's batches (futures) are waited on, not polled: no sleep-and-check loop
  competes with a CPU sampler's threads; done ones come back in the order given."""
  import concurrent.futures
  clock = RealClock()
  monkeypatch.setattr(time, 'sleep', lambda s: pytest.fail('wait_any polled futures'))
  slow, fast, done = (concurrent.futures.Future() for _ in range(3))
  threading.Timer(0.05, fast.set_result, [1]).start()
  t0 = clock.now()
  assert clock.wait_any([slow, fast]) == [fast]
  assert 0.045 <= clock.now() - t0 < 0.5
  assert clock.wait_any([slow], timeout=0.02) == []
  done.set_result(2)
  assert clock.wait_any([done, slow, fast]) == [done, fast]
