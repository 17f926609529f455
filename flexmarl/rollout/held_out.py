"""Held-out evaluation: greedy pass@1 and mean reward per agent and for the team.

A workflow that offers held-out problems (`eval_queries() -> list[Query]`, disjoint from
its training stream) is run on them through the same rollout instances, with one greedy
answer per request (`RolloutEngine.evaluation_engine`); nothing served here reaches the
ExperienceStore. Per agent: the share of its answers the workflow marked correct
(`eval_accuracy`) and their mean reward (`eval_reward`). For the team: the share of
problems on which every answer was correct, and the mean over problems of their mean
reward.

The run loop calls it every `config.eval_every` steps; `python -m flexmarl.evaluate`
evaluates a workdir's checkpoint, or the base model alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from flexmarl.data.records import EpisodeResult
from flexmarl.metrics.writer import TEAM
from flexmarl.workflows.base import HeldOut

EVAL_KEYS = ('eval_accuracy', 'eval_reward', 'eval_answers')


def has_held_out(workflow) -> bool:
  """Whether the workflow offers held-out problems (the `HeldOut` protocol)."""
  return isinstance(workflow, HeldOut)


def eval_lines(results: Sequence[EpisodeResult]) -> dict[str, dict[str, float]]:
  """Per agent and for the team (`TEAM`): eval_accuracy, eval_reward, eval_answers."""
  rewards: dict[str, list[float]] = {}
  correct: dict[str, list[bool]] = {}
  team_right, team_reward = [], []
  for result in results:
    episode = result.episode
    query_right, query_rewards = True, []
    for group in result.served:
      for sid in group.sample_ids:
        reward = episode.rewards[sid]
        right = episode.correct.get(sid, reward >= 1.0)
        rewards.setdefault(group.agent, []).append(reward)
        correct.setdefault(group.agent, []).append(right)
        query_right = query_right and right
        query_rewards.append(reward)
    if episode.outcomes:  # a workflow in attempts: solved when its attempts were
      query_right = all(v >= 1.0 for v in episode.outcomes.values())
    team_right.append(query_right)
    team_reward.append(float(np.mean(query_rewards)) if query_rewards else math.nan)
  lines = {agent: {'eval_accuracy': float(np.mean(correct[agent])),
                   'eval_reward': float(np.mean(rewards[agent])),
                   'eval_answers': len(rewards[agent])} for agent in rewards}
  lines[TEAM] = {'eval_accuracy': float(np.mean(team_right)) if team_right else math.nan,
                 'eval_reward': float(np.nanmean(team_reward)) if team_reward else math.nan,
                 'eval_answers': len(team_right)}
  return lines


def run_held_out(engine, workflow) -> list[EpisodeResult]:
  """`workflow`'s held-out queries, answered greedily by `engine`'s instances (their
  current weights)."""
  return engine.evaluation_engine().run(workflow, list(workflow.eval_queries()))


def evaluate(engine, workflow, clock=None) -> dict[str, dict[str, float]]:
  """`eval_lines` of the held-out queries' results (see `run_held_out`); with a `clock`,
  the team's line says how long the evaluation took (`eval_s`)."""
  start = clock.now() if clock else 0.0
  lines = eval_lines(run_held_out(engine, workflow))
  if clock:
    lines[TEAM]['eval_s'] = clock.now() - start
  return lines


def answer_texts(results: Sequence[EpisodeResult], tokenizers: Mapping
                 ) -> dict[tuple[str, str], str]:
  """(query id, agent) → the text of that agent's (one, greedy) answer to that query."""
  return {(r.query.query_id, g.agent): tokenizers[g.agent].decode(g.tokens[0])
          for r in results for g in r.served}


def format_eval(step: int, lines: Mapping[str, Mapping[str, float]]) -> str:
  parts = '  '.join(f"{name}: acc={l['eval_accuracy']:.2f} r={l['eval_reward']:.2f}"
                    for name, l in lines.items())
  return f'eval at step {step} (held-out, greedy): {parts}'
