"""A solver answers; a verifier accepts ('y') or rejects ('n') each answer.

The solver earns partial credit for its answer (1.0 when exact). The verifier
sees the task with one of the solver's answers and earns 1 for a correct verdict, and
partial credit for the right verdict followed by more (it must learn to stop after it).
Verifications of the solver's answers are independent branches, run concurrently.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import numpy as np

from flexmarl import tasks
from flexmarl.workflows.base import AgentClient, Completion, Episode, Query


class SolverVerifier:

  def __init__(self, solver: str = 'solver', verifier: str = 'verifier', family: str = 'add',
               task_args: Mapping | None = None):
    if family not in tasks.FAMILIES:
      raise ValueError(f'workflow.family={family!r} is unknown; known: {sorted(tasks.FAMILIES)}.')
    self.solver, self.verifier, self.family = solver, verifier, family
    self.task_args = tasks.check_task_args(family, task_args or {}, 'workflow.task_args')

  def agent_names(self) -> Sequence[str]:
    return [self.solver, self.verifier]

  def make_query(self, rng: np.random.Generator, query_id: str) -> Query:
    task = tasks.FAMILIES[self.family](rng, **self.task_args)
    return Query(query_id, task.prompt, task.answer, self.family)

  async def _verify(self, agents, query: Query, answer: Completion, episode: Episode) -> None:
    truth = 'y' if answer.text == query.answer else 'n'
    for verdict in await agents[self.verifier].generate(f'{query.prompt}={answer.text}?'):
      right = verdict.text == truth
      episode.score(verdict, tasks.partial_credit(verdict.text, truth), correct=right,
                    expected=truth)

  async def run(self, query: Query, agents: Mapping[str, AgentClient]) -> Episode:
    episode = Episode()
    answers = await agents[self.solver].generate(f'{query.prompt}=')
    for a in answers:
      episode.score(a, tasks.partial_credit(a.text, query.answer), correct=a.text == query.answer,
                    expected=query.answer)
    await asyncio.gather(*[self._verify(agents, query, a, episode) for a in answers])
    return episode
