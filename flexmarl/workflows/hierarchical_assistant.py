"""A router and its specialists (the default experiment).

The router reads a query and names one of K specialists (by index); the chosen
specialist answers. Each specialist owns one task family; the query mix over
families is Zipf-skewed and answer lengths differ by family, so load is skewed
between agents and within them.

Rewards: each specialist answer earns partial credit (per-position match; 1.0 when
exact). The router earns 1 for naming the specialist that owns the query's family
(`router_reward='routing'`, the default: each specialist keeps its own family), or
the mean reward of the specialist it chose (`'outcome'`: every distinct valid choice
is executed).

Under 'routing' the query goes to the router's first valid choice; when none of its
samples names a specialist, to a fallback specialist drawn uniformly with the query
(so an untrained router cannot starve any specialist of work).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import numpy as np

from flexmarl import tasks
from flexmarl.workflows.base import AgentClient, Episode, Query, ordered_pairs


class HierarchicalAssistant:

  def __init__(self, router: str, specialists: Sequence[tuple[str, str]], zipf: float = 1.0,
               router_reward: str = 'routing', task_args: Mapping[str, Mapping] | None = None):
    """specialists: (task family, agent name) pairs, the most frequent family first; the
    order sets the Zipf skew and the index by which the router names each specialist."""
    specialists = ordered_pairs('specialists', specialists)
    unknown = [f for f, _ in specialists if f not in tasks.FAMILIES]
    if unknown:
      raise ValueError(f'workflow.specialists names unknown task families {unknown}; '
                       f'known families: {sorted(tasks.FAMILIES)}.')
    if router_reward not in ('routing', 'outcome'):
      raise ValueError(f"workflow.router_reward={router_reward!r}: use 'routing' or 'outcome'.")
    if len(specialists) > 10:
      raise ValueError('workflow.specialists: at most 10 (the router names them by one digit).')
    self.router = router
    self.families = [family for family, _ in specialists]
    self.specialists = dict(specialists)
    self.probs = tasks.zipf_probs(len(self.families), zipf)
    self.router_reward = router_reward
    task_args = dict(task_args or {})
    stray = sorted(set(task_args) - set(self.families))
    if stray:
      raise ValueError(f'workflow.task_args names families {stray} that no specialist owns '
                       f'(workflow.specialists: {self.families}); remove them or add '
                       'specialists for them.')
    self.task_args = {f: tasks.check_task_args(f, task_args.get(f, {}), f'workflow.task_args.{f}')
                      for f in self.families}

  def agent_names(self) -> Sequence[str]:
    return [self.router, *self.specialists.values()]

  def make_query(self, rng: np.random.Generator, query_id: str) -> Query:
    family = self.families[rng.choice(len(self.families), p=self.probs)]
    task = tasks.FAMILIES[family](rng, **self.task_args[family])
    fallback = int(rng.integers(len(self.families)))
    return Query(query_id, task.prompt, task.answer, family, {'fallback': fallback})

  async def _solve(self, agent: AgentClient, query: Query, episode: Episode) -> float:
    answers = await agent.generate(f'{query.prompt}=')
    rewards = [tasks.partial_credit(c.text, query.answer) for c in answers]
    for c, r in zip(answers, rewards):
      episode.score(c, r, correct=c.text == query.answer, expected=query.answer)
    return float(np.mean(rewards))

  async def run(self, query: Query, agents: Mapping[str, AgentClient]) -> Episode:
    episode = Episode()
    routes = await agents[self.router].generate(f'{query.prompt}?')
    target = str(self.families.index(query.family))
    choices = [c.text if c.text in map(str, range(len(self.families))) else None
               for c in routes]
    if self.router_reward == 'routing':
      # One decision is acted on: the first valid one, else the query's fallback
      # specialist; the rest of the group only serve the router's GRPO baseline.
      chosen = [next((c for c in choices if c is not None), str(query.meta['fallback']))]
    else:
      chosen = sorted({c for c in choices if c is not None})
    outcomes = await asyncio.gather(*[
        self._solve(agents[self.specialists[self.families[int(c)]]], query, episode)
        for c in chosen])
    outcome = dict(zip(chosen, outcomes))
    for c, choice in zip(routes, choices):
      right = choice == target
      # Routing: 1 for the right index alone, partial credit for it followed by more
      # (only an exact index is acted on; the credit teaches the router to stop).
      reward = (tasks.partial_credit(c.text, target) if self.router_reward == 'routing'
                else outcome.get(choice, 0.0))
      episode.score(c, reward, correct=right, expected=target)
    return episode
