"""A router and its specialists that talk in chat messages, on reasoning-gym tasks.

For real instruct models (their own tokenizer and chat template). Each specialist owns
one reasoning-gym dataset; a query is one problem of one of them (uniform mix). The
router is shown the problem and the experts' names and descriptions, and answers with
one name; the first of its samples that names an expert exactly decides who answers
(when none does, a fallback expert drawn with the query answers, so that an untrained
router cannot starve a specialist). The chosen specialist gets the problem with a
system message asking for the final answer only.

Rewards: a specialist earns the dataset's own score of its answer (partial credit
where the scorer gives it); an answer that is not in the asked form but ends with the
right answer ("8 + 5 = 13") earns `format_credit` times the score of its last word, so
that a base model's prose answers still rank above wrong ones and the group's gradient
points toward the bare answer. The router earns 1 for the expert that owns the problem's
dataset, `mention_credit` when its answer names that expert among other words and no
other expert (a base model's wordy answer still points the gradient the right way),
0 otherwise.

Held-out evaluation (`eval_queries`): `held_out` problems per dataset from a split
disjoint from training (`gym.GymTask`); a team answer is right when the router names
the right expert and that expert's answer scores 1.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np

from flexmarl.workflows.base import AgentClient, Completion, Episode, Query, ordered_pairs
from flexmarl.workflows.gym import GymTask

ANSWER_ONLY = 'Reply with the final answer only.'


def normalize(text: str) -> str:
  """An answer as compared: stripped, lower case, without a trailing full stop."""
  return text.strip().lower().rstrip('.').strip()


class ChatRouter:

  def __init__(self, router: str, specialists: Sequence[tuple[str, str]],
               datasets: Mapping[str, Mapping] | None = None,
               descriptions: Mapping[str, str] | None = None, held_out: int = 32,
               data_seed: int = 0, mention_credit: float = 0.25, format_credit: float = 0.5):
    """specialists: (reasoning-gym dataset, agent name) pairs; `datasets`: each dataset's
    config (its keyword arguments); `descriptions`: the router's one-line description
    of each agent (default: its dataset's name)."""
    pairs = ordered_pairs('specialists', specialists)
    self.router = router
    self.specialists = {dataset: agent for dataset, agent in pairs}
    datasets, descriptions = dict(datasets or {}), dict(descriptions or {})
    unknown = sorted(set(datasets) - set(self.specialists))
    if unknown:
      raise ValueError(f'workflow.datasets configures {unknown}, which no specialist owns; '
                       f'specialists own {list(self.specialists)}.')
    self.tasks = {d: GymTask(d, datasets.get(d), held_out, data_seed,
                             field=f'workflow.datasets.{d}') for d in self.specialists}
    self.held_out, self.mention_credit = held_out, float(mention_credit)
    self.format_credit = float(format_credit)
    experts = '\n'.join(f'- {agent}: {descriptions.get(agent, dataset.replace("_", " "))}'
                        for dataset, agent in self.specialists.items())
    self.router_system = (f'You route problems to experts. The experts:\n{experts}\n'
                          'Reply with the name of the expert for the problem, one word.')

  def agent_names(self) -> Sequence[str]:
    return [self.router, *self.specialists.values()]

  def _query(self, query_id: str, dataset: str, split: str, index: int, fallback: int) -> Query:
    entry = self.tasks[dataset].entry(split, index)
    return Query(query_id, entry['question'], str(entry['answer']), dataset,
                 {'split': split, 'index': index, 'fallback': fallback})

  def make_query(self, rng: np.random.Generator, query_id: str) -> Query:
    datasets = list(self.specialists)
    dataset = datasets[int(rng.integers(len(datasets)))]
    index = self.tasks[dataset].draw(rng)
    return self._query(query_id, dataset, 'train', index, int(rng.integers(len(datasets))))

  def eval_queries(self) -> list[Query]:
    """The held-out problems, datasets interleaved; each routed to its own expert when
    the router names none."""
    datasets = list(self.specialists)
    return [self._query(f'eval{i}_{d}', d, 'eval', i, datasets.index(d))
            for i in range(self.held_out) for d in datasets]

  def _route_reward(self, text: str, target: str) -> float:
    if normalize(text) == target:
      return 1.0
    words = set(re.findall(r'[a-z_]+', text.lower()))
    named = {a for a in self.specialists.values() if a.lower() in words}
    return self.mention_credit if named == {target.lower()} else 0.0

  async def _solve(self, agent: AgentClient, query: Query, episode: Episode) -> None:
    task = self.tasks[query.family]
    answers = await agent.generate([{'role': 'user',
                                     'content': f'{query.prompt}\n{ANSWER_ONLY}'}])
    split, index = query.meta['split'], query.meta['index']
    for c in answers:
      score = task.score(c.text, split, index)
      words = re.findall(r'[^\s]+', c.text)
      last = words[-1].rstrip('.') if words else ''
      if score < 1.0 and last and last != c.text.strip():
        score = max(score, self.format_credit * task.score(last, split, index))
      episode.score(c, score, correct=score >= 1.0)

  async def run(self, query: Query, agents: Mapping[str, AgentClient]) -> Episode:
    episode = Episode()
    routes: list[Completion] = await agents[self.router].generate(
        [{'role': 'system', 'content': self.router_system},
         {'role': 'user', 'content': query.prompt}])
    target = self.specialists[query.family]
    names = {a.lower(): a for a in self.specialists.values()}
    chosen = next((names[normalize(c.text)] for c in routes if normalize(c.text) in names),
                  list(self.specialists.values())[query.meta['fallback']])
    for c in routes:
      reward = self._route_reward(c.text, target.lower())
      episode.score(c, reward, correct=normalize(c.text) == target.lower())
    await self._solve(agents[chosen], query, episode)
    return episode
