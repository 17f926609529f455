"""StallWatch: say so when an agent has stopped learning.

A GRPO group whose rewards are all equal has zero advantages and teaches nothing
(`flexmarl.train.grpo.zero_spread_fraction` gives the fraction per step). An agent
whose groups stay that way for many updates has collapsed onto one answer (or is
always right, or always wrong) and nothing else in the output would say so.

When an agent that had learned goes wrong again, its entropy bonus, which follows its
error (`flexmarl.train.grpo.entropy_weights`), rises with it: the framework is pushing
it to explore again, and the watch says so, once per rise.

An agent collapsed onto one answer (`flexmarl.train.collapse`) gets a line of its
own, once per collapse, which says whether it was reset (`collapse.resets_now`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

# The intervention line: the agent's smoothed bonus (an exponential mean over about
# SMOOTH updates: one batch with a wrong group is not a relapse) at least RAISED ×
# entropy_coef and RISE × its lowest since the last line (or the start).
RAISED, RISE, SMOOTH = 0.5, 4, 10


class StallWatch:
  """Per agent, counts consecutive updates whose zero-spread fraction exceeds `threshold`;
  warns once when the count reaches `patience`, and again after it recovers and stalls anew."""

  def __init__(self, threshold: float = 0.9, patience: int = 20):
    if not 0 <= threshold <= 1 or patience < 1:
      raise ValueError(f'StallWatch(threshold={threshold}, patience={patience}): give a '
                       'threshold in [0, 1] and a patience >= 1 updates.')
    self.threshold, self.patience = threshold, patience
    self._run: dict[str, int] = {}
    self._mean: dict[str, float] = {}  # each agent's smoothed bonus ...
    self._low: dict[str, float] = {}  # ... and its lowest since the last line

  def update(self, agent: str, step: int, zero_spread: float, entropy: float = math.nan,
             accuracy: float = math.nan) -> str | None:
    """Record one update's fraction; returns a warning line when the agent has stalled.
    An agent that is nearly always right (`accuracy` above the threshold) has equal
    rewards too, but has not stalled: its groups are equal because they are right."""
    solved = not math.isnan(accuracy) and accuracy >= self.threshold
    if math.isnan(zero_spread) or zero_spread <= self.threshold or solved:
      self._run[agent] = 0
      return None
    self._run[agent] = self._run.get(agent, 0) + 1
    if self._run[agent] != self.patience:
      return None
    ent = '' if math.isnan(entropy) else f', policy entropy {entropy:.3f}'
    return (f'step {step}: agent {agent!r} has stalled: in each of its last {self.patience} '
            f'updates more than {self.threshold:.0%} of its GRPO groups had equal rewards '
            f'(now {zero_spread:.0%}{ent}), so they teach nothing. Raise its sampling '
            'temperature or entropy_coef, give partial-credit rewards, or check the reward '
            'function.')

  def intervention(self, agent: str, step: int, bonus: float, entropy_coef: float,
                   entropy: float = math.nan, accuracy: float = math.nan) -> str | None:
    """A line when the agent's entropy bonus (its mean over the update's tokens),
    smoothed over about SMOOTH updates, has risen to RISE × its lowest since the last
    line (or the start) and to at least RAISED × its `entropy_coef`: an agent that had
    learned is wrong again and is pushed to explore. Once per rise; NaN (no update) is
    ignored."""
    if math.isnan(bonus):
      return None
    mean = self._mean.get(agent, bonus)
    mean += (bonus - mean) / SMOOTH
    self._mean[agent] = mean
    low = min(self._low.get(agent, mean), mean)
    self._low[agent] = low
    if mean < max(RISE * low, RAISED * entropy_coef) or mean == 0:
      return None
    self._low[agent] = mean
    ent = '' if math.isnan(entropy) else f' at policy entropy {entropy:.3f} nats/token'
    acc = '' if math.isnan(accuracy) else f' and accuracy {accuracy:.2f}'
    return (f'step {step}: agent {agent!r}: the framework raises its entropy bonus to '
            f'{mean:.3g} (mean of recent updates; from {low:.3g}, of at most '
            f'entropy_coef={entropy_coef:.3g}){ent}{acc}: it is wrong again where it had been '
            'right, so it is pushed to explore there. Nothing to do unless this repeats for '
            'long; then check the reward.')

  def lines(self, agent: str, step: int, values: Mapping[str, Any], grpo_cfg: Any
            ) -> list[str]:
    """Everything to log about one update of `agent` (its metrics line `values`, its
    GRPO config): a stall warning; a collapse onto one answer, or else a rise of its
    entropy bonus."""
    out = []
    entropy, accuracy = values.get('entropy', math.nan), values['accuracy']
    warning = self.update(agent, step, values['zero_spread'], entropy, accuracy)
    if warning:
      out.append(f'warning: {warning}')
    run = values.get('collapse_run', 0)
    if grpo_cfg.collapse_after and run == grpo_cfg.collapse_after:
      did = (f'The framework reset it to its starting weights with a fresh optimizer (reset '
             f'{values.get("resets", 0)} of at most {grpo_cfg.collapse_resets}).'
             if values.get('collapse_reset') else
             f'It was not reset (collapse_resets={grpo_cfg.collapse_resets} used): give its '
             'workflow balanced cases or rewards that separate its answers.')
      out.append(
          f'warning: step {step}: agent {agent!r} has collapsed onto one answer: in {run} '
          f'batches in a row at least {grpo_cfg.collapse_share:.0%} of its sampled answers '
          f'were the same where the right answers differ (accuracy {accuracy:.2f}, policy '
          f'entropy {entropy:.3g}). {did}')
      return out
    note = self.intervention(agent, step, values.get('entropy_bonus', math.nan),
                             grpo_cfg.entropy_coef, entropy, accuracy)
    if note:
      out.append(note)
    return out
