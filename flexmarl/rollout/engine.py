"""RolloutEngine: runs workflows as a stream and keeps every rollout instance busy.

Every query's workflow runs as an asyncio task. Up to `concurrency` queries are in
flight; a finished query's slot is refilled at once, so a long answer delays only its
own query. Each `generate` becomes a request routed to the least-loaded instance of its
agent (`pool.py`); an instance that is busy queues it for its next batch. All busy
instances generate at the same time; the engine collects whichever finishes first
(through the clock), and a balancer may move idle instances from cold agents to hot ones
between batches (`balancer.py`). A served request is a `data.records.ServedGroup`.

Samples never depend on batching: each row's PRNG key comes from (seed, agent,
version, sample_id). Results reach the caller in stream order, whatever order queries
finish in, so what a step trains on depends only on the query stream.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence

import numpy as np

from flexmarl.core.clock import Clock, RealClock
from flexmarl.data.records import EpisodeResult, ServedGroup
from flexmarl.metrics.spans import GENERATE, SpanRecorder
from flexmarl.models.tokenizer import Prompt, TextTokenizer
from flexmarl.rollout.admission import Admission, Decision, Verdict
from flexmarl.rollout.answers import finish
from flexmarl.rollout.balancer import Balancer
from flexmarl.rollout.context import fit_prompt, own_turns
from flexmarl.rollout.pool import Instance, InstancePool, Request
from flexmarl.rollout.sampler import SamplingParams, sample_key
from flexmarl.rollout.stream import RolloutStream
from flexmarl.workflows.base import Completion, Episode, Query, Workflow
from flexmarl.workflows.checks import (check_demand, check_episode, check_wanted_calls,
                                       run_error, timeout_error)


class _Client:
  """`agents[name]` inside one query's workflow."""

  def __init__(self, name: str, ctx: '_QueryContext'):
    self.name, self._ctx = name, ctx

  @property
  def wanted(self) -> bool:
    """Whether a batch still takes this agent's rows from this query (admission.py)."""
    return self._ctx.wanted is None or self.name in self._ctx.wanted

  async def generate(self, prompt: Prompt, n: int | None = None, *,
                     max_new_tokens: int | None = None,
                     stop: Sequence[str] = ()) -> list[Completion]:
    return await self._ctx.submit(self.name, prompt, n, max_new_tokens, stop)


class _QueryContext:

  def __init__(self, engine: 'RolloutEngine', query: Query, index: int,
               requests: list[Request], started: float, wanted: frozenset[str] | None = None):
    self.engine, self.query, self.index, self.requests = engine, query, index, requests
    self.started, self.wanted = started, wanted
    self.declared: Mapping[str, int] | None = None  # the calls admission planned by
    self.served: list[ServedGroup] = []
    self.waiting = 0  # generate calls not answered yet
    self._next_call = 0

  def submit(self, agent: str, prompt: Prompt, n: int | None, max_new_tokens: int | None,
             stop: Sequence[str]) -> asyncio.Future:
    engine, qid = self.engine, self.query.query_id
    if agent not in engine.pools:
      raise KeyError(f'query {qid}: the workflow asked for agent {agent!r}; '
                     f'configured agents: {sorted(engine.pools)}.')
    n = engine.group_sizes[agent] if n is None or engine.evaluation else n
    if not isinstance(n, int) or n < 1:
      raise ValueError(f'query {qid}: generate(n={n!r}) for agent {agent!r}: '
                       'n must be a whole number >= 1.')
    cap = engine.sampling[agent].max_new_tokens
    limit = cap if max_new_tokens is None else max_new_tokens
    if not isinstance(limit, int) or not 1 <= limit <= cap:
      raise ValueError(f'query {qid}: generate(max_new_tokens={max_new_tokens!r}) for agent '
                       f'{agent!r}: give a whole number in [1, {cap}] (the agent\'s '
                       f'sampling.max_new_tokens; raise that to allow longer answers).')
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) and s for s in stop):
      raise ValueError(f'query {qid}: generate(stop={stop!r}) for agent {agent!r}: give '
                       'non-empty strings, e.g. stop=["\\n"].')
    try:
      ids = fit_prompt(own_turns(prompt, agent, engine.tokenizers),
                       engine.tokenizers[agent].encode_prompt, engine.max_prompt_len,
                       engine.context_overflow,
                       f'query {qid}, agent {agent!r}, turn {self._next_call}')
    except ValueError as e:
      raise ValueError(f'query {qid}: generate() for agent {agent!r}: {e}') from None
    future = asyncio.get_running_loop().create_future()
    self.requests.append(Request(
        self.index, qid, self._next_call, agent, ids, n, len(ids) + n * limit, future,
        self.served, engine.clock.now(), max_new_tokens=limit, stop=stop))
    self._next_call += 1
    self.waiting += 1
    future.add_done_callback(lambda _: setattr(self, 'waiting', self.waiting - 1))
    return future


class RolloutEngine:
  """Serves workflow requests from each agent's pool of rollout instances."""

  def __init__(self, pools: Mapping[str, InstancePool], sampling: Mapping[str, SamplingParams],
               group_sizes: Mapping[str, int],
               tokenizers: TextTokenizer | Mapping[str, TextTokenizer], seed: int, *,
               clock: Clock | None = None, concurrency: int = 8,
               max_batch: int = 256, balancer: Balancer | None = None,
               query_timeout_s: float = 0.0, recorder: SpanRecorder | None = None,
               evaluation: bool = False, max_prompt_len: int = 0,
               context_overflow: str = 'refuse'):
    """`evaluation`: held-out evaluation, pass@1: every request gets one greedy answer,
    whatever `n` the workflow asks for (see `evaluation_engine`). A prompt longer than
    `max_prompt_len` (0: unchecked here) is refused or shortened by `context_overflow`
    (rollout/context.py)."""
    self.max_prompt_len, self.context_overflow = max_prompt_len, context_overflow
    self.pools = dict(pools)
    self.evaluation = evaluation
    self.sampling, self.group_sizes = dict(sampling), dict(group_sizes)
    # Each agent's prompts are encoded and its answers decoded by its own tokenizer.
    self.tokenizers = (dict(tokenizers) if isinstance(tokenizers, Mapping)
                       else dict.fromkeys(self.pools, tokenizers))
    self.seed = seed
    self.clock = clock or RealClock()
    self.concurrency, self.max_batch = concurrency, max_batch
    self.balancer, self.query_timeout_s = balancer, query_timeout_s
    self.recorder = recorder
    self.generated: collections.Counter = collections.Counter()  # response tokens per agent
    # One private loop for every rollout: a fresh loop per call costs more than a small
    # model's whole generation step.
    self._loop = asyncio.new_event_loop()

  def evaluation_engine(self) -> 'RolloutEngine':
    """An engine over the same instances (serving the same weights) that answers every
    request once, greedily: held-out evaluation. Nothing it serves is trained on."""
    greedy = {a: dataclasses.replace(s, temperature=0.0) for a, s in self.sampling.items()}
    return RolloutEngine(self.pools, greedy, dict.fromkeys(self.pools, 1), self.tokenizers,
                         self.seed, clock=self.clock, concurrency=self.concurrency,
                         max_batch=self.max_batch, query_timeout_s=self.query_timeout_s,
                         evaluation=True, max_prompt_len=self.max_prompt_len,
                         context_overflow=self.context_overflow)

  @property
  def instances(self) -> list[Instance]:
    """Every instance once (one serving several agents' adapters is in each one's pool)."""
    return list({id(i): i for p in self.pools.values() for i in p.instances}.values())

  def run(self, workflow: Workflow, queries: Sequence[Query], first_index: int = 0
          ) -> list[EpisodeResult]:
    """Roll out a fixed list of queries to completion; results in query order."""
    return list(self.stream(workflow, iter(enumerate(queries, first_index))))

  def stream(self, workflow: Workflow, source: Iterator[tuple[int, Query]],
             need: Callable[[], Mapping[str, int] | None] | None = None,
             filtered: frozenset[str] = frozenset()) -> RolloutStream:
    """Roll out queries from `source` ((stream index, query) pairs, consecutive);
    iterating gives each result in stream order until the source ends. Closing the
    stream abandons the queries still in flight; `start` dispatches the first requests
    ahead of iterating (see `RolloutStream`). With `need` (per agent, the rows its batch
    still takes; None: no limit) queries are admitted by demand (admission.py;
    `filtered`: the agents whose groups a batch may drop): a skipped query's result has
    `skipped` set and nothing served.

    Works from plain code and from inside a running event loop (a notebook): there
    the rollout gets its own loop on a worker thread.
    """
    admission = None
    if need is not None and need() is not None:
      admission = Admission(need, self.group_sizes, filtered)
    return RolloutStream(
        lambda dispatched: self._stream(workflow, source, dispatched, admission), self._loop)

  def _demand(self, workflow: Workflow, query: Query) -> Mapping[str, int] | None:
    declare = getattr(workflow, 'demand', None)
    if declare is None:
      return None
    return check_demand(declare(query), query.query_id, self.group_sizes,
                        type(workflow).__name__)

  async def _stream(self, workflow: Workflow, source: Iterator[tuple[int, Query]],
                    dispatched: Callable[[], Awaitable[None]], admission: Admission | None
                    ) -> AsyncIterator[EpisodeResult]:
    requests: list[Request] = []
    active: dict[int, tuple[_QueryContext, asyncio.Task]] = {}
    finished: dict[int, EpisodeResult] = {}
    expected, exhausted = None, False
    held = None  # the next query, waiting for the queries in flight (admission.py)

    names = list(workflow.agent_names())

    async def episode(ctx: _QueryContext) -> Episode:
      try:
        return await workflow.run(ctx.query, {name: _Client(name, ctx) for name in names})
      except Exception as e:  # noqa: BLE001 — any error of user code, named by its query
        raise run_error(ctx.query.query_id, e) from e

    try:
      while True:
        while not exhausted and len(active) < self.concurrency:
          item, held = held or next(source, None), None
          if item is None:
            exhausted = True
            break
          index, query = item
          expected = index if expected is None else expected
          verdict, calls = Verdict(Decision.START), None
          if admission is not None:
            calls = self._demand(workflow, query)
            verdict = admission.consider(calls, quiet=not active and not finished)
          if verdict.decision is Decision.HOLD:
            held = item
            break
          now = self.clock.now()
          if verdict.decision is Decision.SKIP:
            finished[index] = EpisodeResult(query, index, [], Episode(), now, now, skipped=True)
            if len(finished) >= self.concurrency:
              break  # hand these to the consumer, which may end the step
            continue
          ctx = _QueryContext(self, query, index, requests, now, verdict.wanted)
          ctx.declared = calls
          active[index] = (ctx, asyncio.create_task(episode(ctx)))
        await self._settle([t for _, t in active.values()], requests)
        for index in [i for i, (_, t) in active.items() if t.done()]:
          ctx, task = active.pop(index)
          finished[index] = self._check(ctx, task.result(), self.clock.now())
          for pool in self.pools.values():
            pool.forget(ctx.query.query_id)
        while expected in finished:
          expected += 1
          yield finished.pop(expected - 1)
        if exhausted and not active:
          return
        if len(active) < self.concurrency and not exhausted and held is None:
          continue  # refill the slots of queries that just finished before serving
        self._check_timeouts(active.values())
        if self._dispatch(requests):
          await dispatched()  # where a `RolloutStream.start` leaves the rollout
        others = any(ctx.waiting == 0 for ctx, _ in active.values())
        await self._collect(timeout=0.002 if others or self.query_timeout_s else None)
    finally:
      for _, task in active.values():
        task.cancel()
      await asyncio.gather(*(t for _, t in active.values()), return_exceptions=True)
      for inst in self.instances:  # requests of abandoned queries
        inst.queue.clear()
      requests.clear()

  @staticmethod
  async def _settle(tasks, requests: list[Request], quiet_rounds: int = 3) -> None:
    """Yield to the workflows until none makes progress for a few loop turns."""
    last, quiet = None, 0
    while quiet < quiet_rounds:
      await asyncio.sleep(0)
      now = (len(requests), sum(t.done() for t in tasks))
      quiet = quiet + 1 if now == last else 0
      last = now

  def _keys(self, request: Request, version: int) -> np.ndarray:
    return np.stack([sample_key(self.seed, request.agent, version, s)
                     for s in request.sample_ids])

  def _dispatch(self, requests: list[Request]) -> bool:
    """Route new requests (in stream order), rebalance, start every idle instance;
    whether any instance is generating."""
    requests.sort(key=lambda r: (r.index, r.call))
    for r in requests:
      self.pools[r.agent].route(r)
    requests.clear()
    now = self.clock.now()
    if self.balancer is not None:
      self._balance(now)
    generating = False
    for pool in self.pools.values():
      for inst in pool.instances:
        inst.submit_next(self._keys, self.sampling[pool.agent], self.max_batch, now)
        generating = generating or inst.pending is not None
    return generating

  def _balance(self, now: float) -> None:
    self.balancer.observe({a: float(p.outstanding) for a, p in self.pools.items()})
    move = self.balancer.propose({a: len(p.instances) for a, p in self.pools.items()}, now)
    if move is None:
      return
    inst = self.pools[move.source].release()
    if inst is not None:
      self.pools[move.target].adopt(inst)
      self.balancer.moved(move, now)

  async def _collect(self, timeout: float | None) -> None:
    """Wait until some instance's batch is done (or `timeout`), then answer its requests."""
    running = [i for i in self.instances if i.pending is not None]
    if not running:  # the workflows wait on something other than generate
      await asyncio.sleep(0.001)
      return
    done = {id(p) for p in self.clock.wait_any([i.pending for i in running], timeout)}
    for inst in running:
      if id(inst.pending) in done:
        self._answer(inst)

  def _answer(self, inst: Instance) -> None:
    """Record the finished batch's groups and answer their workflows."""
    now = self.clock.now()
    batch, out, versions = inst.collect(now)
    if self.recorder is not None:
      self.recorder.add(f'rollout:{inst.name}', GENERATE, inst.started, now,
                        agent='+'.join(dict.fromkeys(r.agent for r in batch)),
                        version=max(versions), rows=int(len(out.lengths)),
                        tokens=int(out.lengths.sum()))
    row = 0
    for r, version in zip(batch, versions):
      rows = range(row, row + r.n)
      row += r.n
      self.generated[r.agent] += int(out.lengths[rows.start:rows.stop].sum())
      if r.future.done():  # its query was abandoned
        continue
      tokenizer = self.tokenizers[r.agent]
      answers = [finish(out.tokens[i, :out.lengths[i]], tokenizer, r.stop) for i in rows]
      tokens = [out.tokens[i, :a.length] for i, a in zip(rows, answers)]
      group = ServedGroup(r.query_id, r.call, r.agent, version, r.prompt_ids, r.sample_ids,
                          tokens, [out.logprobs[i, :a.length] for i, a in zip(rows, answers)])
      r.served.append(group)
      r.future.set_result([Completion(sid, r.agent, a.text, version, a.truncated,
                                      tuple(int(t) for t in ids))
                           for sid, a, ids in zip(group.sample_ids, answers, tokens)])

  def _check_timeouts(self, active) -> None:
    if not self.query_timeout_s:
      return
    now = self.clock.now()
    for ctx, _ in active:
      if now - ctx.started > self.query_timeout_s:
        raise timeout_error(ctx.query.query_id, self.query_timeout_s,
                            '(config.rollout.query_timeout_s)')

  @staticmethod
  def _check(ctx: _QueryContext, episode: Episode, now: float) -> EpisodeResult:
    check_episode(ctx.query.query_id, [s for g in ctx.served for s in g.sample_ids], episode)
    if ctx.declared is not None:
      check_wanted_calls(ctx.query.query_id, ctx.declared, ctx.wanted,
                         collections.Counter(g.agent for g in ctx.served))
    ctx.served.sort(key=lambda g: g.call)
    return EpisodeResult(ctx.query, ctx.index, ctx.served, episode, ctx.started, now)
