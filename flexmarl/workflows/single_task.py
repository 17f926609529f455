"""One agent, one task family: the single-agent baseline (and the GRPO benchmark)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from flexmarl import tasks
from flexmarl.workflows.base import AgentClient, Episode, Query


class SingleTask:

  def __init__(self, agent: str = 'solver', family: str = 'add',
               task_args: Mapping | None = None):
    if family not in tasks.FAMILIES:
      raise ValueError(f'workflow.family={family!r} is unknown; known: {sorted(tasks.FAMILIES)}.')
    self.agent, self.family = agent, family
    self.task_args = tasks.check_task_args(family, task_args or {}, 'workflow.task_args')

  def agent_names(self) -> Sequence[str]:
    return [self.agent]

  def make_query(self, rng: np.random.Generator, query_id: str) -> Query:
    task = tasks.FAMILIES[self.family](rng, **self.task_args)
    return Query(query_id, task.prompt, task.answer, self.family)

  async def run(self, query: Query, agents: Mapping[str, AgentClient]) -> Episode:
    episode = Episode()
    for c in await agents[self.agent].generate(f'{query.prompt}='):
      episode.score(c, tasks.partial_credit(c.text, query.answer), correct=c.text == query.answer,
                    expected=query.answer)
    return episode
