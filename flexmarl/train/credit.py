"""Credit: how an agent's rows get their advantages, by name.

Two registries, each named in the agent's config:
- `grpo.credit` (CREDITS): which samples are compared with which.
  - 'call' (the default): a group is one `generate` call's `n` samples of one prompt,
    scored by the workflow (GRPO, Shao et al. 2024). AT-GRPO's agent-and-turn groups
    (Stronger-MAS, arXiv 2510.11062) are call groups too: at each turn the workflow asks
    for K candidates, scores each by its turn reward and goes on with the best
    (`workflows.turns.best_of`).
  - 'episode': a group is a query's `n` attempts run side by side (`Episode.score(...,
    episode=i)`, `Episode.outcome(i, value)`; each turn one sample): every turn of the
    agent in attempt i gets attempt i's outcome against the others' (the outcomes'
    mean, and std unless `normalize_std=False`), plus `turn_reward_coef` times the
    discounted (`turn_discount`) sum of the agent's own turn rewards from that turn on
    (verl-agent, SkyRL, rLLM).
  - 'episode_agent': the same values (outcome + turn part), normalised by the agent's own
    statistics over its turns in the query's attempts, so an agent whose turns earn other
    rewards than its teammates' is not measured on their scale (Dr. MAS, arXiv
    2602.08847: agent-wise advantage normalisation).
- `grpo.advantage` (ESTIMATORS), for call groups: one group's rewards → one advantage per
  sample.

A new mode or estimator is a function and a decorator, in a file of its own, imported
before the config is read:

    @register_advantage('rank')
    def rank(rewards: np.ndarray, cfg) -> np.ndarray:
      return (np.argsort(np.argsort(rewards)) - (len(rewards) - 1) / 2).astype(np.float32)

The agent's Learner (train/learner.py) applies them as each query's episode arrives, the
one place a row's advantage is computed (the ExperienceStore keeps it beside the reward).
Pure numpy: the config checks names against the registries before anything compiles.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from flexmarl.data.records import EpisodeResult
from flexmarl.spec.validate import fail
from flexmarl.workflows.base import Episode

# (a group's rewards, the agent's GRPOConfig) -> one advantage per sample
Estimator = Callable[[np.ndarray, Any], np.ndarray]
ESTIMATORS: dict[str, Estimator] = {}
# (a query's result, the agent, its GRPOConfig) -> one advantage array per served group
# of the agent, in call order
Credit = Callable[[EpisodeResult, str, Any], list[np.ndarray]]
CREDITS: dict[str, Credit] = {}
EPISODE_CREDITS = ('episode', 'episode_agent')  # the modes that read attempts' outcomes


def _register(table: dict, kind: str, name: str) -> Callable:
  """A decorator that adds its function to `table` under `name`, once."""
  def add(fn: Callable) -> Callable:
    if name in table:
      raise ValueError(f'{kind} {name!r} is registered already ({table[name].__module__}); '
                       'give yours another name.')
    table[name] = fn
    return fn
  return add


def register_advantage(name: str) -> Callable[[Estimator], Estimator]:
  """Add an estimator under `name`; a name is registered once."""
  return _register(ESTIMATORS, 'an advantage estimator', name)


def register_credit(name: str) -> Callable[[Credit], Credit]:
  """Add a credit mode under `name`; a name is registered once."""
  return _register(CREDITS, 'a credit mode', name)


def group_advantages(rewards: np.ndarray, group_size: int, normalize_std: bool = True,
                     eps: float = 1e-6) -> np.ndarray:
  """(r - mean(group)) [/ (std(group) + eps)] for rewards laid out group after group."""
  r = np.asarray(rewards, np.float64).reshape(-1, group_size)
  adv = r - r.mean(axis=1, keepdims=True)
  if normalize_std:
    adv = adv / (r.std(axis=1, keepdims=True) + eps)
  return adv.reshape(-1).astype(np.float32)


@register_advantage('grpo')
def grpo(rewards: np.ndarray, cfg: Any) -> np.ndarray:
  """GRPO's group-relative advantage (Shao et al., 2024); with `normalize_std=False`,
  Dr. GRPO's (Liu et al., 2025: no division by the group's std)."""
  return group_advantages(rewards, len(rewards), cfg.normalize_std)


def check_credit(requests: Sequence[tuple[str, Any, Sequence[str]]], episodes: Sequence[Episode],
                 credits: Mapping[str, str]) -> None:
  """Raise ConfigError where an agent's credit mode would train on nothing, as the
  workflow's dry run (flexmarl.workflows.checks) shows it: a call group of one sample
  (its advantage is 0), or episode credit without attempts side by side."""
  for agent, _, sample_ids in requests:
    if credits[agent] == 'call' and len(sample_ids) == 1:
      fail(f'agents.{agent}.grpo.credit', 'call',
           f'the workflow asks {agent!r} for one sample at a time (generate(n=1), sample '
           f'{sample_ids[0]}): a group of one has advantage 0 and trains nothing. Fix: ask '
           "for n >= 2 samples, or run attempts side by side and set credit='episode' "
           '(episode.score(c, reward, episode=i); docs/workflows.md, "Turns").')
  for agent, mode in credits.items():
    if mode not in EPISODE_CREDITS:
      continue
    mine = {s for a, _, ids in requests if a == agent for s in ids}
    for episode in episodes:
      attempts = {episode.episode_of[s] for s in mine if s in episode.episode_of}
      untagged = sorted(s for s in mine if s in episode.rewards and s not in episode.episode_of)
      if untagged or (attempts and len(episode.outcomes) < 2):
        fail(f'agents.{agent}.grpo.credit', mode,
             'credit by episode compares a query\'s attempts, but the workflow '
             + (f'scored {untagged[0]} without episode=' if untagged else
                f'runs {len(episode.outcomes)} attempt a query')
             + '. Fix: run n >= 2 attempts side by side, each turn scored with '
             "episode.score(c, reward, episode=i) and each attempt given episode.outcome(i, "
             "value); or credit='call'.")


def _groups(result: EpisodeResult, agent: str):
  return [g for g in result.served if g.agent == agent]


@register_credit('call')
def call_groups(result: EpisodeResult, agent: str, cfg: Any) -> list[np.ndarray]:
  """Each call's samples, by the agent's estimator (`grpo.advantage`)."""
  estimate = ESTIMATORS[cfg.advantage]
  return [np.asarray(estimate(np.array([result.episode.rewards[s] for s in g.sample_ids],
                                       np.float32), cfg), np.float32)
          for g in _groups(result, agent)]


def turn_values(result: EpisodeResult, agent: str, cfg: Any) -> list[np.ndarray]:
  """(outcome of the sample's attempt, its turn part) per sample of the agent, one
  (2, n) array per call: the turn part is the discounted sum of the agent's own turn
  rewards in that attempt from this turn on (its calls in order)."""
  episode, groups = result.episode, _groups(result, agent)
  where = f'query {result.query.query_id}, agent {agent!r} (grpo.credit={cfg.credit!r})'
  for g in groups:
    for s in g.sample_ids:
      if s not in episode.episode_of:
        raise ValueError(f'{where}: sample {s} was scored without episode=; credit by '
                         'episode needs every turn\'s attempt: episode.score(c, reward, '
                         'episode=i), or grpo.credit=\'call\'.')
  attempts = sorted({episode.episode_of[s] for g in groups for s in g.sample_ids})
  missing = [i for i in attempts if i not in episode.outcomes]
  if missing:
    raise ValueError(f'{where}: attempts {missing} have no outcome; give each one '
                     'episode.outcome(i, value).')
  later = dict.fromkeys(attempts, 0.0)  # per attempt: the discounted rewards after a turn
  parts: dict[str, float] = {}
  for g in reversed(groups):
    for s in reversed(g.sample_ids):
      i = episode.episode_of[s]
      later[i] = episode.rewards[s] + cfg.turn_discount * later[i]
      parts[s] = later[i]
  return [np.array([[episode.outcomes[episode.episode_of[s]] for s in g.sample_ids],
                    [cfg.turn_reward_coef * parts[s] for s in g.sample_ids]], np.float64)
          for g in groups]


@register_credit('episode')
def episode_groups(result: EpisodeResult, agent: str, cfg: Any) -> list[np.ndarray]:
  """Each turn: its attempt's outcome against every attempt of the query, plus its turn
  part (see the module's docstring)."""
  outcomes = result.episode.outcomes
  attempts = sorted(outcomes)
  normed = dict(zip(attempts, group_advantages(np.array([outcomes[i] for i in attempts]),
                                               len(attempts), cfg.normalize_std)))
  out = []
  for g, values in zip(_groups(result, agent), turn_values(result, agent, cfg)):
    out.append((np.array([normed[result.episode.episode_of[s]] for s in g.sample_ids])
                + values[1]).astype(np.float32))
  return out


@register_credit('episode_agent')
def episode_agent_normalized(result: EpisodeResult, agent: str, cfg: Any) -> list[np.ndarray]:
  """Each turn's value (outcome + turn part), normalised by the agent's own mean and
  std over its turns in the query's attempts (Dr. MAS)."""
  values = turn_values(result, agent, cfg)
  if not values:
    return []
  flat = np.concatenate([v.sum(axis=0) for v in values])
  normed = group_advantages(flat, len(flat), cfg.normalize_std)
  ends = np.cumsum([v.shape[1] for v in values])[:-1]
  return [a.astype(np.float32) for a in np.split(normed, ends)]
