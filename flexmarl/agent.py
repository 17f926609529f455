"""Agent: one agent's trainer, rollout instances and checkpointer. It owns the agent's
version and is the one place that publishes its weights.

An update (`update`) dispatches the optimizer step and makes the agent's version the
next one at once; the new weights are held as one `Weights` record until `publish`
sends them to the agent's instances (a `WeightSink`), so a schedule decides when the
rollout starts serving them. Teams are wired in `flexmarl.build`.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import jax
import numpy as np

from flexmarl.clock import Clock, RealClock
from flexmarl.config import AgentSpec
from flexmarl.data.groups import Group
from flexmarl.interfaces import Checkpointer, Stats, Trainer, Weights
from flexmarl.metrics import spans
from flexmarl.metrics.timeline import Timeline
from flexmarl.models.layout import PROMPT_WIDTH_MULTIPLE
from flexmarl.rollout.pool import InstancePool
from flexmarl.train import grpo, replay
from flexmarl.train.engine import TrainingEngine
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
    self.stuck_run = 0  # the last batches in a row that were `grpo.stuck` ...
    self.collapse_run = 0  # ... and `grpo.collapsed`
    self.resets = 0  # times reset to its starting weights (`grpo.resets_now`)
    # The right answers of its last calls, which `grpo.answer_weights` balances.
    self.answers: collections.deque = collections.deque(maxlen=grpo.ANSWER_WINDOW)
    # The rewards of its last batch, whose mean `grpo.baseline_advantages` takes.
    self.rewards: collections.deque = collections.deque(maxlen=spec.global_batch)
    self._unpublished: Weights | None = None  # the last update's, until published
    self._checked = False  # served logprobs compared with the trainer's (first update)
    # Its best answer so far per expected answer, which `replay.replays` replays: kept up
    # to date micro-batch by micro-batch, and as of its last update (what a checkpoint
    # holds: a resumed run accumulates the next batch's micro-batches again from it) ...
    self.best_answers: collections.OrderedDict = collections.OrderedDict()
    self._best_at_update: collections.OrderedDict = collections.OrderedDict()
    self._replayed = 0  # ... and the rows replayed into the batch being accumulated

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
    the runs of batches its GRPO options count."""
    return dict(version=self.version, stuck_run=self.stuck_run,
                collapse_run=self.collapse_run, resets=self.resets,
                answers=list(self.answers), rewards=list(self.rewards),
                best_answers=[[e, b.tokens.tolist(), b.reward, b.right]
                              for e, b in self._best_at_update.items()])

  def restore(self, train_state: dict, meta: dict) -> None:
    """Take a checkpoint's state and `counters` (its meta) and serve it."""
    if self.training_engine is not None:
      self.training_engine.wait(self.name)  # a copy in flight would overwrite it
    self.trainer.load_train_state(train_state)
    self.version = meta['version']
    self.stuck_run, self.collapse_run = meta.get('stuck_run', 0), meta.get('collapse_run', 0)
    self.resets = meta.get('resets', 0)
    self.answers.clear()
    self.answers.extend(meta.get('answers', []))
    self.rewards.clear()
    self.rewards.extend(meta.get('rewards', []))
    # A checkpoint written before wrong answers were kept holds right ones only.
    kept = meta.get('best_answers') or [[e, t, 1.0, True] for e, t in
                                        meta.get('right_answers', [])]
    self.best_answers = collections.OrderedDict(
        (e, replay.Best(np.asarray(t, np.int32), reward, right)) for e, t, reward, right in kept)
    self._best_at_update = self.best_answers.copy()
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
    """Add one micro-batch's gradient to the trainer's accumulator (dispatched, not
    awaited: it runs on the training devices while the caller goes on)."""
    cfg = self.spec.grpo
    advantages = grpo.baseline_advantages(cfg, [g.advantages for g in micro],
                                          [g.rewards for g in micro], self.rewards)
    weights = grpo.answer_weights(cfg, collections.Counter(self.answers),
                                  [g.expected for g in micro])
    if cfg.self_imitation:
      for g in micro:
        replay.remember_best(self.best_answers, g.expected, g.rewards, g.correct,
                             g.served.tokens)
    tokens = [list(g.served.tokens) for g in micro]
    logprobs = [list(g.served.logprobs) for g in micro]
    advantages = [a * w for a, w in zip(advantages, weights)]
    entropy_weights = grpo.entropy_weights(cfg, [g.correct for g in micro])
    on_policy = np.array([g.served.version == self.version for g in micro
                          for _ in range(g.size)])
    # A replayed answer takes the place of its group's last sample, which is wrong like
    # the rest of its group (GRPO gives it no advantage, only the entropy bonus), and
    # keeps that row's entropy weight: on the same prompt, the policy's entropy at the
    # answer's first token is the replaced row's. The batch keeps its rows and shape: no
    # micro-batch grows past its padded size or compiles a new step.
    end = np.cumsum([g.size for g in micro]) - 1
    for i, t in enumerate(replay.replays(cfg, [g.expected for g in micro],
                                         [g.rewards for g in micro], [g.correct for g in micro],
                                         self.best_answers)):
      if t is None:
        continue
      self._replayed += 1
      # Not served: NaN logprobs, which the loss reads as the trainer's own (ratio 1).
      tokens[i][-1], logprobs[i][-1] = t, np.full(len(t), np.nan, np.float32)
      advantages[i] = np.concatenate([advantages[i][:-1], [cfg.self_imitation]])
      on_policy[end[i]] = True
    batch = TrainBatch.from_rows(
        [g.served.prompt_ids for g in micro for _ in range(g.size)],
        [t for group in tokens for t in group], [lp for group in logprobs for lp in group],
        np.concatenate(advantages).astype(np.float32),
        prompt_len=self.prompt_len, prompt_width_multiple=self.prompt_width_multiple,
        response_len=self.spec.sampling.max_new_tokens,
        pad_id=self.pad_id, batch_multiple=self.trainer.batch_multiple,
        on_policy=on_policy, entropy_weight=entropy_weights)
    version = self.version

    def work() -> None:
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
    it updates) is measured here, where the update happens. A batch without advantage
    signal, and without rows replayed into it (`replay.replays`; their share in `replayed`),
    takes no optimizer step (`grpo.takes_step`); an agent `grpo.collapsed` onto
    one answer for `collapse_after` batches is reset to its starting weights after the
    step (`grpo.resets_now`), and those are what it publishes."""
    t0 = self.clock.now()
    lags = np.array([self.version - g.served.version for g in batch for _ in range(g.size)])
    for micro in micro_batches:
      self.accumulate(micro)
    version = self.version
    dispatched = []
    advantages = [g.advantages for g in batch]
    cfg = self.spec.grpo
    stuck = grpo.stuck(cfg, advantages, [g.correct for g in batch])
    self.stuck_run = self.stuck_run + 1 if stuck else 0
    collapsed = grpo.collapsed(cfg, [t for g in batch for t in g.served.tokens],
                               [g.expected for g in batch for _ in range(g.size)],
                               [c for g in batch for c in g.correct])
    self.collapse_run = self.collapse_run + 1 if collapsed else 0
    replayed, self._replayed = self._replayed, 0
    takes_step = replayed > 0 or grpo.takes_step(cfg, advantages, self.stuck_run)
    stuck_run, collapse_run = self.stuck_run, self.collapse_run
    if cfg.balance_answers:
      self.answers.extend(g.expected for g in batch if g.expected is not None)
    self._best_at_update = self.best_answers.copy()
    if cfg.zero_spread_baseline:
      self.rewards.extend(float(r) for g in batch for r in g.rewards)
    reset = grpo.resets_now(cfg, self.collapse_run, self.resets)
    if reset:
      self.collapse_run, self.resets = 0, self.resets + 1
    resets = self.resets

    def step() -> None:
      dispatched.append(self.trainer.dispatch_apply(takes_step))
      if reset:
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
                   stuck_run=stuck_run, collapse_run=collapse_run,
                   collapse_reset=int(reset), resets=resets, replayed=replayed / len(lags))
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
