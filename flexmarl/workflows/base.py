"""The workflow API: user code that says which agent speaks when.

A workflow is an object with `async def run(query, agents) -> Episode`. It awaits
`agents[name].generate(prompt)`; independent branches are `asyncio.gather`. It
scores the completions it was given (`episode.score(...)`); the engine checks
that every scored completion was really served, and that every served one got a
score, so a workflow can neither invent a turn nor silently drop one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np


@dataclasses.dataclass(frozen=True)
class Query:
  query_id: str
  prompt: str
  answer: str = ''
  family: str = ''
  meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Completion:
  """One sampled response, as the workflow sees it."""

  sample_id: str  # {query_id}_{turn}_{trajectory_id}
  agent: str
  text: str
  version: int  # the policy version that sampled it


@dataclasses.dataclass
class Episode:
  """What a workflow returns: a reward (and optionally exactness) per completion."""

  rewards: dict[str, float] = dataclasses.field(default_factory=dict)
  correct: dict[str, bool] = dataclasses.field(default_factory=dict)

  def score(self, completion: Completion, reward: float, correct: bool | None = None) -> None:
    self.rewards[completion.sample_id] = float(reward)
    if correct is not None:
      self.correct[completion.sample_id] = bool(correct)


class AgentClient(Protocol):

  async def generate(self, prompt: str, n: int | None = None) -> list[Completion]:
    """Sample `n` responses (default: the agent's group size) to `prompt`."""


class Workflow(Protocol):
  """A multi-agent workflow plus the stream of queries it is trained on."""

  def agent_names(self) -> Sequence[str]:
    """Agents the workflow calls (checked against the config before any work)."""

  def make_query(self, rng: np.random.Generator, query_id: str) -> Query:
    ...

  async def run(self, query: Query, agents: Mapping[str, AgentClient]) -> Episode:
    ...
