"""A simulated trainer: what `team.Agent` uses of `AgentTrainer`, answered in simulated time.

Each operation (a micro-batch's forward/backward, an optimizer step) occupies the
agent's training device group for a cost-model duration. Operations on one group run
in the order they were dispatched: an operation starts at max(dispatch time, end of the
previous one). Dispatching never moves the clock (as JAX's async dispatch never blocks
the caller); waiting for a step's result advances the clock to the step's end, as a
real `device_get` blocks until the devices are done.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from flexmarl.clock import SimClock
from flexmarl.metrics import spans
from flexmarl.sim.cores import SharedCores
from flexmarl.train.trainer import TrainBatch


class SimTrainer:
  """One agent's training device group.

  token_s: seconds of forward + backward per token (prompt and response tokens both
  run through the model; e.g. `costs.train_time(model, 1, devices, accel)`).
  optimizer_s: seconds of one optimizer step (`costs.optimizer_time`).
  micro_batch_s: seconds per micro-batch whatever its size (launch; calibrated).
  padded: charge every token slot of the padded micro-batch (as the JAX trainer computes
  it: power-of-two rows, widths rounded up), not only the real tokens.
  cores: a `SharedCores` the group's work also waits for (devices on shared cores).
  recorder: anything with SpanRecorder's `add` (spans on `track`), or None.
  """

  batch_multiple = 1

  def __init__(self, name: str, clock: SimClock, token_s: float, optimizer_s: float, *,
               micro_batch_s: float = 0.0, padded: bool = False,
               cores: SharedCores | None = None, recorder=None, track: str = ''):
    if min(token_s, optimizer_s, micro_batch_s) < 0:
      raise ValueError(f'SimTrainer {name!r}: token_s={token_s}, optimizer_s={optimizer_s}, '
                       f'micro_batch_s={micro_batch_s}; durations are seconds and must be >= 0.')
    self.name, self.clock = name, clock
    self.token_s, self.optimizer_s, self.micro_batch_s = token_s, optimizer_s, micro_batch_s
    self.padded, self.cores = padded, cores
    self.recorder, self.track = recorder, track or f'train:{name}'
    self.params = {'version': np.zeros((), np.int32)}  # placeholder: no weights are simulated
    self.busy_until = clock.now()
    self._version = 0
    self._tokens = 0  # tokens accumulated since the last optimizer step
    self._micro_batches = 0

  @property
  def version(self) -> int:
    return self._version

  def _run(self, name: str, seconds: float, **args) -> float:
    """Reserve the device group for `seconds` after what is queued; the end time."""
    start = max(self.clock.now(), self.busy_until)
    if self.cores is not None:
      start, _ = self.cores.reserve(start, seconds)
    self.busy_until = start + seconds
    if self.recorder is not None:
      self.recorder.add(self.track, name, start, self.busy_until, agent=self.name,
                        version=self._version, **args)
    return self.busy_until

  def accumulate(self, batch: TrainBatch) -> None:
    """Queue one micro-batch's forward/backward over its real tokens (its padded token
    slots with `padded`)."""
    tokens = int(batch.prompt_mask.sum()) + batch.tokens
    charged = batch.prompts.size + batch.responses.size if self.padded else tokens
    self._run(spans.MICRO_BATCH, self.micro_batch_s + charged * self.token_s, tokens=tokens)
    self._tokens += tokens
    self._micro_batches += 1

  def dispatch_apply(self) -> Callable[[], dict[str, float]]:
    """Queue the optimizer step; `version` is the new one at once. The returned
    function advances the clock to the step's end and gives its stats."""
    if self._tokens == 0:
      raise RuntimeError(f'agent {self.name!r}: optimizer step with no accumulated tokens.')
    end = self._run(spans.OPTIMIZER_STEP, self.optimizer_s)
    stats = dict(trained_tokens=self._tokens, micro_batches=self._micro_batches)
    self._version += 1
    self._tokens = self._micro_batches = 0

    def result() -> dict[str, float]:
      if self.clock.now() < end:
        self.clock.advance_to(end)
      return stats
    return result
