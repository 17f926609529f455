"""RolloutEngine: runs workflows concurrently and batches their requests.

Every query's workflow runs as an asyncio task. When all of them are waiting on
`generate`, the engine serves one *round*: per agent, it gathers the waiting
requests (in query/turn order, so batches never depend on arrival timing), draws
each sample with a key derived from (seed, agent, version, sample_id), and hands
the completions back. It records every turn it served; `run` returns them with
the workflow's scores, after checking the two agree.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from flexmarl.rollout.sampler import Sampler, SamplingParams, sample_key
from flexmarl.tokenizer import TextTokenizer
from flexmarl.workflows.base import Completion, Episode, Query, Workflow


@dataclasses.dataclass
class Turn:
  """One served request: a GRPO group of `len(tokens)` samples of one prompt."""

  query_id: str
  turn: int
  agent: str
  version: int
  prompt_ids: list[int]
  sample_ids: list[str]
  tokens: list[np.ndarray]  # each: response ids incl. EOS, unpadded
  logprobs: list[np.ndarray]


@dataclasses.dataclass
class EpisodeResult:
  query: Query
  index: int  # position of the query in the run's stream
  turns: list[Turn]
  episode: Episode


@dataclasses.dataclass
class _Request:
  index: int
  query_id: str
  turn: int
  agent: str
  prompt: str
  n: int
  future: asyncio.Future


class _Client:
  """`agents[name]` inside one query's workflow."""

  def __init__(self, name: str, ctx: '_QueryContext'):
    self.name, self._ctx = name, ctx

  async def generate(self, prompt: str, n: int | None = None) -> list[Completion]:
    return await self._ctx.submit(self.name, prompt, n)


class _QueryContext:

  def __init__(self, engine: 'RolloutEngine', query: Query, index: int,
               pending: list[_Request]):
    self.engine, self.query, self.index, self.pending = engine, query, index, pending
    self.turns: list[Turn] = []
    self._next_turn = 0

  def submit(self, agent: str, prompt: str, n: int | None) -> asyncio.Future:
    if agent not in self.engine.samplers:
      raise KeyError(f'workflow asked for agent {agent!r}; configured agents: '
                     f'{sorted(self.engine.samplers)}.')
    n = self.engine.group_sizes[agent] if n is None else n
    if n < 1:
      raise ValueError(f'generate(n={n}) for agent {agent!r}: n must be >= 1.')
    future = asyncio.get_running_loop().create_future()
    self.pending.append(_Request(self.index, self.query.query_id, self._next_turn, agent,
                                 prompt, n, future))
    self._next_turn += 1
    return future


class RolloutEngine:
  """Serves workflow requests from one sampler per agent."""

  def __init__(self, samplers: Mapping[str, Sampler], sampling: Mapping[str, SamplingParams],
               group_sizes: Mapping[str, int], tokenizer: TextTokenizer, seed: int):
    self.samplers = dict(samplers)
    self.sampling = dict(sampling)
    self.group_sizes = dict(group_sizes)
    self.tokenizer = tokenizer
    self.seed = seed
    # One private loop for every rollout: a fresh loop per wave (asyncio.run) costs
    # more than a small model's whole generation step.
    self._loop = asyncio.new_event_loop()

  def run(self, workflow: Workflow, queries: Sequence[Query], first_index: int = 0
          ) -> list[EpisodeResult]:
    """Roll out `queries` to completion; results in query order.

    Works from plain code and from inside a running event loop (a notebook): there
    the rollout gets its own loop on a worker thread.
    """
    run = lambda: self._loop.run_until_complete(self._run(workflow, queries, first_index))
    try:
      asyncio.get_running_loop()
    except RuntimeError:
      return run()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      return pool.submit(run).result()

  async def _run(self, workflow: Workflow, queries: Sequence[Query], first_index: int):
    pending: list[_Request] = []
    contexts = [_QueryContext(self, q, first_index + i, pending) for i, q in enumerate(queries)]

    async def episode(ctx: _QueryContext) -> Episode:
      clients = {name: _Client(name, ctx) for name in self.samplers}
      return await workflow.run(ctx.query, clients)

    tasks = [asyncio.create_task(episode(ctx)) for ctx in contexts]
    try:
      while True:
        await self._settle(tasks, pending)
        if all(t.done() for t in tasks):
          break
        if pending:
          batch, pending[:] = list(pending), []
          self._serve(batch, contexts, first_index)
        else:  # a workflow awaits something other than generate (a tool, a timer)
          await asyncio.sleep(0.001)
      episodes = [t.result() for t in tasks]  # raises the first workflow error
    finally:
      for t in tasks:
        t.cancel()
    return [self._check(ctx, ep) for ctx, ep in zip(contexts, episodes)]

  @staticmethod
  async def _settle(tasks, pending: list[_Request], quiet_rounds: int = 3) -> None:
    """Yield to the workflows until none makes progress for a few loop turns."""
    last, quiet = None, 0
    while quiet < quiet_rounds:
      await asyncio.sleep(0)
      now = (len(pending), sum(t.done() for t in tasks))
      quiet = quiet + 1 if now == last else 0
      last = now

  def _serve(self, requests: list[_Request], contexts: list[_QueryContext],
             first_index: int) -> None:
    """One round: one batched generate per agent, requests in (query, turn) order."""
    requests.sort(key=lambda r: (r.index, r.turn))
    for agent in self.samplers:
      mine = [r for r in requests if r.agent == agent]
      if not mine:
        continue
      sampler = self.samplers[agent]
      version = sampler.version
      prompts, sample_ids = [], []
      for r in mine:
        ids = self.tokenizer.encode(r.prompt)
        for j in range(r.n):
          prompts.append(ids)
          sample_ids.append(f'{r.query_id}_{r.turn}_{j}')
      keys = np.stack([sample_key(self.seed, agent, version, s) for s in sample_ids])
      out = sampler.generate(prompts, keys, self.sampling[agent])
      row = 0
      for r in mine:
        rows = range(row, row + r.n)
        row += r.n
        tokens = [out.tokens[i, :out.lengths[i]] for i in rows]
        turn = Turn(r.query_id, r.turn, agent, version, prompts[rows[0]],
                    [sample_ids[i] for i in rows], tokens,
                    [out.logprobs[i, :out.lengths[i]] for i in rows])
        contexts[r.index - first_index].turns.append(turn)
        r.future.set_result([
            Completion(sid, agent, self.tokenizer.decode(t), version)
            for sid, t in zip(turn.sample_ids, tokens)])

  @staticmethod
  def _check(ctx: _QueryContext, episode: Episode) -> EpisodeResult:
    if not isinstance(episode, Episode):
      raise TypeError(f'workflow.run returned {type(episode).__name__} for query '
                      f'{ctx.query.query_id}; it must return an Episode.')
    served = {s for t in ctx.turns for s in t.sample_ids}
    invented = set(episode.rewards) - served
    if invented:
      raise ValueError(f'query {ctx.query.query_id}: the workflow scored samples that were '
                       f'never served: {sorted(invented)[:5]}.')
    unscored = served - set(episode.rewards)
    if unscored:
      raise ValueError(f'query {ctx.query.query_id}: served samples without a reward: '
                       f'{sorted(unscored)[:5]}; score every completion the workflow '
                       'received (episode.score(completion, reward)).')
    ctx.turns.sort(key=lambda t: t.turn)
    return EpisodeResult(ctx.query, ctx.index, ctx.turns, episode)
