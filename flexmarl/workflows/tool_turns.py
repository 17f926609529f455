"""A reasoner and a tool agent in turns, an environment checking every answer between them.

The reasoner answers a puzzle; the environment checks the answer and says what is wrong
(flexmarl/tasks/checkers.py); the tool agent, given the answer and the check, gives a
corrected answer, which the environment checks again; the reasoner then answers again,
its earlier answers, the checks and the tool's corrections in its conversation; and so
on, until an answer solves the puzzle or `turns` answers were given. As AT-GRPO lays
out its Sudoku and Plan-Path teams (arXiv 2510.11062), on reasoning-gym's
`mini_sudoku` and `shortest_path`.

Every answer earns its check's score as its turn reward; an attempt's outcome is its
last answer's score. How a query is run (flexmarl.workflows.turns):
- `branch=0` (the default): `attempts` attempts side by side, each turn one sample; the
  agents are credited by episode (`grpo.credit='episode'` or `'episode_agent'`);
- `branch=K`: one attempt, each turn K candidates scored by their check and the best
  carried on (AT-GRPO's agent-and-turn groups; `grpo.credit='call'`).
Held-out evaluation runs one attempt, one greedy answer a turn: a puzzle counts as
solved when the attempt's last answer solves it.

`reasoner == tool` makes one policy take every turn: the single-agent baseline. The
environment's words are prompt, never trained on; an agent's own earlier answers go
back into its conversation as the exact tokens it sampled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flexmarl.tasks.checkers import CHECKERS, Check
from flexmarl.tasks.gym import GymTask
from flexmarl.workflows.base import AgentClient, Completion, Episode, Query
from flexmarl.workflows.turns import attempts, best_of, conversation

ANSWER_ONLY = 'Reply with the answer only, in the format the puzzle asks for.'


class ToolTurns:

  def __init__(self, reasoner: str = 'reasoner', tool: str = 'tool',
               dataset: str = 'mini_sudoku', dataset_config: Mapping | None = None,
               turns: int = 4, attempts: int = 4, branch: int = 0, held_out: int = 32,
               data_seed: int = 0):
    if dataset not in CHECKERS:
      raise ValueError(f'workflow.dataset={dataset!r}: tool_turns checks answers to '
                       f'{sorted(CHECKERS)}; add a checker to flexmarl/tasks/checkers.py '
                       'for another.')
    for name, value, low in (('turns', turns, 1), ('attempts', attempts, 1),
                             ('branch', branch, 0), ('held_out', held_out, 0)):
      if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f'workflow.{name}={value!r}: give a whole number >= {low}.')
    self.reasoner, self.tool, self.turns = reasoner, tool, turns
    self.attempts, self.branch, self.held_out = attempts, branch, held_out
    self.dataset, self.check_answer = dataset, CHECKERS[dataset]
    self.gym = GymTask(dataset, dataset_config, held_out, data_seed,
                       field='workflow.dataset_config')
    self._entries: dict[tuple[str, int], dict] = {}

  def agent_names(self) -> Sequence[str]:
    return list(dict.fromkeys([self.reasoner, self.tool]))

  def make_query(self, rng, query_id: str) -> Query:
    return self._query(query_id, 'train', self.gym.draw(rng))

  def eval_queries(self) -> list[Query]:
    return [self._query(f'eval{i}', 'eval', i) for i in range(self.held_out)]

  def _query(self, query_id: str, split: str, index: int) -> Query:
    entry = self.gym.entry(split, index)
    return Query(query_id, entry['question'], str(entry['answer']), self.dataset,
                 {'split': split, 'index': index})

  def check(self, query: Query, text: str) -> Check:
    """The environment's check of an answer to `query` (its entry made once per query:
    reasoning-gym makes a puzzle anew at every call)."""
    key = (query.meta['split'], query.meta['index'])
    if key not in self._entries:
      if len(self._entries) >= 4096:
        self._entries.clear()
      self._entries[key] = self.gym.entry(*key)
    return self.check_answer(self._entries[key], text)

  # -- the prompts ---------------------------------------------------------------------

  def _reasoner_prompt(self, query: Query, turns: list[tuple[Completion, str]]) -> Any:
    return conversation('', f'{query.prompt}\n{ANSWER_ONLY}', turns)

  def _tool_prompt(self, query: Query, answer: Completion, found: Check) -> Any:
    return [{'role': 'user', 'content': f'{query.prompt}\nProposed answer:\n{answer.text}\n'
                                        f'A checker found: {found.feedback}.\n'
                                        f'Give the corrected answer. {ANSWER_ONLY}'}]

  # -- one attempt ---------------------------------------------------------------------

  async def _attempt(self, i: int, first: Completion | None, query: Query,
                     agents: Mapping[str, AgentClient], episode: Episode) -> None:
    """Attempt `i`, from its first answer (None: this attempt asks for it itself)."""
    turns: list[tuple[Completion, str]] = []  # the reasoner's answers and what followed
    answer, found = (await self._turn(agents[self.reasoner],
                                      self._reasoner_prompt(query, turns), query, episode, i)
                     if first is None else self._scored(first, query, episode, i))
    for given in range(1, self.turns):
      if found.solved:
        break
      if given % 2:  # the tool's turn: correct the answer it is shown
        fix, after = await self._turn(agents[self.tool], self._tool_prompt(query, answer, found),
                                      query, episode, i)
        verdict = 'accepts it' if after.solved else f'found: {after.feedback}'
        turns.append((answer, f'A checker found: {found.feedback}. A tool proposed:\n'
                              f'{fix.text}\nThe checker {verdict}. Answer again. {ANSWER_ONLY}'))
        answer, found = fix, after
      else:  # the reasoner's: answer again, the whole exchange in its conversation
        answer, found = await self._turn(agents[self.reasoner],
                                         self._reasoner_prompt(query, turns), query, episode, i)
    episode.outcome(i, found.score)

  def _scored(self, c: Completion, query: Query, episode: Episode, i: int
              ) -> tuple[Completion, Check]:
    found = self.check(query, c.text)
    episode.score(c, found.score, correct=found.solved, expected=query.answer, episode=i)
    return c, found

  async def _turn(self, agent: AgentClient, prompt: Any, query: Query, episode: Episode,
                  i: int) -> tuple[Completion, Check]:
    """One answer of attempt `i` and its check: one sample, or (branch=K) K candidates,
    each scored, and the best."""
    if self.branch:
      best = await best_of(agent, prompt, self.branch, episode,
                           lambda c: (self.check(query, c.text).score,
                                      self.check(query, c.text).solved),
                           episode_index=i, expected=query.answer)
      return best, self.check(query, best.text)
    [c] = await agent.generate(prompt, n=1)
    return self._scored(c, query, episode, i)

  async def run(self, query: Query, agents: Mapping[str, AgentClient]) -> Episode:
    episode = Episode()
    if self.branch:  # one attempt, its turns branched
      await self._attempt(0, None, query, agents, episode)
      return episode
    await attempts(agents[self.reasoner], self._reasoner_prompt(query, []), self.attempts,
                   lambda i, first: self._attempt(i, first, query, agents, episode))
    return episode
