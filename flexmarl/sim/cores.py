"""Cores that every simulated device shares: for a host whose devices are not parallel.

JAX's forced host devices (`--xla_force_host_platform_device_count`) all run on the
machine's CPU cores, so 8 "devices" on 2 busy cores do not run 8 computations at
once. `SharedCores(n)` lets at most n device operations run at a time: an operation
takes the core that frees first, after what its own device has queued (first come,
first served, in dispatch order). n comes from a measurement (calibrate.py's
`contention`: k concurrent batches take contention·k times one batch, so about
1/contention of them run in parallel).
"""

from __future__ import annotations


class SharedCores:

  def __init__(self, count: int):
    if count < 1:
      raise ValueError(f'shared_cores={count}: at least one core runs the devices '
                       '(0 in a setup means devices do not share cores).')
    self.free_at = [0.0] * count

  def reserve(self, earliest: float, seconds: float) -> tuple[float, float]:
    """The interval an operation ready at `earliest` runs in: on the core free first."""
    i = min(range(len(self.free_at)), key=self.free_at.__getitem__)
    start = max(earliest, self.free_at[i])
    self.free_at[i] = start + seconds
    return start, start + seconds


def cores_from_contention(contention: float) -> int:
  """How many device operations run at once, from a measured contention (see above)."""
  if not 0 < contention:
    raise ValueError(f'contention={contention}: it is a positive ratio of times.')
  return max(1, round(1 / contention))
