"""Collapse onto one answer: told from a batch, and undone by a reset.

A policy collapsed onto one answer (a planner giving one plan to every query, a judge one
verdict) never samples the others, so no reward can rank them, and neither its
advantages nor its error rate say so. `collapsed` (with the workflow's expected answers)
and `collapsed_blind` (without them) tell it from one global batch; after
`collapse_after` such batches in a row the agent's Learner resets it to its starting
weights (`resets_now`). Pure functions of a batch and the agent's counts.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np

from flexmarl.train.grpo import zero_spread
from flexmarl.train.spec import GRPOConfig


def mode_share(responses: Sequence[np.ndarray]) -> float:
  """The share of the responses (token ids) that equal the most common one; NaN for none."""
  counts = collections.Counter(tuple(np.asarray(r).tolist()) for r in responses)
  return max(counts.values()) / len(responses) if responses else float('nan')


def collapsed(cfg: GRPOConfig, responses: Sequence[np.ndarray],
              expected: Sequence[str | None], correct: Sequence[float]) -> bool:
  """Whether a global batch shows a policy collapsed onto one answer: at least
  `collapse_share` of its sampled responses are one and the same, fewer than that share
  of its rows have one and the same right answer (`expected`, per row; rows without one
  are not counted, and a batch without any is never collapsed), and that response is
  given on at least `collapse_share` of the rows where it is wrong (those whose right
  answer is not one it was right on, per `correct`, 1.0 / 0.0 / NaN).

  This is what neither the advantages nor the error rate tell: a planner that gives
  one plan to every query and scores what that plan scores (0.5, say) still has groups
  whose rewards differ (other agents' noise), and a yes/no judge that always says
  "y" is right more often than not; both are stuck on a constant all the same. The last
  condition tells a constant from a fair judge that says "y" to 92% of a batch whose
  claims are 85% right (measured: such a judge, learning, was reset by the first two)."""
  known = [e for e in expected if e is not None]
  if not cfg.collapse_after or not known:
    return False
  right = collections.Counter(known).most_common(1)[0][1] / len(known)
  if not mode_share(responses) >= cfg.collapse_share > right:
    return False
  answers = [tuple(np.asarray(r).tolist()) for r in responses]
  mode = collections.Counter(answers).most_common(1)[0][0]
  right_on = {e for a, e, c in zip(answers, expected, correct) if a == mode and c == 1.0}
  wrong_rows = [a == mode for a, e in zip(answers, expected)
                if e is not None and e not in right_on]
  return bool(wrong_rows) and float(np.mean(wrong_rows)) >= cfg.collapse_share


def collapsed_blind(cfg: GRPOConfig, responses: Sequence[Sequence[np.ndarray]],
                    rewards: Sequence[np.ndarray], correct: Sequence[np.ndarray]) -> bool:
  """`collapsed` for a batch without expected answers (per group: its responses, rewards
  and correctness, 1.0 / 0.0 / NaN): at least `collapse_share` of its sampled responses
  are one and the same, every group's rewards agree (no advantage signal), and that
  response either scored differently on different prompts (the right answer depends on
  the prompt; the agent's does not) or was wrong wherever the workflow said.

  Why: a workflow need not name the right answer, and then `collapsed` sees nothing: a
  planner settled on one invalid plan (reward 0.125, accuracy 0, for 1,000+ updates), a
  judge on one verdict. Their batches show it all the same. What it cannot tell apart is
  a constant from a confident judge that gives one verdict to `collapse_share` of its
  prompts; give `expected=` where the workflow knows it."""
  flat = [r for group in responses for r in group]
  if not cfg.collapse_after or not flat or not mode_share(flat) >= cfg.collapse_share:
    return False
  if not all(zero_spread(r) for r in rewards):
    return False
  answers = [[tuple(np.asarray(t).tolist()) for t in group] for group in responses]
  mode = collections.Counter(a for group in answers for a in group).most_common(1)[0][0]
  scored = {float(r) for group, rs in zip(answers, rewards) for a, r in zip(group, rs)
            if a == mode}
  verdicts = np.array([c for group, cs in zip(answers, correct) for a, c in zip(group, cs)
                       if a == mode], np.float64)
  verdicts = verdicts[~np.isnan(verdicts)]
  return len(scored) > 1 or (verdicts.size > 0 and not verdicts.any())


def resets_now(cfg: GRPOConfig, collapse_run: int, resets: int) -> bool:
  """Whether an agent `collapsed` for `collapse_run` batches in a row, reset `resets`
  times so far, goes back to its starting weights now: at the `collapse_after`-th such
  batch, at most `collapse_resets` times a run.

  A policy collapsed onto one answer never samples the others, so no reward ranks them;
  measured on a yes/no judge driven onto "y" (RESULTS.md): an entropy bonus up to 32×
  and a bonus-only step with fresh Adam moments did not bring "n" back (large ones
  spread it over every token, and inflated Adam's second moments then froze it), nor did
  halfway back to the start (shrink and perturb); the start did, where the task is
  learnable from it (the resets of Nikishin et al., 2022, "The Primacy Bias in Deep
  RL", here triggered by the collapse instead of a schedule)."""
  return (bool(cfg.collapse_after) and collapse_run == cfg.collapse_after
          and resets < cfg.collapse_resets)
