"""The team's metrics line of a step, from its agents' lines and its timings."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


def team_line(lines: Mapping[str, Mapping[str, float]], *, step_s: float, rollout_s: float,
              queries: int, skipped_queries: int, tokens: int, rebalances: int,
              utilization: Mapping[str, float]) -> dict[str, float]:
  """Means of the agents' rewards and accuracy (over agents that have them), the
  step's generated tokens, times and throughput, the queries it consumed (and of them,
  skipped by admission), the agents updated, the balancer's moves and the devices'
  utilization."""
  def mean(key: str) -> float:  # over agents that have it (NaN where none has)
    known = [l[key] for l in lines.values() if not np.isnan(l[key])]
    return float(np.mean(known)) if known else float('nan')
  return dict(utilization, reward_mean=mean('reward_mean'), reward_std=mean('reward_std'),
              accuracy=mean('accuracy'), tokens=tokens, step_time_s=step_s,
              rollout_s=rollout_s, train_s=step_s - rollout_s, queries=queries,
              skipped_queries=skipped_queries,
              tokens_per_s=tokens / step_s, updated=sum(l['updated'] for l in lines.values()),
              rebalances=rebalances)
