"""The run's summary (`summary.json`) and its progress lines."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping

import numpy as np

from flexmarl.metrics.writer import TEAM, read_metrics


def format_step(step: int, steps: int, lines: Mapping[str, Mapping[str, float]]) -> str:
  """One progress line: step time, throughput, reward and accuracy per agent."""
  team = lines[TEAM]
  agents = '  '.join(f"{n}: r={l['reward_mean']:.2f} acc={l['accuracy']:.2f}"
                     for n, l in lines.items() if n != TEAM)
  return f"step {step}/{steps} [{team['step_time_s']:.2f}s, {team['tokens_per_s']:.0f} tok/s]  {agents}"


def write_summary(workdir: str, wall_s: float, utilization: dict | None = None,
                  window: int = 5) -> dict:
  """Per agent: reward and accuracy of its first update, and the mean over its last
  `window` updates (single steps of small batches are noisy); NaN for an agent that
  has not updated yet. `utilization`: busy fractions per device group over the run."""
  lines = read_metrics(os.path.join(workdir, 'metrics.jsonl'))
  agents = sorted({l['agent'] for l in lines} - {TEAM})
  summary: dict = {'wall_s': wall_s, 'agents': {}}
  for agent in agents:
    mine = sorted((l for l in lines if l['agent'] == agent and l['updated']),
                  key=lambda l: l['step'])
    first, last = mine[:1], mine[-window:]
    mean = lambda ls, key: float(np.mean([l[key] for l in ls])) if ls else math.nan
    summary['agents'][agent] = {
        'first_reward': mean(first, 'reward_mean'), 'first_accuracy': mean(first, 'accuracy'),
        'last_reward': mean(last, 'reward_mean'), 'last_accuracy': mean(last, 'accuracy'),
        'updates': len(mine)}
  team = [l for l in lines if l['agent'] == TEAM]
  run_time = sum(l['step_time_s'] for l in team)
  summary['tokens_per_s'] = sum(l['tokens'] for l in team) / run_time if run_time else 0.0
  summary['steps'] = len(team)
  summary['utilization'] = utilization or {}
  with open(os.path.join(workdir, 'summary.json'), 'w', encoding='utf-8') as f:
    json.dump(summary, f, indent=2)
  return summary
