"""Three agents in a chain, each working on the previous one's answer: a user's own
workflow (see team_of_three.py). `experiments/chain.py` names it as
`experiments.chain_team:Chain`.

The query `3+2` (two digits 0..4) passes down the chain:

    adder    sees `3+2=` and answers the sum x                     (`5`)
    flipper  sees `-5=`  and answers y = f(x) = 8 - x              (`3`)
    speller  sees `3>`   and answers g(y), the y-th letter of a..i  (`d`)

Only the adder sees the query: the flipper sees nothing but the adder's answer, the
speller nothing but the flipper's. Each is scored against the right answer for the input
it was given (its job is its own step), so it learns while the agent before it is still
wrong. The input passed on is the group's most common answer in 0..8; until the agent
before gives one, the next agent is given the true value instead.

Rewards: partial credit (1.0 when exact); `correct` is the exact match.

Best constant answer (exact match, the query distribution with right upstream answers;
`best_constant_accuracy` enumerates it): 5/25 = 0.2 for each agent (x = 4, f = 4, `e`).
"""

from __future__ import annotations

import collections
import itertools
import string
from collections.abc import Mapping, Sequence

import numpy as np

from flexmarl import tasks
from flexmarl.workflows.base import AgentClient, Completion, Episode, Query

MAX_DIGIT = 4
MAX_SUM = 2 * MAX_DIGIT


def flip(x: int) -> int:
  return MAX_SUM - x


def spell(y: int) -> str:
  return string.ascii_lowercase[y]


def _passed_on(answers: Sequence[Completion], truth: int) -> int:
  """The group's most common answer in 0..MAX_SUM (the first seen among ties), else
  `truth`: a valid input for the next agent."""
  valid = {str(v) for v in range(MAX_SUM + 1)}
  counts = collections.Counter(c.text for c in answers if c.text in valid)
  return int(counts.most_common(1)[0][0]) if counts else truth


class Chain:

  def __init__(self, adder: str = 'adder', flipper: str = 'flipper', speller: str = 'speller'):
    self.adder, self.flipper, self.speller = adder, flipper, speller

  def agent_names(self) -> Sequence[str]:
    return [self.adder, self.flipper, self.speller]

  def make_query(self, rng: np.random.Generator, query_id: str) -> Query:
    x, y = (int(v) for v in rng.integers(0, MAX_DIGIT + 1, size=2))
    return Query(query_id, f'{x}+{y}', answer=spell(flip(x + y)), family='chain',
                 meta={'sum': x + y})

  async def _step(self, agent: AgentClient, prompt: str, truth: str,
                  episode: Episode) -> list[Completion]:
    answers = await agent.generate(prompt)
    for c in answers:
      episode.score(c, tasks.partial_credit(c.text, truth), correct=c.text == truth,
                    expected=truth)
    return answers

  async def run(self, query: Query, agents: Mapping[str, AgentClient]) -> Episode:
    episode = Episode()
    x = query.meta['sum']
    sums = await self._step(agents[self.adder], f'{query.prompt}=', str(x), episode)
    x = _passed_on(sums, x)
    flips = await self._step(agents[self.flipper], f'-{x}=', str(flip(x)), episode)
    y = _passed_on(flips, flip(x))
    await self._step(agents[self.speller], f'{y}>', spell(y), episode)
    return episode


def best_constant_accuracy() -> dict[str, float]:
  """Each agent's exact-match rate of its best constant answer over the queries
  (uniform digits; upstream agents answering right)."""
  per_agent = {'adder': [], 'flipper': [], 'speller': []}
  for a, b in itertools.product(range(MAX_DIGIT + 1), repeat=2):
    per_agent['adder'].append(str(a + b))
    per_agent['flipper'].append(str(flip(a + b)))
    per_agent['speller'].append(spell(flip(a + b)))
  return {agent: collections.Counter(truths).most_common(1)[0][1] / len(truths)
          for agent, truths in per_agent.items()}
