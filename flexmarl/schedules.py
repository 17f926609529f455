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

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from flexmarl.clock import Clock
from flexmarl.config import AgentSpec, TeamSpec
from flexmarl.data.groups import BatchBuilder, Group, StaleBuffer, batch_stats
from flexmarl.team import Agent

Lines = dict[str, dict[str, float]]


class StepContext(Protocol):
  """What a schedule may use of the run that calls it (the JointOrchestrator): the team,
  each agent's buffer of served rows, and the run's rollout and training calls. Declared
  here so that the schedules never import the orchestrator."""

  spec: TeamSpec
  clock: Clock
  agents: Mapping[str, Agent]
  buffers: dict[str, BatchBuilder | StaleBuffer]

  def rollout(self, take: Callable[[str, list[Group]], None], done: Callable[[], bool]
              ) -> tuple[int, dict[str, int]]:
    """Stream queries, handing each query's groups to `take`, until `done()`."""

  def start_step(self, name: str, batch: Sequence[Group],
                 micro_batches: Sequence[Sequence[Group]]) -> Callable[[], dict[str, float]]:
    """Dispatch an agent's update; the returned function waits and gives its stats."""

  def train_agent(self, name: str) -> dict[str, float]:
    """Train an agent on its full batch, wait, publish."""

  def finish_step(self, lines: Lines, t0: float, rollout_s: float, queries: int) -> Lines:
    """Complete the step's metrics lines and queue its rows for the store."""


class Schedule(Protocol):

  def new_buffer(self, spec: AgentSpec) -> BatchBuilder | StaleBuffer:
    """An agent's empty buffer of served rows not yet trained on."""

  def run_step(self, orch: StepContext) -> Lines:
    """One step: roll out, train, publish; returns the per-agent metrics lines."""


class Sync:
  """Roll out, then train the full agents one after another."""

  pipelined = False

  def new_buffer(self, spec: AgentSpec) -> BatchBuilder:
    return BatchBuilder(spec.global_batch, spec.micro_batch // spec.group_size,
                        spec.grpo.dynamic_sampling)

  def on_groups(self, orch: StepContext, name: str, early: dict[str, int],
                stepped: dict[str, Callable]) -> None:
    """Called as an agent's groups arrive (pipelined schedules start work here)."""

  def train(self, orch: StepContext, full: list[str], stepped: dict[str, Callable]
            ) -> dict[str, dict[str, float]]:
    return {name: orch.train_agent(name) for name in full}

  def run_step(self, orch: StepContext) -> Lines:
    t0 = orch.clock.now()
    versions = {n: a.version for n, a in orch.agents.items()}
    early = {n: 0 for n in orch.agents}
    stepped: dict[str, Callable[[], dict[str, float]]] = {}

    def take(name: str, groups: list[Group]) -> None:
      for g in groups:
        orch.buffers[name].add(g)  # once the batch is full, surplus
      self.on_groups(orch, name, early, stepped)

    queries, served = orch.rollout(take, lambda: all(b.full for b in orch.buffers.values()))
    rollout_s = orch.clock.now() - t0
    full = [n for n, b in orch.buffers.items() if b.full]
    stats = self.train(orch, full, stepped)
    lines: Lines = {}
    for name, builder in orch.buffers.items():
      line = dict(batch_stats(builder.kept), policy_version=versions[name],
                  tokens=served[name], rows=builder.kept_rows, updated=int(name in stats),
                  early_micro_batches=early[name], filtered_rows=builder.filtered_rows)
      if name in stats:
        line.update(surplus_rows=builder.surplus_rows, **stats[name])
        orch.buffers[name] = self.new_buffer(orch.spec.agents[name])
      lines[name] = line
    return orch.finish_step(lines, t0, rollout_s, queries)


class SyncParallel(Sync):
  """Roll out, then train the full agents at the same time: every agent's update is
  dispatched (each on its own training devices) before any is awaited."""

  def train(self, orch, full, stepped):
    finishes = {name: orch.start_step(name, orch.buffers[name].kept,
                                      orch.buffers[name].micro_batches(final=True))
                for name in full}
    stats = {name: finish() for name, finish in finishes.items()}
    for name in full:
      orch.agents[name].publish()
    return stats


class FlexPipeline(Sync):
  """The micro-batch pipeline: train each micro-batch as soon as it is complete."""

  def on_groups(self, orch, name, early, stepped):
    if name in stepped:
      return
    builder = orch.buffers[name]
    # Dispatched, not awaited: each runs on the agent's training devices while the
    # rollout goes on; the optimizer step too, once the batch is full.
    for micro in builder.micro_batches(final=builder.full):
      orch.agents[name].accumulate(micro)
      early[name] += 1
    if builder.full:
      stepped[name] = orch.start_step(name, builder.kept, [])

  def train(self, orch, full, stepped):
    stats = {name: stepped[name]() for name in full}
    for name in full:
      orch.agents[name].publish()
    return stats


class Async:
  """`async:k`: agents with a full buffer train while the rollout serves the weights
  from before those updates; publish when both are done."""

  def __init__(self, max_staleness: int):
    self.max_staleness = max_staleness

  def new_buffer(self, spec: AgentSpec) -> StaleBuffer:
    return StaleBuffer(spec.global_batch, spec.micro_batch // spec.group_size,
                       self.max_staleness, spec.grpo.dynamic_sampling)

  def run_step(self, orch: StepContext) -> Lines:
    t0 = orch.clock.now()
    specs = orch.spec.agents
    versions = {n: a.version for n, a in orch.agents.items()}
    dropped = {n: b.drop_stale(versions[n]) for n, b in orch.buffers.items()}
    batches = {n: b.take() for n, b in orch.buffers.items()
               if b.fresh_rows(versions[n]) >= specs[n].global_batch}
    # The versions this step's rows will be trained at, at the earliest.
    after = {n: v + (n in batches) for n, v in versions.items()}
    served: dict[str, list[Group]] = {n: [] for n in specs}

    def take(name: str, groups: list[Group]) -> None:
      served[name] += groups
      for g in groups:
        orch.buffers[name].add(g)

    def done() -> bool:
      return all(b.fresh_rows(after[n]) >= specs[n].global_batch
                 for n, b in orch.buffers.items())

    # Dispatched, not awaited: the updates run on the training devices while the
    # rollout serves the weights the instances hold (from before these updates).
    training = {n: orch.start_step(n, [g for m in micro for g in m], micro)
                for n, micro in batches.items()}
    queries, tokens = orch.rollout(take, done)
    rollout_s = orch.clock.now() - t0
    stats = {n: finish() for n, finish in training.items()}
    for name in stats:
      orch.agents[name].publish()
    lines: Lines = {}
    for name, buffer in orch.buffers.items():
      line = dict(batch_stats(served[name]), policy_version=versions[name],
                  tokens=tokens[name], updated=int(name in stats), stale_dropped=dropped[name],
                  buffered_rows=sum(g.size for g in buffer.kept))
      line.update(stats.get(name, {}))
      lines[name] = line
    return orch.finish_step(lines, t0, rollout_s, queries)


def make_schedule(spec: TeamSpec) -> Schedule:
  if spec.schedule == 'async':
    return Async(spec.max_staleness)
  return {'sync': Sync, 'sync_parallel': SyncParallel, 'flexmarl': FlexPipeline}[spec.schedule]()
