"""Learner: one agent's algorithm, and every piece of state it keeps.

The Agent (flexmarl.agent) owns the version, dispatches work to the trainer and publishes
weights. Its Learner decides what is trained:
- `advantages`: the advantages of the agent's groups of each query as it arrives, by the
  credit mode and estimator the config names (`grpo.credit`, `grpo.advantage`,
  train/credit.py): the one place a row's advantage is computed;
- `micro_batch`: a micro-batch's training rows, advantages re-weighted
  (`grpo.baseline_advantages`, `grpo.answer_weights`) and the agent's best answers
  replayed into all-wrong groups (train/replay.py; call groups only);
- `update`: whether a global batch takes an optimizer step and whether the agent goes
  back to its starting weights (`grpo.takes_step`, train/collapse.py).
The decisions are grpo.py's pure functions; the Learner holds the runs, windows and
memories they read, and saves them itself (`state_dict`, `load`: a checkpoint's meta).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from flexmarl.data.groups import Group
from flexmarl.data.records import EpisodeResult
from flexmarl.train import collapse, grpo, replay
from flexmarl.train.credit import CREDITS, EPISODE_CREDITS
from flexmarl.train.spec import GRPOConfig


@dataclasses.dataclass
class Rows:
  """A micro-batch's training rows, one entry per row (groups laid out in order)."""

  prompts: list[list[int]]
  tokens: list[np.ndarray]
  logprobs: list[np.ndarray]  # behaviour logprobs; NaN for a replayed row (the trainer's own)
  advantages: np.ndarray
  on_policy: np.ndarray  # sampled at the version it updates (or replayed)
  entropy_weight: np.ndarray
  silent_rows: int = 0  # of `grpo.silent` groups: in the batch, not run (no gradient)
  silent_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class Plan:
  """What an update does, decided from its global batch."""

  takes_step: bool  # an optimizer step (else the parameters stay, the version advances)
  reset: bool  # back to the starting weights after the step
  stats: dict  # the decision's figures, for the metrics line


def replays_into(cfg: GRPOConfig) -> bool:
  """Whether self-imitation replays answers into all-wrong groups. Not under episode
  credit: a turn is a group of one there, and replaying an answer into it (keyed by the
  call's expected answer) would train one problem's turn under another's."""
  return cfg.self_imitation > 0 and cfg.credit not in EPISODE_CREDITS


def silent_groups(cfg: GRPOConfig) -> Callable[[Group], bool]:
  """The agent's `grpo.silent` test of a group: its micro-batches are cut from the other
  groups (data.groups.BatchBuilder), and its rows are counted in the batch, not run."""
  replays = replays_into(cfg)
  return lambda g: grpo.silent(cfg, g.advantages, g.correct, replays)


class Learner:
  """One agent's GRPO: advantages, micro-batch rows, step and reset decisions."""

  def __init__(self, cfg: GRPOConfig, global_batch: int):
    self.cfg = cfg
    self._credit = CREDITS[cfg.credit]
    self._replays = replays_into(cfg)
    self.silent = silent_groups(cfg)
    self.stuck_run = 0  # the last batches in a row that were `grpo.stuck` ...
    self.collapse_run = 0  # ... and `collapse.collapsed`
    self.resets = 0  # times reset to the starting weights (`collapse.resets_now`)
    # The right answers of its last calls, which `grpo.answer_weights` balances.
    self.answers: collections.deque = collections.deque(maxlen=grpo.ANSWER_WINDOW)
    # The rewards of its last batch, whose mean `grpo.baseline_advantages` takes.
    self.rewards: collections.deque = collections.deque(maxlen=global_batch)
    # Its best answer so far per expected answer, which `replay.replays` replays: kept up
    # to date micro-batch by micro-batch, and as of its last update (what a checkpoint
    # holds: a resumed run accumulates the next batch's micro-batches again from it) ...
    self.best_answers: collections.OrderedDict = collections.OrderedDict()
    self._best_at_update: collections.OrderedDict = collections.OrderedDict()
    self._replayed = 0  # ... and the rows replayed into the batch being accumulated

  def advantages(self, result: EpisodeResult, agent: str) -> list[np.ndarray]:
    """The advantages of `agent`'s groups in one query's result (one array per call, in
    call order), by the agent's credit mode: fixed before any gradient is taken."""
    return self._credit(result, agent, self.cfg)

  def _key(self, group: Group) -> str | None:
    """What the group's best answer is kept and replayed under (`self_imitation_key`):
    its expected answer, or that and its prompt."""
    if group.expected is None or self.cfg.self_imitation_key == 'answer':
      return group.expected
    return replay.prompt_key(group.expected, group.served.prompt_ids)

  def micro_batch(self, micro: Sequence[Group], version: int) -> Rows:
    """The training rows of one micro-batch, for parameters at `version`: those of its
    groups that are not `silent` (theirs are counted only)."""
    cfg = self.cfg
    if self._replays:  # every group, silent or not, in stream order
      for g in micro:
        replay.remember_best(self.best_answers, self._key(g), g.rewards, g.correct,
                             g.served.tokens)
    quiet = [g for g in micro if self.silent(g)]
    micro = [g for g in micro if not self.silent(g)]
    silent_rows = sum(g.size for g in quiet)
    silent_tokens = sum(len(t) for g in quiet for t in g.served.tokens)
    if not micro:
      empty = np.zeros(0, np.float32)
      return Rows([], [], [], empty, np.zeros(0, bool), empty, silent_rows, silent_tokens)
    advantages = grpo.baseline_advantages(cfg, [g.advantages for g in micro],
                                          [g.rewards for g in micro], self.rewards)
    weights = grpo.answer_weights(cfg, collections.Counter(self.answers),
                                  [g.expected for g in micro])
    tokens = [list(g.served.tokens) for g in micro]
    logprobs = [list(g.served.logprobs) for g in micro]
    advantages = [a * w for a, w in zip(advantages, weights)]
    on_policy = np.array([g.served.version == version for g in micro for _ in range(g.size)])
    # A replayed answer takes the place of its group's last sample, which is wrong like
    # the rest of its group (GRPO gives it no advantage, only the entropy bonus), and
    # keeps that row's entropy weight: on the same prompt, the policy's entropy at the
    # answer's first token is the replaced row's. The batch keeps its rows and shape: no
    # micro-batch grows past its padded size or compiles a new step.
    end = np.cumsum([g.size for g in micro]) - 1
    replays = replay.replays(cfg, [self._key(g) for g in micro], [g.rewards for g in micro],
                             [g.correct for g in micro], self.best_answers
                             ) if self._replays else []
    for i, t in enumerate(replays):
      if t is None:
        continue
      self._replayed += 1
      # Not served: NaN logprobs, which the loss reads as the trainer's own (ratio 1).
      tokens[i][-1], logprobs[i][-1] = t, np.full(len(t), np.nan, np.float32)
      advantages[i] = np.concatenate([advantages[i][:-1], [cfg.self_imitation]])
      on_policy[end[i]] = True
    return Rows([g.served.prompt_ids for g in micro for _ in range(g.size)],
                [t for group in tokens for t in group], [lp for group in logprobs for lp in group],
                np.concatenate(advantages).astype(np.float32), on_policy,
                grpo.entropy_weights(cfg, [g.correct for g in micro]), silent_rows,
                silent_tokens)

  def update(self, batch: Sequence[Group]) -> Plan:
    """Decide an update from its global batch (every micro-batch of it given to
    `micro_batch` already), and move the state on past it.

    A batch without advantage signal, and without rows replayed into it, takes no
    optimizer step (`grpo.takes_step`); an agent `collapse.collapsed` onto one answer
    (`collapse.collapsed_blind` where the workflow names no right answer) for
    `collapse_after` batches is reset to its starting weights after the step
    (`collapse.resets_now`)."""
    cfg = self.cfg
    advantages = [g.advantages for g in batch]
    stuck = grpo.stuck(cfg, advantages, [g.correct for g in batch])
    self.stuck_run = self.stuck_run + 1 if stuck else 0
    if any(g.expected is not None for g in batch):
      collapsed = collapse.collapsed(cfg, [t for g in batch for t in g.served.tokens],
                                 [g.expected for g in batch for _ in range(g.size)],
                                 [c for g in batch for c in g.correct])
    else:  # the workflow named no right answer: what the batch itself shows
      collapsed = collapse.collapsed_blind(cfg, [g.served.tokens for g in batch],
                                       [g.rewards for g in batch], [g.correct for g in batch])
    self.collapse_run = self.collapse_run + 1 if collapsed else 0
    replayed, self._replayed = self._replayed, 0
    takes_step = replayed > 0 or grpo.takes_step(cfg, advantages, self.stuck_run)
    stats = dict(stuck_run=self.stuck_run, collapse_run=self.collapse_run,
                 replayed=replayed / max(1, sum(g.size for g in batch)))  # a share of rows
    if cfg.balance_answers:
      self.answers.extend(g.expected for g in batch if g.expected is not None)
    self._best_at_update = self.best_answers.copy()
    if cfg.zero_spread_baseline:
      self.rewards.extend(float(r) for g in batch for r in g.rewards)
    reset = collapse.resets_now(cfg, self.collapse_run, self.resets)
    if reset:
      self.collapse_run, self.resets = 0, self.resets + 1
    return Plan(takes_step, reset, dict(stats, collapse_reset=int(reset), resets=self.resets))

  def state_dict(self) -> dict:
    """What a checkpoint's meta keeps of the learner: as of its last update."""
    return dict(stuck_run=self.stuck_run, collapse_run=self.collapse_run, resets=self.resets,
                answers=list(self.answers), rewards=list(self.rewards),
                best_answers=[[e, b.tokens.tolist(), b.reward, b.right]
                              for e, b in self._best_at_update.items()])

  def load(self, meta: dict) -> None:
    """Take the state `state_dict` gave (a checkpoint's meta; older ones too)."""
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
