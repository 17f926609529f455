"""The workflow API: user code that says which agent speaks when.

A workflow is an object with `async def run(query, agents) -> Episode`. It awaits
`agents[name].generate(prompt)`; independent branches are `asyncio.gather`. It
scores the completions it was given (`episode.score(...)`); the engine checks
that every scored completion was really served, and that every served one got a
score, so a workflow can neither invent a turn nor silently drop one.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

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

  sample_id: str  # {query_id}_{call}_{j} (flexmarl.data.sample_id.sample_id)
  agent: str
  text: str
  version: int  # the policy version that sampled it
  truncated: bool = False  # cut at its max_new_tokens before a stop token or stop string
  # The ids sampled (its stop token included): as an assistant message's content in a
  # later prompt of the same agent, these go in as they are (models/tokenizer.py).
  tokens: tuple[int, ...] = ()


@dataclasses.dataclass
class Episode:
  """What a workflow returns: a reward per completion, and optionally whether it is
  exactly right and what the right answer to its call was.

  A query may run several episodes side by side (a multi-turn team's `n` attempts at one
  problem, each turn one sample): `score(..., episode=i)` says which attempt a completion
  belongs to, and `outcome(i, value)` what attempt i earned as a whole. Agents credited
  by episode (`grpo.credit`, train/credit.py) learn from the outcomes; `score`'s reward is
  then the turn's own reward (a tool's verdict on that turn, 0 where there is none)."""

  rewards: dict[str, float] = dataclasses.field(default_factory=dict)
  correct: dict[str, bool] = dataclasses.field(default_factory=dict)
  expected: dict[str, str] = dataclasses.field(default_factory=dict)
  episode_of: dict[str, int] = dataclasses.field(default_factory=dict)  # sample → attempt
  outcomes: dict[int, float] = dataclasses.field(default_factory=dict)  # attempt → value

  def score(self, completion: Completion, reward: float, correct: bool | None = None,
            expected: str | None = None, episode: int | None = None) -> None:
    """Give `completion` its reward (a finite number), once. `expected`: the right
    answer to the call that sampled it (the same for every sample of one call), where the
    task has one; the run then weighs the agent's accuracy against the best constant
    answer's (`best_constant`, `balanced_accuracy` in its metrics). `episode`: the index
    of the side-by-side attempt the completion belongs to (see the class)."""
    sid = getattr(completion, 'sample_id', None)
    if not isinstance(completion, Completion):
      raise TypeError(f'episode.score({completion!r}, ...): pass a Completion that '
                      f'generate() returned, not a {type(completion).__name__}.')
    if sid in self.rewards:
      raise ValueError(f'sample {sid} is scored twice (rewards {self.rewards[sid]} and '
                       f'{reward!r}); score each completion once.')
    if episode is not None:
      self.episode_of[sid] = _episode_index(episode, f'episode.score({sid}, episode=...)')
    self.rewards[sid] = reward_value(reward, sid)
    if correct is not None:
      self.correct[sid] = bool(correct)
    if expected is not None:
      self.expected[sid] = str(expected)

  def outcome(self, episode: int, value: float) -> None:
    """What attempt `episode` earned as a whole (e.g. 1.0 solved, 0.0 not), once."""
    where = f'episode.outcome({episode!r}, ...)'
    episode = _episode_index(episode, where)
    if episode in self.outcomes:
      raise ValueError(f'{where}: attempt {episode} has an outcome already '
                       f'({self.outcomes[episode]}); give each attempt one.')
    self.outcomes[episode] = reward_value(value, f'of attempt {episode}')


def _episode_index(episode, where: str) -> int:
  if isinstance(episode, bool) or not isinstance(episode, numbers.Integral) or episode < 0:
    raise ValueError(f'{where}: episode={episode!r}; give the attempt\'s index, a whole '
                     'number >= 0.')
  return int(episode)


def ordered_pairs(field: str, value: Any) -> list[tuple[str, Any]]:
  """`value`, a list of (key, value) pairs whose order means something, as a list of tuples.

  A dict cannot carry that order through a config: ml_collections' ConfigDict sorts its
  keys, so `{'reverse': ..., 'add': ...}` would reach the workflow as `add, reverse`. A
  mapping of more than one entry is therefore refused, with the list to write instead.
  """
  if isinstance(value, Mapping) or hasattr(value, 'to_dict'):  # a dict or a ConfigDict
    items = list(value.items())
    if len(items) > 1:
      pairs = ', '.join(f'({k!r}, {v!r})' for k, v in items)
      raise ValueError(f'workflow.{field} is a dict, whose order a config loses (ConfigDict '
                       f'sorts its keys: {[k for k, _ in items]}). Fix: give a list of pairs in '
                       f'the order you mean, e.g. {field}=[{pairs}].')
    return [(str(k), v) for k, v in items]
  if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
    raise ValueError(f'workflow.{field}={value!r}: give a list of (key, value) pairs.')
  pairs = []
  for item in value:
    if isinstance(item, (str, bytes)) or not isinstance(item, Sequence) or len(item) != 2:
      raise ValueError(f'workflow.{field}: {item!r} is not a (key, value) pair; give a list '
                       'of pairs, e.g. [("reverse", "reverser"), ("add", "adder")].')
    pairs.append((str(item[0]), item[1]))
  keys = [k for k, _ in pairs]
  repeated = sorted({k for k in keys if keys.count(k) > 1})
  if repeated:
    raise ValueError(f'workflow.{field} names {repeated} more than once; name each key once.')
  return pairs


def reward_value(reward: Any, sample_id: str) -> float:
  """`reward` as a float; raises unless it is a finite real number (not a string, not None)."""
  if isinstance(reward, (str, bytes)) or not isinstance(reward, numbers.Real):
    raise TypeError(f'sample {sample_id}: reward={reward!r} ({type(reward).__name__}) is not a '
                    'number; give a float, e.g. 1.0 for a right answer and 0.0 otherwise.')
  if not math.isfinite(reward):
    raise ValueError(f'sample {sample_id}: reward={reward!r} is not finite; give a finite '
                     'float (check the reward function for 0/0 or log(0)).')
  return float(reward)


class AgentClient(Protocol):

  wanted: bool
  """Whether a batch still takes this agent's rows from this query. Always true but in
  training queries whose workflow declares its calls (`demand`, see `Workflow`); a call
  whose rows are not wanted may be left out when nothing else needs its answer."""

  async def generate(self, prompt: str | Sequence[Mapping[str, str]], n: int | None = None,
                     *, max_new_tokens: int | None = None,
                     stop: Sequence[str] = ()) -> list[Completion]:
    """Sample `n` responses (default: the agent's group size) to `prompt` — raw text, or
    chat messages (`[{'role': 'system' | 'user' | 'assistant', 'content': ...}, ...]`,
    several turns allowed) that the agent's tokenizer renders with its chat template and
    whose answer ends at the template's end-of-turn token — each at most
    `max_new_tokens` long (default and cap: the agent's `sampling.max_new_tokens`) and
    ending at the first of the `stop` strings (left out of the text, as in vLLM)."""


class Workflow(Protocol):
  """A multi-agent workflow plus the stream of queries it is trained on."""

  def agent_names(self) -> Sequence[str]:
    """Agents the workflow calls (checked against the config before any work)."""

  def make_query(self, rng: np.random.Generator, query_id: str) -> Query:
    ...

  async def run(self, query: Query, agents: Mapping[str, AgentClient]) -> Episode:
    ...

  # Optional: `def demand(self, query) -> dict[str, int] | None`, the generate calls a
  # training query makes of each agent (each one group of the agent's group size), when
  # known before it runs. The rollout then starts a query only while a batch still
  # takes its rows, skips one no batch takes, and tells the workflow which agents'
  # rows are wanted (`agents[name].wanted`): nothing is sampled in vain
  # (flexmarl/rollout/admission.py). The dry run checks it against the calls made.


@runtime_checkable
class HeldOut(Protocol):
  """What a workflow adds to be evaluated (optional: `config.eval_every`,
  `python -m flexmarl.evaluate`): problems kept out of its training stream."""

  def eval_queries(self) -> Sequence[Query]:
    """The held-out problems, the same on every call (flexmarl.rollout.held_out)."""
