"""A planner, a worker called twice in parallel, and a judge: a user's own workflow.

It lives outside `flexmarl/` on purpose: `experiments/planner_workers_judge.py` names it
as `experiments.team_of_three:PlannerWorkersJudge`, the way a user runs a workflow of
their own from the command line (see docs/workflows.md).

The task: `dbl:3,1` asks to apply an operation to two digits and report the larger
result (here max(2*3, 2*1) = 6). Three operations, on digits 0..4:

    inc  x + 1     (plan '+')
    dbl  2 * x     (plan '*')
    cmp  4 - x     (plan '-', the complement)

- planner sees `dbl:3,1?` and answers the plan symbol of the operation (`*`);
- worker is called twice at once (`asyncio.gather`), once per half: `*3=` and `*1=`,
  and answers the operation applied to its digit (`6`, `2`). The plan it is given is the
  planner group's most common valid symbol; it is scored against the plan it was given
  (its job is to follow the plan), so it learns while the planner is still wrong;
- judge sees the two halves' results, `6,2=`, and answers the larger (`6`). Each half's
  result is the worker group's most common digit answer.

Until an agent gives a valid answer (a plan symbol, a digit), the next agent is given the
true value instead, so no agent waits for the one before it to learn.

Rewards: per-position partial credit (1.0 when exact), so random policies get a
signal before their first exact hit; `correct` is the exact match. With
`planner_reward='outcome'` the planner is paid only through the others' work: each
distinct valid plan among its samples is carried out (worker twice, judge once) and each
sample earns 1 when its plan's final answer (the judge group's most common verdict) is
the query's answer, else 0; `correct` stays the exact plan.

Best constant answer (exact match, the task distribution with right upstream answers;
`best_constant_accuracy` enumerates it): planner 1/3 = 0.333 (any symbol),
worker 3/15 = 0.200 (`2` or `4`), judge 21/75 = 0.280 (`4`).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from flexmarl import tasks
from flexmarl.workflows.base import AgentClient, Completion, Episode, Query

MAX_DIGIT = 4
# name in the query -> (plan symbol, operation on one digit)
OPERATIONS: dict[str, tuple[str, Callable[[int], int]]] = {
    'inc': ('+', lambda x: x + 1),
    'dbl': ('*', lambda x: 2 * x),
    'cmp': ('-', lambda x: MAX_DIGIT - x),
}
BY_SYMBOL = {symbol: op for symbol, op in OPERATIONS.values()}


def _majority(texts: Sequence[str], valid: Callable[[str], bool]) -> str | None:
  """The most common valid text (the first seen among ties), or None."""
  counts = collections.Counter(t for t in texts if valid(t))
  return counts.most_common(1)[0][0] if counts else None


def _is_digit(text: str) -> bool:
  return len(text) == 1 and text.isdigit()


class PlannerWorkersJudge:

  def __init__(self, planner: str = 'planner', worker: str = 'worker', judge: str = 'judge',
               planner_reward: str = 'plan'):
    if planner_reward not in ('plan', 'outcome'):
      raise ValueError(f"workflow.planner_reward={planner_reward!r}: give 'plan' (scored "
                       "against the right plan) or 'outcome' (paid by the team's final "
                       'answer under its plan).')
    self.planner, self.worker, self.judge = planner, worker, judge
    self.planner_reward = planner_reward

  def agent_names(self) -> Sequence[str]:
    return [self.planner, self.worker, self.judge]

  def make_query(self, rng: np.random.Generator, query_id: str) -> Query:
    name = list(OPERATIONS)[int(rng.integers(len(OPERATIONS)))]
    x, y = (int(v) for v in rng.integers(0, MAX_DIGIT + 1, size=2))
    symbol, op = OPERATIONS[name]
    return Query(query_id, f'{name}:{x},{y}', answer=str(max(op(x), op(y))), family=name,
                 meta={'symbol': symbol, 'digits': (x, y)})

  def _score(self, episode: Episode, answers: Sequence[Completion], truth: str) -> None:
    for c in answers:
      episode.score(c, tasks.partial_credit(c.text, truth), correct=c.text == truth,
                    expected=truth)

  async def _work(self, agents: Mapping[str, AgentClient], plan: str, x: int,
                  episode: Episode) -> int:
    """One half: the worker applies `plan` to `x`; gives the half's result as a digit."""
    truth = str(BY_SYMBOL[plan](x))
    answers = await agents[self.worker].generate(f'{plan}{x}=')
    self._score(episode, answers, truth)
    return int(_majority([c.text for c in answers], _is_digit) or truth)

  async def _carry_out(self, agents: Mapping[str, AgentClient], plan: str, query: Query,
                       episode: Episode) -> str | None:
    """The worker on both digits under `plan`, then the judge; gives the judge group's
    most common verdict (None if none is a digit)."""
    # The middle agent, twice at once: the engine batches both requests.
    left, right = await asyncio.gather(
        *[self._work(agents, plan, x, episode) for x in query.meta['digits']])
    verdicts = await agents[self.judge].generate(f'{left},{right}=')
    self._score(episode, verdicts, str(max(left, right)))
    return _majority([c.text for c in verdicts], _is_digit)

  async def run(self, query: Query, agents: Mapping[str, AgentClient]) -> Episode:
    episode = Episode()
    plans = await agents[self.planner].generate(f'{query.prompt}?')
    symbol = query.meta['symbol']
    if self.planner_reward == 'plan':
      self._score(episode, plans, symbol)
      plan = _majority([c.text for c in plans], BY_SYMBOL.__contains__) or symbol
      await self._carry_out(agents, plan, query, episode)
      return episode
    # 'outcome': every distinct plan carried out, each sample paid by its plan's result.
    tried = [t for t in dict.fromkeys(c.text for c in plans) if t in BY_SYMBOL] or [None]
    finals = await asyncio.gather(
        *[self._carry_out(agents, plan or symbol, query, episode) for plan in tried])
    right = {plan: final == query.answer for plan, final in zip(tried, finals)}
    for c in plans:
      episode.score(c, float(right.get(c.text, False)), correct=c.text == symbol,
                    expected=symbol)
    return episode


def best_constant_accuracy() -> dict[str, float]:
  """Each agent's exact-match rate of its best constant answer, over the task distribution
  (uniform operation and digits; upstream agents answering right)."""
  digits = range(MAX_DIGIT + 1)
  per_agent = {'planner': [], 'worker': [], 'judge': []}
  for name, x, y in itertools.product(OPERATIONS, digits, digits):
    symbol, op = OPERATIONS[name]
    per_agent['planner'].append(symbol)
    per_agent['worker'] += [str(op(x)), str(op(y))]
    per_agent['judge'].append(str(max(op(x), op(y))))
  return {agent: collections.Counter(truths).most_common(1)[0][1] / len(truths)
          for agent, truths in per_agent.items()}
