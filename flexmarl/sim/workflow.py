"""The paper's router workload for the simulator: a router reads the query, then one of K
specialists (Zipf-skewed, the hot ones first) answers it.

The simulator measures time, not text: a prompt is `n` filler characters (n + 1 tokens
with the character tokenizer's BOS), so its length is what the setup says; the
specialist reads the query and the router's answer. Rewards are a fixed function of the
completion (its length's parity), so GRPO groups have some spread, and never matter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from flexmarl.tasks import zipf_probs
from flexmarl.workflows.base import AgentClient, Completion, Episode, Query

FILLER = 'a'


def lognormal_length(rng: np.random.Generator, median: float, sigma: float, max_len: int) -> int:
  return int(min(max_len, max(1, round(rng.lognormal(np.log(median), sigma)))))


class RouterWorkflow:

  def __init__(self, router: str, specialists: Sequence[str], zipf: float = 1.0,
               prompt_tokens: Mapping[str, float] | None = None,
               mix: Sequence[float] | None = None):
    """prompt_tokens: {'median', 'sigma', 'max'} of the query's length in tokens.
    mix: the share of queries each specialist gets, instead of Zipf(`zipf`) (e.g. where
    a real router was measured to send them)."""
    if not specialists:
      raise ValueError('workflow.specialists is empty; name at least one specialist agent.')
    self.router, self.specialists = router, list(specialists)
    self.probs = zipf_probs(len(self.specialists), zipf)
    if mix is not None:
      mix = np.asarray(mix, float)
      if mix.shape != (len(self.specialists),) or (mix < 0).any() or mix.sum() <= 0:
        raise ValueError(f'workflow.mix={list(mix)}: give one non-negative share per '
                         f'specialist ({self.specialists}), not all zero.')
      self.probs = mix / mix.sum()
    self.prompt_tokens = dict(prompt_tokens or dict(median=16, sigma=0.0, max=16))

  def agent_names(self) -> Sequence[str]:
    return [self.router, *self.specialists]

  def make_query(self, rng: np.random.Generator, query_id: str) -> Query:
    specialist = self.specialists[rng.choice(len(self.specialists), p=self.probs)]
    p = self.prompt_tokens
    n = lognormal_length(rng, p['median'], p['sigma'], int(p['max']))
    return Query(query_id, FILLER * n, family=specialist)

  @staticmethod
  def _score(episode: Episode, completions: list[Completion]) -> None:
    for c in completions:
      episode.score(c, float(len(c.text) % 2), correct=len(c.text) % 2 == 1)

  async def run(self, query: Query, agents: Mapping[str, AgentClient]) -> Episode:
    episode = Episode()
    routes = await agents[self.router].generate(query.prompt)
    self._score(episode, routes)
    answers = await agents[query.family].generate(query.prompt + routes[0].text)
    self._score(episode, answers)
    return episode
