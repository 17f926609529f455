"""A solver and a checker in rounds: the checker's verdict goes back to the solver.

The solver answers a problem; the checker says whether the answer is right; on a
rejection the solver answers again, its earlier answers and the verdicts in its prompt,
up to `rounds` answers. An attempt's outcome is its last answer's score (1.0 exactly
right). Turn rewards: a solver turn earns its answer's score, a checker turn 1 for the
right verdict.

How a query is run (flexmarl.workflows.turns):
- `branch=0` (the default): `attempts` attempts side by side, each turn one sample; the
  agents are credited by episode (`grpo.credit='episode'` or `'episode_agent'`);
- `branch=K`: one attempt, each turn K candidates scored by their turn reward and the
  best carried on (AT-GRPO's agent-and-turn groups; `grpo.credit='call'`).
Held-out evaluation runs one attempt, one greedy answer a turn: a problem counts as
solved when the attempt's last answer is right.

Two kinds of problems:
- `family` (the built-in toy tasks, flexmarl.tasks): raw-text prompts for character
  models — the solver sees `1+2=`, then `1+2=4:n 1+2=` after a rejection, the checker
  `1+2=3?` and answers `y` or `n`;
- `dataset` (a reasoning-gym dataset, flexmarl.tasks.gym): chat messages for instruct
  models, the solver's own earlier turns going back as the exact tokens it sampled.
`solver == checker` makes one policy take every turn: the single-agent baseline.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from flexmarl import tasks
from flexmarl.tasks.gym import GymTask
from flexmarl.workflows.base import AgentClient, Completion, Episode, Query
from flexmarl.workflows.turns import attempts, best_of, conversation

ANSWER_ONLY = 'Reply with the final answer only.'
CHECK = 'Is this answer correct? Reply with yes or no.'
RETRY = f'A checker says this answer is wrong. Try again. {ANSWER_ONLY}'


class SolverCheckerRounds:

  def __init__(self, solver: str = 'solver', checker: str = 'checker', family: str = '',
               task_args: Mapping | None = None, dataset: str = '',
               dataset_config: Mapping | None = None, rounds: int = 2, attempts: int = 4,
               branch: int = 0, held_out: int = 32, data_seed: int = 0):
    if bool(family) == bool(dataset):
      raise ValueError(f'workflow: give a toy task family (family=, one of '
                       f'{sorted(tasks.FAMILIES)}) or a reasoning-gym dataset (dataset=), '
                       f'one of them (got family={family!r}, dataset={dataset!r}).')
    for name, value, low in (('rounds', rounds, 1), ('attempts', attempts, 1),
                             ('branch', branch, 0), ('held_out', held_out, 0)):
      if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f'workflow.{name}={value!r}: give a whole number >= {low}.')
    if family and family not in tasks.FAMILIES:
      raise ValueError(f'workflow.family={family!r} is unknown; known: {sorted(tasks.FAMILIES)}.')
    self.solver, self.checker, self.rounds = solver, checker, rounds
    self.attempts, self.branch, self.held_out = attempts, branch, held_out
    self.family, self.dataset = family, dataset
    self.task_args = tasks.check_task_args(family, task_args or {}, 'workflow.task_args') \
        if family else {}
    self.gym = GymTask(dataset, dataset_config, held_out, data_seed,
                       field='workflow.dataset_config') if dataset else None

  def agent_names(self) -> Sequence[str]:
    return list(dict.fromkeys([self.solver, self.checker]))

  def make_query(self, rng: np.random.Generator, query_id: str) -> Query:
    if self.gym is not None:
      return self._gym_query(query_id, 'train', self.gym.draw(rng))
    task = tasks.FAMILIES[self.family](rng, **self.task_args)
    return Query(query_id, task.prompt, task.answer, self.family, {'split': 'train'})

  def eval_queries(self) -> list[Query]:
    """Held-out problems: a reasoning-gym split, or toy problems from their own seed."""
    if self.gym is not None:
      return [self._gym_query(f'eval{i}', 'eval', i) for i in range(self.held_out)]
    rng = np.random.default_rng([7919, self.held_out])  # apart from the training stream's
    out = []
    for i in range(self.held_out):
      task = tasks.FAMILIES[self.family](rng, **self.task_args)
      out.append(Query(f'eval{i}', task.prompt, task.answer, self.family, {'split': 'eval'}))
    return out

  def _gym_query(self, query_id: str, split: str, index: int) -> Query:
    entry = self.gym.entry(split, index)
    return Query(query_id, entry['question'], str(entry['answer']), self.dataset,
                 {'split': split, 'index': index})

  # -- the problem's words, per kind ---------------------------------------------------

  def _score(self, query: Query, text: str) -> float:
    if self.gym is None:
      return tasks.partial_credit(text, query.answer)
    return self.gym.score(text.strip(), query.meta['split'], query.meta['index'])

  def _solver_prompt(self, query: Query, turns: list[tuple[Completion, str]]) -> Any:
    if self.gym is None:
      return ''.join(f'{query.prompt}={c.text}:{v} ' for c, v in turns) + f'{query.prompt}='
    return conversation('', f'{query.prompt}\n{ANSWER_ONLY}', turns)

  def _checker_prompt(self, query: Query, answer: Completion) -> Any:
    if self.gym is None:
      return f'{query.prompt}={answer.text}?'
    return [{'role': 'user', 'content': f'{query.prompt}\nProposed answer: {answer.text}\n'
                                        f'{CHECK}'}]

  def _accepts(self, verdict: str) -> bool | None:
    """What a checker's answer says: accepted, rejected, or None (neither)."""
    if self.gym is None:
      return {'y': True, 'n': False}.get(verdict.strip())
    words = set(re.findall(r'[a-z]+', verdict.lower()))
    return True if 'yes' in words and 'no' not in words else (
        False if 'no' in words and 'yes' not in words else None)

  @property
  def _verdicts(self) -> dict[bool, str]:
    """The checker's right verdict on a right (True) and a wrong answer."""
    return {True: 'y', False: 'n'} if self.gym is None else {True: 'yes', False: 'no'}

  def _retry(self) -> str:
    return 'n' if self.gym is None else RETRY

  # -- one attempt -------------------------------------------------------------------

  async def _attempt(self, i: int, first: Completion | None, query: Query,
                     agents: Mapping[str, AgentClient], episode: Episode) -> None:
    """Attempt `i`, from its first answer (None: this attempt asks for it itself)."""
    score = lambda c: self._score(query, c.text)
    solved = lambda c: score(c) >= 1.0
    turns: list[tuple[Completion, str]] = []

    async def solve() -> Completion:
      return await self._turn(agents[self.solver], self._solver_prompt(query, turns), episode,
                              i, score, solved, query.answer)
    if first is None:
      answer = await solve()
    else:
      answer = first
      episode.score(first, score(first), correct=solved(first), expected=query.answer,
                    episode=i)
    for _ in range(self.rounds - 1):
      right = solved(answer)
      verdict = await self._turn(agents[self.checker], self._checker_prompt(query, answer),
                                 episode, i, lambda c: float(self._accepts(c.text) == right),
                                 lambda c: self._accepts(c.text) == right,
                                 self._verdicts[right])
      if self._accepts(verdict.text):
        break
      turns.append((answer, self._retry()))
      answer = await solve()
    episode.outcome(i, score(answer))

  async def _turn(self, agent: AgentClient, prompt: Any, episode: Episode, i: int,
                  reward, correct, expected: str) -> Completion:
    """One turn of attempt `i`: one sample, or (branch=K) K candidates and the best."""
    judge = lambda c: (float(reward(c)), bool(correct(c)))
    if self.branch:
      return await best_of(agent, prompt, self.branch, episode, judge, episode_index=i,
                           expected=expected)
    [c] = await agent.generate(prompt, n=1)
    value, right = judge(c)
    episode.score(c, value, correct=right, expected=expected, episode=i)
    return c

  async def run(self, query: Query, agents: Mapping[str, AgentClient]) -> Episode:
    episode = Episode()
    if self.branch:  # one attempt, its turns branched
      await self._attempt(0, None, query, agents, episode)
      return episode
    await attempts(agents[self.solver], self._solver_prompt(query, []), self.attempts,
                   lambda i, first: self._attempt(i, first, query, agents, episode))
    return episode
