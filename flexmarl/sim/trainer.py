"""A simulated trainer: what `team.Agent` uses of `AgentTrainer`, answered in simulated time.

Each operation (a micro-batch's forward/backward, an optimizer step) occupies the
device group the trainer is on for a cost-model duration. Operations on one group run
in the order they were dispatched: an operation starts at max(dispatch time, end of the
previous one). Dispatching never moves the clock (as JAX's async dispatch never blocks
the caller); waiting for a step's result advances the clock to the step's end, as a
real `device_get` blocks until the devices are done.

A trainer has a group of its own, or is moved between the meshes of a simulated
training pool (`sim.pool`, which charges the swaps). A colocated trainer (rollout and
training on the same devices, as hybrid engines do) loads its train state onto the
devices before the first micro-batch of an update (`load_s`) and offloads it after the
optimizer step (`offload_s`), so the rollout gets the memory back.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import numpy as np

from flexmarl.clock import SimClock
from flexmarl.metrics import spans
from flexmarl.sim.devices import COMPILE, CompileCache, DeviceGroup
from flexmarl.train.trainer import TrainBatch


class SimTrainer:
  """One agent's trainer.

  token_s: seconds of forward + backward per token (prompt and response tokens both
  run through the model; e.g. `costs.train_time(model, 1, devices, accel)`).
  optimizer_s: seconds of one optimizer step (`costs.optimizer_time`).
  micro_batch_s: seconds per micro-batch whatever its size (launch; calibrated).
  padded: charge every token slot of the padded micro-batch (as the JAX trainer computes
  it: power-of-two rows, widths rounded up), not only the real tokens.
  group: the device group it runs on (`DeviceGroup`); None in a pool, which binds it.
  load_s / offload_s: a colocated trainer's phase changes (see the module doc); 0: none.
  compile: the team's `CompileCache` and this trainer's key in it (model and mesh shape).
  """

  batch_multiple = 1

  def __init__(self, name: str, clock: SimClock, token_s: float, optimizer_s: float, *,
               group: DeviceGroup | None, micro_batch_s: float = 0.0, padded: bool = False,
               load_s: float = 0.0, offload_s: float = 0.0,
               compile: tuple[CompileCache, Hashable] | None = None):
    if min(token_s, optimizer_s, micro_batch_s, load_s, offload_s) < 0:
      raise ValueError(f'SimTrainer {name!r}: token_s={token_s}, optimizer_s={optimizer_s}, '
                       f'micro_batch_s={micro_batch_s}, load_s={load_s}, offload_s={offload_s};'
                       ' durations are seconds and must be >= 0.')
    self.name, self.clock, self.group = name, clock, group
    self.token_s, self.optimizer_s, self.micro_batch_s = token_s, optimizer_s, micro_batch_s
    self.padded, self.load_s, self.offload_s, self.compile = padded, load_s, offload_s, compile
    self.params = {'version': np.zeros((), np.int32)}  # placeholder: no weights are simulated
    self._update = 0  # the agent's updates before the one being accumulated
    self._tokens = 0  # tokens accumulated since the last optimizer step
    self._micro_batches = 0

  def _run(self, name: str, seconds: float, **args) -> float:
    return self.group.run(name, seconds, agent=self.name, version=self._update, **args)

  def accumulate(self, batch: TrainBatch, update: int = 0) -> None:
    """Queue one micro-batch's forward/backward over its real tokens (its padded token
    slots with `padded`); the first of an update loads a colocated train state."""
    self._update = update
    if self._micro_batches == 0 and self.load_s:
      self._run(spans.SWAP_IN, self.load_s)
    if self.compile is not None:
      cache, key = self.compile
      if seconds := cache.cost(key):
        self._run(COMPILE, seconds)
    tokens = int(batch.prompt_mask.sum()) + batch.tokens
    charged = batch.prompts.size + batch.responses.size if self.padded else tokens
    self._run(spans.MICRO_BATCH, self.micro_batch_s + charged * self.token_s, tokens=tokens)
    self._tokens += tokens
    self._micro_batches += 1

  def dispatch_apply(self) -> Callable[[], dict[str, float]]:
    """Queue the optimizer step (and a colocated state's offload). The returned function advances the clock to the step's end and gives
    its stats."""
    if self._tokens == 0:
      raise RuntimeError(f'agent {self.name!r}: optimizer step with no accumulated tokens.')
    end = self._run(spans.OPTIMIZER_STEP, self.optimizer_s)
    if self.offload_s:
      end = self._run(spans.SWAP_OUT, self.offload_s)
    stats = dict(trained_tokens=self._tokens, micro_batches=self._micro_batches)
    self._tokens = self._micro_batches = 0

    def result() -> dict[str, float]:
      if self.clock.now() < end:
        self.clock.advance_to(end)
      return stats
    return result
