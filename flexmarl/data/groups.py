"""Groups and the batches cut from them.

A `Group` is a `ServedGroup` with its rewards: the unit GRPO normalizes over. Each
agent's groups arrive in stream order (query, then call) and are cut into global
batches and micro-batches by a `BatchBuilder` (on-policy schedules) or wait across
steps in a `StaleBuffer` (`async:k`). The cut depends only on that order, never on
timing, which is what makes every on-policy schedule give the same parameters.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from flexmarl.data.records import EpisodeResult, ServedGroup
from flexmarl.train import grpo


@dataclasses.dataclass
class Group:
  """A served group with its rewards: the unit GRPO normalizes over."""

  served: ServedGroup
  rewards: np.ndarray
  advantages: np.ndarray  # fixed once the group is complete, before any gradient
  correct: np.ndarray  # 1.0 / 0.0 per sample, NaN where the workflow did not say
  expected: str | None = None  # the right answer to the call, where the workflow said

  @property
  def size(self) -> int:
    return len(self.rewards)


def groups_of(result: EpisodeResult,
              advantages: Mapping[str, Callable[[EpisodeResult, str], list[np.ndarray]]]
              ) -> dict[str, list[Group]]:
  """Per agent (the keys of `advantages`), the groups of one query in call order, with
  the advantages its function (its learner's, `Learner.advantages`: one array per call
  of the agent) gives them."""
  out: dict[str, list[Group]] = {a: [] for a in advantages}
  credited = {a: iter(credit(result, a)) for a, credit in advantages.items()}
  for served in result.served:
    rewards = np.array([result.episode.rewards[s] for s in served.sample_ids], np.float32)
    correct = np.array([float(result.episode.correct[s]) if s in result.episode.correct
                        else np.nan for s in served.sample_ids], np.float32)
    adv = next(credited[served.agent])
    expected = {result.episode.expected[s] for s in served.sample_ids
                if s in result.episode.expected}
    if len(expected) > 1:
      raise ValueError(f'query {served.query_id}, agent {served.agent!r}: the samples of one '
                       f'call were scored with different expected answers {sorted(expected)}; '
                       'give every sample of a call the same expected answer.')
    out[served.agent].append(Group(served, rewards, adv, correct, next(iter(expected), None)))
  return out


def check_fits(group: Group, global_batch: int) -> None:
  """A GRPO group is never split, so it must fit in one global batch."""
  if group.size > global_batch:
    raise ValueError(
        f'agent {group.served.agent!r}: query {group.served.query_id} asked for a group of '
        f'{group.size} samples (generate(n={group.size})), more than its global_batch='
        f'{global_batch}; GRPO groups are never split: raise '
        f'config.agents.{group.served.agent}.global_batch or ask for fewer samples.')


def next_cut(groups: Sequence[Group], start: int, micro_groups: int,
             silent: Callable[[Group], bool] | None) -> int | None:
  """Where the micro-batch that begins at `groups[start]` ends: after its
  `micro_groups`-th group that is not `silent` (silent groups ride along, in order, and
  are counted, not run: `Learner.silent`); None while the groups so far are too few."""
  loud = 0
  for end in range(start, len(groups)):
    loud += silent is None or not silent(groups[end])
    if loud == micro_groups:
      return end + 1
  return None


def cut_micro_batches(groups: Sequence[Group], micro_groups: int,
                      silent: Callable[[Group], bool] | None = None) -> list[list[Group]]:
  """All of `groups` cut into micro-batches (see `next_cut`), the last one the rest."""
  out, start = [], 0
  while start < len(groups):
    end = next_cut(groups, start, micro_groups, silent) or len(groups)
    out.append(list(groups[start:end]))
    start = end
  return out


class BatchBuilder:
  """One agent's global batch at its current version, built group by group.

  Groups arrive in (query, call) order. Until the batch is full (the rows offered
  reach `global_batch`), a group is kept while it fits in `global_batch` rows, else
  counted as surplus; once it is full, every group is surplus. With DAPO's dynamic
  sampling, groups whose rewards are all equal are dropped (`filtered_rows`) and do
  not count towards a full batch, so later queries replace them. Kept groups are cut into
  micro-batches of `micro_groups` groups that are not `silent`, in order: the cut never
  depends on when groups arrived.
  """

  def __init__(self, global_batch: int, micro_groups: int, dynamic_sampling: bool = False,
               silent: Callable[[Group], bool] | None = None):
    self.global_batch, self.micro_groups = global_batch, micro_groups
    self.dynamic_sampling, self.silent = dynamic_sampling, silent
    self.kept: list[Group] = []
    self.kept_rows = self.surplus_rows = self.filtered_rows = 0
    self.cut = 0  # kept groups already handed out in micro-batches

  def add(self, group: Group) -> None:
    check_fits(group, self.global_batch)
    if self.dynamic_sampling and not self.full and grpo.zero_spread(group.rewards):
      self.filtered_rows += group.size  # teaches nothing: a later query takes its place
      return
    if not self.full and self.kept_rows + group.size <= self.global_batch:
      self.kept.append(group)
      self.kept_rows += group.size
    else:
      self.surplus_rows += group.size

  @property
  def full(self) -> bool:
    return self.kept_rows + self.surplus_rows >= self.global_batch

  @property
  def missing(self) -> int:
    """Rows still to be offered before the batch is full."""
    return max(0, self.global_batch - self.kept_rows - self.surplus_rows)

  def micro_batches(self, final: bool = False) -> list[list[Group]]:
    """The micro-batches completed since the last call (with `final`, the remainder too)."""
    out = []
    while self.cut < len(self.kept):
      end = next_cut(self.kept, self.cut, self.micro_groups, self.silent)
      if end is None and not final:
        break
      out.append(self.kept[self.cut:end or len(self.kept)])
      self.cut += len(out[-1])
    return out


class StaleBuffer:
  """One agent's served groups under `async:k`, oldest first.

  The rollout runs ahead of training, so a group may wait across steps. It is trained
  on while its version is at most `max_staleness` behind the parameters it updates;
  once it is older it is dropped (and counted), never trained on.
  """

  def __init__(self, global_batch: int, micro_groups: int, max_staleness: int,
               dynamic_sampling: bool = False, silent: Callable[[Group], bool] | None = None):
    self.global_batch, self.micro_groups = global_batch, micro_groups
    self.max_staleness, self.dynamic_sampling = max_staleness, dynamic_sampling
    self.silent = silent
    self.kept: list[Group] = []
    self.filtered_rows = 0

  def add(self, group: Group) -> None:
    check_fits(group, self.global_batch)
    if self.dynamic_sampling and grpo.zero_spread(group.rewards):
      self.filtered_rows += group.size
      return
    self.kept.append(group)

  def _fresh(self, group: Group, version: int) -> bool:
    return version - group.served.version <= self.max_staleness

  def fresh_rows(self, version: int) -> int:
    """Rows that may still update parameters at `version`."""
    return sum(g.size for g in self.kept if self._fresh(g, version))

  def drop_stale(self, version: int) -> int:
    """Drop the groups too old to update parameters at `version`; returns their rows."""
    before = sum(g.size for g in self.kept)
    self.kept = [g for g in self.kept if self._fresh(g, version)]
    return before - sum(g.size for g in self.kept)

  def take(self) -> list[list[Group]]:
    """The oldest whole groups up to `global_batch` rows, cut into micro-batches."""
    batch, rows = [], 0
    while self.kept and rows + self.kept[0].size <= self.global_batch:
      rows += self.kept[0].size
      batch.append(self.kept.pop(0))
    return cut_micro_batches(batch, self.micro_groups, self.silent)


def batch_stats(groups: Sequence[Group]) -> dict[str, float]:
  """Reward mean/std and exact-match accuracy over the rows of `groups`, and the fraction
  of groups whose rewards are all equal (they teach GRPO nothing)."""
  if not groups:
    return dict(reward_mean=math.nan, reward_std=math.nan, accuracy=math.nan,
                zero_spread=math.nan)
  rewards = np.concatenate([g.rewards for g in groups])
  correct = np.concatenate([g.correct for g in groups])
  known = correct[~np.isnan(correct)]
  return dict(reward_mean=float(rewards.mean()), reward_std=float(rewards.std()),
              accuracy=float(known.mean()) if known.size else math.nan,
              zero_spread=grpo.zero_spread_fraction(g.rewards for g in groups))


class ConstantBaseline:
  """What an agent would score by always giving one answer, from the expected answers of
  its last `calls` calls (each counted once; a workflow gives them with
  `episode.score(..., expected=)`), against what its batch scored.

  The best constant is measured over a window, not one batch: over a batch's few calls
  the likeliest answer's share errs high (the largest of a few noisy shares)."""

  def __init__(self, calls: int = 2000):
    self.calls = calls
    self._recent: dict[str, collections.deque] = {}  # agent -> (call, expected, rows)
    self._seen: dict[str, set] = {}

  def stats(self, agent: str, groups: Sequence[Group]) -> dict[str, float]:
    """Add `groups` to the agent's window, then: `best_constant`, the accuracy of the
    answer right most often in the window; `above_constant`, the batch's accuracy on
    its rows with an expected answer minus it; `balanced_accuracy`, the batch's mean
    over expected answers of the accuracy on their rows (a constant scores 1 / their
    number), and `balanced_above_constant`, it minus that (where the batch has two
    answers or more): the skill of an agent whose answer set is small and skewed, such
    as a yes/no judge that sees mostly right answers. {} while the agent has no expected
    answers."""
    recent = self._recent.setdefault(agent, collections.deque())
    seen = self._seen.setdefault(agent, set())
    scored = [g for g in groups if g.expected is not None]
    for g in scored:
      call = (g.served.query_id, g.served.call)
      if call not in seen:
        recent.append((call, g.expected, g.size))
        seen.add(call)
    while len(recent) > self.calls:
      seen.discard(recent.popleft()[0])
    if not recent:
      return {}
    counts = collections.Counter()
    for _, expected, rows in recent:
      counts[expected] += rows
    best = max(counts.values()) / sum(counts.values())
    by_answer: dict[str, list[np.ndarray]] = collections.defaultdict(list)
    for g in scored:
      by_answer[g.expected].append(g.correct)
    correct = [np.concatenate(c) for c in by_answer.values()]
    known = [c[~np.isnan(c)] for c in correct]
    if not any(k.size for k in known):
      return dict(best_constant=best)
    classes = [k.mean() for k in known if k.size]
    out = dict(best_constant=best, above_constant=float(np.concatenate(known).mean()) - best,
               balanced_accuracy=float(np.mean(classes)))
    if len(classes) > 1:  # a constant is right on one class of answers: 1 / their number
      out['balanced_above_constant'] = out['balanced_accuracy'] - 1.0 / len(classes)
    return out
