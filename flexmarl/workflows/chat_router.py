"""A router and its specialists that talk in chat messages, on reasoning-gym tasks.

For real instruct models (their own tokenizer and chat template). Each specialist owns
one reasoning-gym dataset and is named by a word for its kind of problem ("sum", "product");
a query is one problem of one of them (uniform mix). The router is shown the problem and
asked which kind it is, naming the specialists. Who answers: in held-out evaluation the
first of the router's answers that names exactly one specialist (when none does, the
query's own), so that team accuracy is the pipeline's; in training, with
`train_routing='owner'` (the default), the specialist that owns the problem, while the
router learns from its routing reward alone: a base model that names one specialist far
more often than the other would otherwise starve the other of its own problems
(measured on SmolLM2: the gcd specialist got no batch in 15 steps). Such a problem's two
calls are then independent: they run at once, and each is left out when its agent's
batch takes no more rows (`demand`, rollout/admission.py). `'router'` routes training
problems as evaluation does. The chosen specialist gets the problem and is
asked for the final answer only.

Answers are read as small instruct models write them: the router's answer names the
specialist it names, wherever the word stands ("This problem is a sum." names `sum`); a
specialist's answer is its whole text, or else its last word ("The final answer is 13."
answers 13). That is what `correct` (and held-out accuracy) counts. Rewards: the router
earns 1 for naming the specialist that owns the problem's dataset alone, 0 otherwise; a
specialist earns the dataset's own score of its answer (partial credit where the scorer
gives it), times `format_credit` when the answer had to be read off its last word, so
that the bare answer is what the policy moves toward.

Held-out evaluation (`eval_queries`): `held_out` problems per dataset from a split
disjoint from training (`gym.GymTask`); a team answer is right when the router names
the right specialist and that specialist's answer is right.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping, Sequence

import numpy as np

from flexmarl.tasks.gym import GymTask
from flexmarl.workflows.base import AgentClient, Completion, Episode, Query, ordered_pairs

ANSWER_ONLY = 'Reply with the final answer only.'


class ChatRouter:

  def __init__(self, router: str, specialists: Sequence[tuple[str, str]],
               datasets: Mapping[str, Mapping] | None = None, held_out: int = 32,
               data_seed: int = 0, format_credit: float = 0.8, train_routing: str = 'owner'):
    """specialists: (reasoning-gym dataset, agent name) pairs, each agent named by a word
    for its kind of problem; `datasets`: each dataset's config (its keyword arguments)."""
    pairs = ordered_pairs('specialists', specialists)
    self.router = router
    self.specialists = {dataset: agent for dataset, agent in pairs}
    datasets = dict(datasets or {})
    unknown = sorted(set(datasets) - set(self.specialists))
    if unknown:
      raise ValueError(f'workflow.datasets configures {unknown}, which no specialist owns; '
                       f'specialists own {list(self.specialists)}.')
    self.tasks = {d: GymTask(d, datasets.get(d), held_out, data_seed,
                             field=f'workflow.datasets.{d}') for d in self.specialists}
    if train_routing not in ('owner', 'router'):
      raise ValueError(f"workflow.train_routing={train_routing!r}: give 'owner' (training "
                       "problems go to the specialist that owns them) or 'router' (to the "
                       "router's choice, as in evaluation).")
    self.held_out, self.format_credit = held_out, float(format_credit)
    self.train_routing = train_routing
    names = ' or '.join(self.specialists.values())
    self.router_question = f'Is this problem a {names}? Reply with one word: {names}.'

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

  def named(self, text: str) -> str | None:
    """The specialist a router's answer names, if it names exactly one."""
    words = set(re.findall(r'[a-z0-9_]+', text.lower()))
    named = [a for a in self.specialists.values() if a.lower() in words]
    return named[0] if len(named) == 1 else None

  async def _solve(self, agent: AgentClient, query: Query, episode: Episode) -> None:
    task = self.tasks[query.family]
    answers = await agent.generate([{'role': 'user',
                                     'content': f'{query.prompt}\n{ANSWER_ONLY}'}])
    split, index = query.meta['split'], query.meta['index']
    for c in answers:
      score = task.score(c.text, split, index)
      right = score >= 1.0
      words = c.text.split()
      if not right and len(words) > 1:  # read the answer off its last word
        last = task.score(words[-1].rstrip('.'), split, index)
        score, right = max(score, self.format_credit * last), last >= 1.0
      episode.score(c, score, correct=right, expected=str(task.entry(split, index)['answer']))

  def _owner_routed(self, query: Query) -> bool:
    return query.meta['split'] == 'train' and self.train_routing == 'owner'

  def demand(self, query: Query) -> dict[str, int] | None:
    """Owner-routed training problems call the router and the owner once each, known
    before they run (rollout/admission.py); where the router's answer picks the
    specialist, who is called is not known in advance."""
    if not self._owner_routed(query):
      return None
    return {self.router: 1, self.specialists[query.family]: 1}

  async def run(self, query: Query, agents: Mapping[str, AgentClient]) -> Episode:
    episode = Episode()
    target = self.specialists[query.family]
    if self._owner_routed(query):
      # Neither call needs the other's answer: both at once, leaving out the one whose
      # rows no batch takes this step.
      calls = []
      if agents[self.router].wanted:
        calls.append(self._route(agents[self.router], query, episode))
      if agents[target].wanted:
        calls.append(self._solve(agents[target], query, episode))
      await asyncio.gather(*calls)
      return episode
    named = await self._route(agents[self.router], query, episode)
    chosen = next((n for n in named if n is not None),
                  list(self.specialists.values())[query.meta['fallback']])
    await self._solve(agents[chosen], query, episode)
    return episode

  async def _route(self, agent: AgentClient, query: Query, episode: Episode
                   ) -> list[str | None]:
    """Ask the router; score each answer by whether it names the owner alone. Returns
    the specialist each answer names."""
    routes: list[Completion] = await agent.generate(
        [{'role': 'user', 'content': f'{query.prompt}\n\n{self.router_question}'}])
    target = self.specialists[query.family]
    named = [self.named(c.text) for c in routes]
    for c, name in zip(routes, named):
      episode.score(c, float(name == target), correct=name == target, expected=target)
    return named
