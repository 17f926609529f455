"""Agent: one agent's trainer, rollout instances and checkpointer. It owns the agent's
version and is the one place that publishes its weights.

An update (`update`) dispatches the optimizer step and makes the agent's version the
next one at once; the new weights are held as one `Weights` record until `publish`
sends them to the agent's instances (a `WeightSink`), so a schedule decides when the
rollout starts serving them. Teams are wired in `flexmarl.build`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np

from flexmarl.config import AgentSpec
from flexmarl.core.clock import Clock, RealClock
from flexmarl.core.interfaces import Checkpointer, Stats, Trainer, Weights
from flexmarl.data.groups import Group
from flexmarl.metrics import spans
from flexmarl.metrics.timeline import Timeline
from flexmarl.models.layout import PROMPT_WIDTH_MULTIPLE
from flexmarl.rollout.pool import InstancePool
from flexmarl.train.engine import TrainingEngine
from flexmarl.train.learner import Learner
from flexmarl.train.trainer import TrainBatch

# Mean |π_train/π_served − 1| over an on-policy batch's tokens above which the trainer
# and the sampler disagree on the prompt or the tokens (float32 agrees to ~1e-6; bf16
# sampling kernels to ~1e-2).
SERVED_LOGPROB_TOLERANCE = 0.05


def check_served_logprobs(agent: str, version: int, ratio_dev: float) -> None:
  """Raise if the trainer's logprobs of served tokens are not the sampler's: the update
  would then train a policy other than the one that answered."""
  if not ratio_dev <= SERVED_LOGPROB_TOLERANCE:
    raise RuntimeError(
        f'agent {agent!r}, update of version {version}: the trainer\'s logprobs of the '
        f'served tokens differ from the sampler\'s (mean |ratio - 1| = {ratio_dev:.3g}, '
        f'tolerance {SERVED_LOGPROB_TOLERANCE}) although every row is on-policy. The two '
        'disagree on the prompt, the tokens or the distribution: check that the rollout '
        'backend serves this agent\'s weights and tokenizer (special tokens, BOS) and the '
        'same temperature; this update was not saved.')


class Agent:

  def __init__(self, spec: AgentSpec, trainer: Trainer, pool: InstancePool,
               checkpointer: Checkpointer, *, prompt_len: int, pad_id: int,
               prompt_width_multiple: int = PROMPT_WIDTH_MULTIPLE,
               clock: Clock | None = None, recorder: spans.SpanRecorder | None = None,
               timeline: Timeline | None = None, training_engine: TrainingEngine | None = None):
    """`clock` times the steps (`train_s`); `recorder` gets weight-sync spans and
    `timeline` the spans of the training devices (a simulated team records its own).
    `training_engine`: the training pool's, which binds the trainer to a mesh for each piece of
    work; None: the trainer stays on its own mesh."""
    self.spec, self.trainer, self.pool, self.checkpointer = spec, trainer, pool, checkpointer
    self.prompt_len, self.pad_id = prompt_len, pad_id
    self.prompt_width_multiple = prompt_width_multiple
    self.training_engine = training_engine
    self.clock = clock or RealClock()
    self.recorder, self.timeline = recorder, timeline
    self.version = 0  # updates so far: the version of the trainer's parameters
    self.learner = Learner(spec.grpo, spec.global_batch)  # the algorithm and its state
    self._unpublished: Weights | None = None  # the last update's, until published
    self._checked = False  # served logprobs compared with the trainer's (first update)

  @property
  def name(self) -> str:
    return self.spec.name

  def publish(self) -> None:
    """Send the last update's weights to every rollout instance of the agent (a no-op
    when they serve them already)."""
    weights, self._unpublished = self._unpublished, None
    if weights is None:
      return
    start = self.clock.now()
    self.pool.publish(weights)
    end = self.clock.now()
    if self.recorder is None:
      return
    nbytes = sum(x.nbytes for x in jax.tree.leaves(weights.params))
    for inst in self.pool.instances:
      self.recorder.add(f'rollout:{inst.name}', spans.WEIGHT_SYNC, start, end, agent=self.name,
                        version=weights.version, bytes=nbytes)

  def train_state(self) -> dict:
    """The trainer's state for a checkpoint, once no copy of it is in flight (a training
    pool moves states on threads of its own)."""
    if self.training_engine is not None:
      self.training_engine.wait(self.name)
    return self.trainer.train_state()

  def counters(self) -> dict:
    """What a checkpoint's meta keeps of the agent besides its state: its version and
    its learner's state."""
    return dict(version=self.version, **self.learner.state_dict())

  def restore(self, train_state: dict, meta: dict) -> None:
    """Take a checkpoint's state and `counters` (its meta) and serve it."""
    if self.training_engine is not None:
      self.training_engine.wait(self.name)  # a copy in flight would overwrite it
    self.trainer.load_train_state(train_state)
    self.version = meta['version']
    self.learner.load(meta)
    self._unpublished = Weights(self.trainer.params, self.version)
    self.publish()

  def _train(self, work: Callable[[], None], urgent: bool = True) -> None:
    """Run `work` on the trainer: at once, or through the pool's engine (which, unless
    `urgent`, may leave it queued rather than move another agent's state out)."""
    if self.training_engine is None:
      work()
    else:
      self.training_engine.submit(self.name, work)
      self.training_engine.run((self.name,) if urgent else ())

  def expect_training(self) -> None:
    """The agent's batch starts filling (a step's rollout has begun): on a training
    pool its state starts moving toward the mesh it will train on."""
    if self.training_engine is not None:
      self.training_engine.expect(self.name)

  def swap_stats(self) -> dict:
    """Where the agent trained since the last call and its swap costs ({} without a pool)."""
    return {} if self.training_engine is None else self.training_engine.step_stats(self.name)

  def accumulate(self, micro: Sequence[Group]) -> None:
    """Add one micro-batch's gradient (its rows as the learner makes them) to the
    trainer's accumulator (dispatched, not awaited: it runs on the training devices
    while the caller goes on)."""
    rows = self.learner.micro_batch(micro, self.version)
    batch = None
    if rows.prompts:
      # Padded to the rows of the whole micro-batch (at most `micro_batch`), silent
      # groups' included: one cut short by them mostly runs in a shape a full one
      # compiled (padding every short one costs more compute than the compiles saved).
      batch = TrainBatch.from_rows(
          rows.prompts, rows.tokens, rows.logprobs, rows.advantages,
          prompt_len=self.prompt_len, prompt_width_multiple=self.prompt_width_multiple,
          response_len=self.spec.sampling.max_new_tokens,
          pad_id=self.pad_id, batch_multiple=self.trainer.batch_multiple,
          on_policy=rows.on_policy, entropy_weight=rows.entropy_weight,
          min_rows=min(self.spec.micro_batch, sum(g.size for g in micro)))
    version = self.version

    def work() -> None:
      if rows.silent_rows:
        self.trainer.count_silent(rows.silent_tokens, rows.silent_rows)
      if batch is None:
        return
      stats = self.trainer.accumulate(batch, version)
      if self.timeline is not None:
        self.timeline.add(spans.MICRO_BATCH, stats, agent=self.name, version=version,
                          tokens=batch.tokens)
    # On a training pool a micro-batch waits for a mesh that holds no state; the
    # optimizer step (`update`) then binds the agent and runs all its queued work.
    self._train(work, urgent=False)

  def update(self, batch: Sequence[Group], micro_batches: Sequence[Sequence[Group]]
             ) -> Callable[[], Stats]:
    """Accumulate `micro_batches` (those of `batch` not yet accumulated) and dispatch the
    optimizer step without waiting. The agent is at the next version at once; its
    weights wait for `publish`. Returns a function that waits and gives the stats.

    Each row's staleness (versions between the one that sampled it and the parameters
    it updates) is measured here, where the update happens; whether the update steps
    and whether it resets the agent to its starting weights (then what it publishes)
    is the learner's decision (`Learner.update`)."""
    t0 = self.clock.now()
    lags = np.array([self.version - g.served.version for g in batch for _ in range(g.size)])
    for micro in micro_batches:
      self.accumulate(micro)
    version = self.version
    dispatched = []
    plan = self.learner.update(batch)

    def step() -> None:
      dispatched.append(self.trainer.dispatch_apply(plan.takes_step))
      if plan.reset:
        self.trainer.reset()
      # Taken here, before a training pool could swap the state out.
      self._unpublished = Weights(self.trainer.params, version + 1)
      if self.timeline is not None:
        self.timeline.add(spans.OPTIMIZER_STEP, self.trainer.params, agent=self.name,
                          version=version)
    self._train(step)
    self.version = version + 1
    result, = dispatched

    def finish() -> Stats:
      stats = dict(result(), train_s=self.clock.now() - t0, rows=len(lags),
                   staleness_max=int(lags.max()), staleness_mean=float(lags.mean()),
                   **plan.stats)
      if not self._checked and stats['staleness_max'] == 0 and 'ratio_dev' in stats:
        check_served_logprobs(self.name, version, stats['ratio_dev'])
        self._checked = True
      return stats
    return finish

  def close(self) -> None:
    self.checkpointer.wait()
    if self.timeline is not None:
      self.timeline.close()
    if self.training_engine is not None:
      self.training_engine.close()
    for inst in self.pool.instances:
      inst.sampler.close()
