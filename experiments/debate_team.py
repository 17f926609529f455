"""Two agents debate a sum over two turns: a user's own workflow (see team_of_three.py).

`experiments/debate.py` names it as `experiments.debate_team:Debate`.

The question: `3+1`, two digits 0..4; the answer is their sum (`4`). The debate is a
transcript both agents read; each turn adds the speaker's claim after a `|`:

    turn 1  a sees `3+1=`        and answers `4`
            b sees `3+1|4=`      (a's claim) and answers
    turn 2  a sees `3+1|4|5=`    (its own claim and b's) and answers again
            b sees `3+1|4|5|4=`  and answers again

Every answer is scored against the true sum, so an agent gains from a right claim before
it (it may repeat it) and loses by repeating a wrong one: each must learn when the other
is right. A speaker's claim is its group's most common digit answer; until it gives one,
the transcript carries the true sum instead, so neither agent waits for the other.

Rewards: partial credit (1.0 when exact); `correct` is the exact match.

Best constant answer (exact match; `best_constant_accuracy` enumerates the 25 questions):
5/25 = 0.2 for both agents (`4`, the most common sum).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Mapping, Sequence

import numpy as np

from flexmarl import tasks
from flexmarl.workflows.base import AgentClient, Completion, Episode, Query

MAX_DIGIT = 4
TURNS = 2


def _claim(answers: Sequence[Completion], truth: str) -> str:
  """The group's most common digit answer (the first seen among ties), else `truth`."""
  counts = collections.Counter(c.text for c in answers if len(c.text) == 1 and c.text.isdigit())
  return counts.most_common(1)[0][0] if counts else truth


class Debate:

  def __init__(self, first: str = 'a', second: str = 'b'):
    self.first, self.second = first, second

  def agent_names(self) -> Sequence[str]:
    return [self.first, self.second]

  def make_query(self, rng: np.random.Generator, query_id: str) -> Query:
    x, y = (int(v) for v in rng.integers(0, MAX_DIGIT + 1, size=2))
    return Query(query_id, f'{x}+{y}', answer=str(x + y), family='debate')

  async def run(self, query: Query, agents: Mapping[str, AgentClient]) -> Episode:
    episode = Episode()
    transcript = query.prompt
    for _ in range(TURNS):
      for speaker in (self.first, self.second):
        answers = await agents[speaker].generate(f'{transcript}=')
        for c in answers:
          episode.score(c, tasks.partial_credit(c.text, query.answer),
                        correct=c.text == query.answer, expected=query.answer)
        transcript += f'|{_claim(answers, query.answer)}'
    return episode


def best_constant_accuracy() -> dict[str, float]:
  """Each agent's exact-match rate of its best constant answer over the questions (every
  turn's answer is the sum, so both agents share it)."""
  digits = range(MAX_DIGIT + 1)
  sums = collections.Counter(str(x + y) for x, y in itertools.product(digits, digits))
  rate = sums.most_common(1)[0][1] / sum(sums.values())
  return {'a': rate, 'b': rate}
