"""summary.json (per agent, where its reward and accuracy started and ended, and how much
of what was sampled for it was trained on) and the progress line of a step."""

from __future__ import annotations

import json
import math
import os

from collections.abc import Mapping

import numpy as np

from flexmarl.metrics.no_update import reason, waiting_rows
from flexmarl.metrics.writer import TEAM, format_steps, lost_steps, scan_metrics


def format_step(step: int, steps: int, lines: Mapping[str, Mapping[str, float]]) -> str:
  """One progress line: step time, throughput, reward and accuracy per agent."""
  team = lines[TEAM]
  agents = '  '.join(f"{n}: r={l['reward_mean']:.2f} acc={l['accuracy']:.2f}"
                     for n, l in lines.items() if n != TEAM)
  return f"step {step}/{steps} [{team['step_time_s']:.2f}s, {team['tokens_per_s']:.0f} tok/s]  {agents}"


# Accuracy against a constant answer's (flexmarl.data.groups.ConstantBaseline), where given.
SKILL = ('best_constant', 'above_constant', 'balanced_accuracy', 'balanced_above_constant')


def _mean(lines: list[dict], key: str) -> float:
  """Mean of `key` over `lines`, NaN values (and lines without it) left out; NaN if
  none is known."""
  known = [l[key] for l in lines if not math.isnan(l.get(key, math.nan))]
  return float(np.mean(known)) if known else math.nan


def summarize(lines: list[dict], wall_s: float, window: int = 5) -> dict:
  """Per agent: reward and accuracy as the mean over its first `window` updates and over
  its last `window` (single steps of small batches are noisy); NaN for an agent without
  updates. Steps are counted from every line, so one torn team line does not miscount."""
  evals = [l for l in lines if 'eval_accuracy' in l]  # held-out evaluation rows
  lines = [l for l in lines if 'eval_accuracy' not in l]
  agents = sorted({l['agent'] for l in lines} - {TEAM})
  summary: dict = {'wall_s': wall_s, 'agents': {}}
  for agent in agents:
    mine = sorted((l for l in lines if l['agent'] == agent and l.get('updated')),
                  key=lambda l: l['step'])
    first, last = mine[:window], mine[-window:]
    summary['agents'][agent] = {
        'first_reward': _mean(first, 'reward_mean'), 'first_accuracy': _mean(first, 'accuracy'),
        'last_reward': _mean(last, 'reward_mean'), 'last_accuracy': _mean(last, 'accuracy'),
        'updates': len(mine)}
    mine_all = [l for l in lines if l['agent'] == agent]
    generated = sum(l.get('generated_tokens', 0) for l in mine_all)
    if generated:  # runs from before the count have none
      trained = sum(l.get('trained_tokens', 0) for l in mine_all)
      summary['agents'][agent].update(generated_tokens=generated, trained_tokens=trained,
                                      trained_share=trained / generated)
    if not mine:  # what waits in its buffer, for the end table's reason
      steps = sorted((l for l in lines if l['agent'] == agent), key=lambda l: l['step'])
      summary['agents'][agent].update(waiting_rows=waiting_rows(steps[-1]), steps=len(steps))
    if any('best_constant' in l for l in last):  # the workflow gave expected answers
      summary['agents'][agent].update({f'last_{key}': _mean(last, key) for key in SKILL})
  if evals:  # held-out greedy accuracy at the first evaluation and at the last
    for agent in sorted({l['agent'] for l in evals}):
      mine = sorted((l for l in evals if l['agent'] == agent), key=lambda l: l['step'])
      summary.setdefault('eval', {})[agent] = {
          'first_step': mine[0]['step'], 'first_accuracy': mine[0]['eval_accuracy'],
          'last_step': mine[-1]['step'], 'last_accuracy': mine[-1]['eval_accuracy'],
          'first_reward': mine[0]['eval_reward'], 'last_reward': mine[-1]['eval_reward']}
  team = [l for l in lines if l['agent'] == TEAM]
  run_time = sum(l['step_time_s'] for l in team)
  summary['tokens_per_s'] = sum(l['tokens'] for l in team) / run_time if run_time else 0.0
  summary['steps'] = len({l['step'] for l in lines})
  return summary


def write_summary(workdir: str, wall_s: float, utilization: dict | None = None,
                  window: int = 5, steps: int | None = None,
                  global_batches: Mapping[str, int] | None = None,
                  max_step_queries: int = 0) -> dict:
  """`summarize` the workdir's metrics.jsonl into summary.json; lines that could not be
  read are listed under 'problems'. `utilization`: busy fractions per device group.
  `steps`: the run's step; the summary then counts it, and lists the steps before it
  whose metrics lines are lost under 'metrics_lost'. With `global_batches` (and the
  run's `max_step_queries`), an agent without updates says why under 'no_update'."""
  lines, problems = scan_metrics(os.path.join(workdir, 'metrics.jsonl'))
  summary = summarize(lines, wall_s, window)
  for agent, s in summary['agents'].items():
    if not s['updates'] and agent in (global_batches or {}):
      s['no_update'] = reason(agent, s['steps'], s['waiting_rows'], global_batches[agent],
                              max_step_queries)
  summary['utilization'] = utilization or {}
  if steps is not None:
    summary['steps'] = steps
    lost = lost_steps(lines, steps)
    if lost:
      summary['metrics_lost'] = format_steps(lost)
      problems.append(f'the metrics lines of steps {format_steps(lost)} are lost (the file was '
                      'deleted or cut); per-agent figures cover the other steps.')
  if problems:
    summary['problems'] = problems
  with open(os.path.join(workdir, 'summary.json'), 'w', encoding='utf-8') as f:
    json.dump(summary, f, indent=2)
  return summary
