"""Schedules: *when* rollout and training run. One switch in the config.

`sync` is the reference every faster schedule must equal. A step streams queries,
every agent serving its current version, until every agent's buffer holds its global
batch (or `rollout.max_step_queries` queries were consumed). Then each agent whose
batch is full trains, one after another: its first `global_batch` rows in stream order,
whole GRPO groups only, in micro-batches whose gradients are accumulated, then one
optimizer step; the new weights go to its rollout instances as the next version, and
rows past the batch are dropped (counted as surplus: they belong to the old version).
An agent whose batch is not full keeps its rows for the next step; it has not changed
version, so they stay on-policy. A cold agent never stalls the team.

The other on-policy schedules give the same numbers and differ only in *when* work runs:
- `sync_parallel`: after the rollout, the full agents train at the same time.
- `flexmarl`: the micro-batch pipeline. A micro-batch's gradient is dispatched as soon
  as it is complete, and runs on the agent's training devices while the rollout goes
  on. Once the agent's batch is full its optimizer step is dispatched at once; the new
  weights are published at the end of the step (rows it is still served until then
  are surplus, as under `sync`).

`async:k` trades exactness for overlap (bounded staleness). At the start of a step,
every agent whose buffer holds a global batch trains on its oldest rows (dispatched,
not awaited) while the step's rollout goes on serving the weights from before that
update; the new weights are published when both are done. Rows wait across steps
while they are at most k versions older than the parameters they would update; older
rows are dropped, never trained on, and counted (`stale_dropped`). The loss's ratio is
taken against each row's behaviour logprobs. Which version serves which query is
fixed by the step count alone, so runs stay reproducible and resumable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import ContextManager, Protocol

from flexmarl.config import AgentSpec, TeamSpec
from flexmarl.core.clock import Clock
from flexmarl.core.interfaces import Stats
from flexmarl.data.groups import BatchBuilder, ConstantBaseline, Group, StaleBuffer, batch_stats
from flexmarl.train.learner import silent_groups

Lines = dict[str, dict[str, float]]


class Rollout(Protocol):
  """A step's rollout as it streams: each query's groups per agent, in stream order."""

  queries: int  # consumed so far
  tokens: dict[str, int]  # response tokens per agent, so far

  def __iter__(self) -> Iterator[dict[str, list[Group]]]:
    ...


class StepContext(Protocol):
  """What a schedule may use of the run (the JointOrchestrator implements it)."""

  clock: Clock

  def version(self, name: str) -> int:
    """Agent `name`'s version: the updates it has had."""

  def rollout(self) -> ContextManager[Rollout]:
    """Stream queries; leaving the block abandons those in flight (served next step)."""

  def accumulate(self, name: str, micro: Sequence[Group]) -> None:
    """Dispatch one micro-batch's gradient."""

  def update(self, name: str, batch: Sequence[Group],
             micro_batches: Sequence[Sequence[Group]]) -> Callable[[], Stats]:
    """Dispatch an agent's update (the micro-batches of `batch` not yet accumulated,
    then the optimizer step); the agent is at its next version at once. The returned
    function waits and gives the update's stats."""

  def publish(self, name: str) -> None:
    """The agent's instances serve its last update's weights from now on."""

  def start_rollout(self) -> None:
    """Dispatch the next step's first requests now (to the weights published so far);
    the next `rollout` goes on with them."""


@dataclasses.dataclass
class StepResult:
  lines: Lines  # per agent
  rollout_s: float
  queries: int  # consumed by the step
  tokens: int  # response tokens served, all agents


class Schedule(Protocol):
  """Runs one step through a `StepContext`; owns each agent's buffer of served rows not
  yet trained on, and says which of them a checkpoint carries over."""

  def run_step(self, ctx: StepContext) -> StepResult:
    """One step: roll out, train, publish."""

  def carried(self) -> dict[str, list[Group]]:
    """Per agent, the groups served and not yet trained on that a checkpoint keeps."""

  def carry(self, name: str, groups: Sequence[Group]) -> None:
    """Take back groups a checkpoint carried (on restore)."""

  def needs(self) -> dict[str, int] | None:
    """Per agent, the rows its next batch still takes: what the rollout admits queries
    for (rollout/admission.py); None: no limit."""


class Buffered:
  """Each agent's buffer of served rows not yet trained on; a checkpoint carries what
  the buffers keep. `baseline` weighs each line's accuracy against a constant answer's."""

  buffers: dict[str, BatchBuilder | StaleBuffer]
  baseline: ConstantBaseline

  def carried(self) -> dict[str, list[Group]]:
    return {n: list(b.kept) for n, b in self.buffers.items()}

  def carry(self, name: str, groups: Sequence[Group]) -> None:
    for g in groups:
      self.buffers[name].add(g)


class Sync(Buffered):
  """Roll out, then train the full agents one after another."""

  pipelined = False  # train micro-batches while the rollout goes on (FlexPipeline)

  def __init__(self, agents: Mapping[str, AgentSpec]):
    self.agents = dict(agents)
    self.buffers = {n: self.new_buffer(a) for n, a in self.agents.items()}
    self.baseline = ConstantBaseline()

  @staticmethod
  def new_buffer(spec: AgentSpec) -> BatchBuilder:
    return BatchBuilder(spec.global_batch, spec.micro_batch // spec.group_size,
                        spec.grpo.dynamic_sampling, silent_groups(spec.grpo))

  def needs(self) -> dict[str, int]:
    return {n: b.missing for n, b in self.buffers.items()}

  def run_step(self, ctx: StepContext) -> StepResult:
    t0 = ctx.clock.now()  # rollout_s: this step's wait on its rollout (not what ran earlier)
    versions = {n: ctx.version(n) for n in self.buffers}
    early = dict.fromkeys(self.buffers, 0)  # micro-batches trained during the rollout
    updates: dict[str, Callable[[], Stats]] = {}  # dispatched during the rollout
    with ctx.rollout() as rollout:
      for arrival in rollout:
        for name, groups in arrival.items():
          builder = self.buffers[name]
          for g in groups:
            builder.add(g)  # once the batch is full, surplus
          if self.pipelined and name not in updates:
            # Dispatched, not awaited: each runs on the agent's training devices while
            # the rollout goes on; the optimizer step too, once the batch is full.
            for micro in builder.micro_batches(final=builder.full):
              ctx.accumulate(name, micro)
              early[name] += 1
            if builder.full:
              updates[name] = ctx.update(name, builder.kept, [])
        if all(b.full for b in self.buffers.values()):
          break
    rollout_s = ctx.clock.now() - t0
    full = [n for n, b in self.buffers.items() if b.full]
    finishes = self.train(ctx, full, updates)
    builders = dict(self.buffers)  # this step's; the updated agents start anew
    for name in full:
      self.buffers[name] = self.new_buffer(self.agents[name])
    # Every update is dispatched and its weights published: the next step's generation
    # starts now, behind the updates on the devices, while this step waits for their
    # stats and finishes its bookkeeping (here and in the orchestrator).
    ctx.start_rollout()
    stats = {name: finish() for name, finish in finishes.items()}
    lines: Lines = {}
    for name, builder in builders.items():
      line = dict(batch_stats(builder.kept), **self.baseline.stats(name, builder.kept),
                  policy_version=versions[name],
                  tokens=rollout.tokens[name], rows=builder.kept_rows,
                  updated=int(name in stats), early_micro_batches=early[name],
                  filtered_rows=builder.filtered_rows)
      if name in stats:
        line.update(surplus_rows=builder.surplus_rows, **stats[name])
      lines[name] = line
    return StepResult(lines, rollout_s, rollout.queries, sum(rollout.tokens.values()))

  def train(self, ctx: StepContext, full: list[str], updates: dict[str, Callable[[], Stats]]
            ) -> dict[str, Callable[[], Stats]]:
    """Train every full agent on its batch, one after another (each update is
    dispatched once the one before has finished), and publish each one's weights;
    `updates`: those dispatched already. Returns a function per agent that gives its
    stats (waiting for the last update)."""
    finishes: dict[str, Callable[[], Stats]] = {}
    for i, name in enumerate(full):
      if i:
        earlier = finishes[full[i - 1]]()
        finishes[full[i - 1]] = lambda stats=earlier: stats
      builder = self.buffers[name]
      finishes[name] = ctx.update(name, builder.kept, builder.micro_batches(final=True))
      ctx.publish(name)
    return finishes


class SyncParallel(Sync):
  """Roll out, then train the full agents at the same time: every agent's update is
  dispatched (each on its own training devices) before any is awaited."""

  def train(self, ctx, full, updates):
    finishes = {name: ctx.update(name, self.buffers[name].kept,
                                 self.buffers[name].micro_batches(final=True))
                for name in full}
    for name in full:
      ctx.publish(name)
    return finishes


class FlexPipeline(Sync):
  """The micro-batch pipeline: train each micro-batch as soon as it is complete; the
  new weights are published once the rollout has ended."""

  pipelined = True

  def train(self, ctx, full, updates):
    for name in full:
      ctx.publish(name)
    return {name: updates[name] for name in full}


class Async(Buffered):
  """`async:k`: agents with a full buffer train while the rollout serves the weights
  from before those updates; publish when both are done."""

  def __init__(self, agents: Mapping[str, AgentSpec], max_staleness: int):
    self.agents, self.max_staleness = dict(agents), max_staleness
    self.buffers = {n: StaleBuffer(a.global_batch, a.micro_batch // a.group_size,
                                   max_staleness, a.grpo.dynamic_sampling,
                                   silent_groups(a.grpo))
                    for n, a in self.agents.items()}
    self.baseline = ConstantBaseline()

  def needs(self) -> None:
    return None  # rows wait across steps: a query's rows are never in vain

  def run_step(self, ctx: StepContext) -> StepResult:
    t0 = ctx.clock.now()
    specs = self.agents
    versions = {n: ctx.version(n) for n in specs}
    dropped = {n: b.drop_stale(versions[n]) for n, b in self.buffers.items()}
    batches = {n: b.take() for n, b in self.buffers.items()
               if b.fresh_rows(versions[n]) >= specs[n].global_batch}
    # The versions this step's rows will be trained at, at the earliest.
    after = {n: v + (n in batches) for n, v in versions.items()}
    served: dict[str, list[Group]] = {n: [] for n in specs}
    # Dispatched, not awaited: the updates run on the training devices while the
    # rollout serves the weights the instances hold (from before these updates).
    training = {n: ctx.update(n, [g for m in micro for g in m], micro)
                for n, micro in batches.items()}
    with ctx.rollout() as rollout:
      for arrival in rollout:
        for name, groups in arrival.items():
          served[name] += groups
          for g in groups:
            self.buffers[name].add(g)
        if all(b.fresh_rows(after[n]) >= specs[n].global_batch
               for n, b in self.buffers.items()):
          break
    rollout_s = ctx.clock.now() - t0
    stats = {n: finish() for n, finish in training.items()}
    for name in stats:
      ctx.publish(name)
    lines: Lines = {}
    for name, buffer in self.buffers.items():
      line = dict(batch_stats(served[name]), **self.baseline.stats(name, served[name]),
                  policy_version=versions[name],
                  tokens=rollout.tokens[name], updated=int(name in stats),
                  stale_dropped=dropped[name], buffered_rows=sum(g.size for g in buffer.kept))
      line.update(stats.get(name, {}))
      lines[name] = line
    return StepResult(lines, rollout_s, rollout.queries, sum(rollout.tokens.values()))


def make_schedule(spec: TeamSpec) -> Schedule:
  if spec.schedule == 'async':
    return Async(spec.agents, spec.max_staleness)
  return {'sync': Sync, 'sync_parallel': SyncParallel,
          'flexmarl': FlexPipeline}[spec.schedule](spec.agents)
