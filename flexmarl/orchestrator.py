"""JointOrchestrator: the run loop. It owns policy versions, the query stream, save and
restore; the schedule (`schedules.py`) decides when rollout and training run.

Data moves forward only: workflow → RolloutEngine → groups (journaled to the
ExperienceStore, and cut into batches) → the agent's trainer → weights back to its
rollout instances. Nothing but the orchestrator and its schedule changes a version.

Restarts: the run resumes from the newest checkpoint that every agent has, with the
rows each agent had not yet trained on (the checkpoint names them; they are read back
from the ExperienceStore), and serves the next queries again. Sampling keys depend
only on (seed, agent, version, sample_id), so it draws the same rows as the run that
died; the store keeps each row once and marks rows consumed only once a checkpoint
holds the update that trained on them.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np

from flexmarl import placement as placement_lib
from flexmarl.clock import Clock, RealClock
from flexmarl.config import TeamSpec
from flexmarl.data.groups import Group, groups_of
from flexmarl.data.journal import CarriedRowsLost, Journal, group_ref, groups_from_store
from flexmarl.metrics import spans, utilization
from flexmarl.interrupt import StopRequest
from flexmarl.metrics.stall import StallWatch
from flexmarl.metrics.summary import format_step, write_summary
from flexmarl.metrics.writer import TEAM, MetricsWriter
from flexmarl.rollout.balancer import Balancer, Limits
from flexmarl.rollout.engine import EpisodeResult, RolloutEngine
from flexmarl.schedules import make_schedule
from flexmarl.store.experience_store import ExperienceStore
from flexmarl.team import Agent, build_team
from flexmarl.tokenizer import TextTokenizer, per_agent
from flexmarl.train.checkpoint import restore_latest
from flexmarl.workflows.base import Query, Workflow


class JointOrchestrator:

  def __init__(self, spec: TeamSpec, workflow: Workflow,
               tokenizer: TextTokenizer | Mapping[str, TextTokenizer], workdir: str,
               devices: Sequence[jax.Device] | None = None, clock: Clock | None = None,
               agents: Mapping[str, Agent] | None = None):
    """`tokenizer`: the team's, or each agent's. `clock` and `agents` default to the wall
    clock and the team `build_team` makes on `devices`; a simulator passes its own
    (simulated instances and trainers)."""
    tokenizers = per_agent(tokenizer, spec.agents)
    self.spec, self.workflow, self.workdir = spec, workflow, workdir
    self.clock = clock or RealClock()
    # Every generate call, micro-batch, optimizer step, weight sync and store write, as
    # a span: `WORKDIR/trace.json` (Perfetto) and utilization in the metrics.
    self.recorder = spans.SpanRecorder(self.clock)
    placement_lib.check_resume(spec.placement, workdir)
    placement_lib.save(spec.placement, workdir)
    self.agents = dict(agents) if agents is not None else build_team(
        spec, spec.placement, tokenizers, workdir, devices or jax.devices(), self.recorder)
    r = spec.rollout
    balancer = (Balancer({n: Limits(a.min_instances, a.max_instances, a.mesh_shape)
                          for n, a in spec.agents.items()},
                         r.balance_threshold, r.balance_cooldown_s)
                if r.balance and r.backend == 'embedded' else None)  # a vLLM move: a restart
    self.engine = RolloutEngine(
        {n: a.pool for n, a in self.agents.items()},
        {n: a.sampling for n, a in spec.agents.items()},
        {n: a.group_size for n, a in spec.agents.items()}, tokenizers, spec.seed,
        clock=self.clock, concurrency=r.query_concurrency,
        max_batch=r.max_batch, balancer=balancer, query_timeout_s=r.query_timeout_s,
        recorder=self.recorder)
    self.journal = Journal(ExperienceStore.open(os.path.join(workdir, 'store'),
                                                agents=list(spec.agents)), list(spec.agents),
                           self.recorder)
    self.schedule = make_schedule(spec)
    # Each agent's rows served, not yet trained on: its batch at its current version
    # (a BatchBuilder), or under `async:k` every row still fresh enough (a StaleBuffer).
    self.buffers = {n: self.schedule.new_buffer(a) for n, a in spec.agents.items()}
    self.step = 0
    self.next_query = 0
    self._rebalances_logged = 0

  # -- versions and persistence -------------------------------------------------------

  def restore(self, log=print) -> int:
    """Resume from the newest step every agent has an intact checkpoint for (a damaged
    newer one is skipped, and said so); 0 if none."""
    step, states, metas, warnings = restore_latest(
        {n: a.checkpointer for n, a in self.agents.items()},
        {n: a.trainer.train_state() for n, a in self.agents.items()})
    for warning in warnings:
      log(f'warning: {warning}')
    if not step:
      return 0
    for name, agent in self.agents.items():
      meta = metas[name]
      agent.trainer.load_train_state(states[name], meta['version'])
      agent.publish()
      self.next_query = meta['next_query']
      for g in self._carried_groups(name, step, meta['buffer'], log):
        self.buffers[name].add(g)
      carried = [s for g in self.buffers[name].kept for s in g.turn.sample_ids]
      if carried and self.journal.store.count(name, sample_ids=carried, consumed=True):
        raise RuntimeError(
            f'agent {name!r}: checkpoint {step} carries rows that the store marks consumed '
            f'(trained on and checkpointed later); the workdir {self.workdir} is inconsistent.')
    self.step = step
    return step

  def _carried_groups(self, name: str, step: int, refs: Sequence[dict], log) -> list[Group]:
    """The groups checkpoint `step` carries for agent `name`, read back from the store.

    When the store lost them (its table deleted, or damaged so that it cannot be read),
    the way forward is to resume without them: they are not trained on and the next
    queries fill the batch. A damaged table is first set aside (kept, renamed) so that
    new rows can be written. The warning says what was done."""
    try:
      return groups_from_store(self.journal.store, name, refs)
    except CarriedRowsLost as e:
      rows = sum(len(r['sample_ids']) for r in refs)
      queries = list(dict.fromkeys(r['query_id'] for r in refs))
      aside = ''
      if e.unreadable:
        aside = (f' The table was moved to {self.journal.store.set_aside(name)} (kept as it '
                 'was) and a new one started, since no row could be written into it.')
      log(f'warning: {e}. Way forward taken: resuming from checkpoint {step} without these '
          f'{rows} carried rows (queries {", ".join(queries)}): they are not trained on and '
          'the next queries fill the batch, so the run is no longer the exact continuation '
          f'of the one saved.{aside} To keep the rows instead, stop this run, restore the '
          f'store folder {os.path.join(self.workdir, "store")} from a backup and rerun.')
      return []

  def save(self) -> None:
    """Checkpoint every agent; then mark the rows those updates trained on consumed.

    The rows a checkpoint carries over are read back from the store on restore, so
    every pending append is durable before any checkpoint is written."""
    self.journal.flush()
    meta = {'step': self.step, 'next_query': self.next_query}
    for name, agent in self.agents.items():
      agent.checkpointer.save(self.step, agent.trainer.train_state(),
                              dict(meta, version=agent.version,
                                   buffer=[group_ref(g) for g in self.buffers[name].kept]))
    for agent in self.agents.values():
      agent.checkpointer.wait()
    self.journal.checkpointed()

  # -- what the schedules call --------------------------------------------------------

  def query(self, index: int) -> Query:
    """Query `index` of the run's stream; it depends only on (seed, index)."""
    return self.workflow.make_query(np.random.default_rng([self.spec.seed, index]), f'q{index}')

  def rollout(self, take: Callable[[str, list[Group]], None], done: Callable[[], bool]
              ) -> tuple[int, dict[str, int]]:
    """Stream queries from the next unconsumed one, handing each query's groups to
    `take` in stream order, until `done()` or `rollout.max_step_queries` queries.

    Queries still in flight then are abandoned and served again next step (at the
    next version), so what a step consumes depends only on the stream.
    Returns the number of queries consumed and, per agent, the response tokens."""
    tokens = {n: 0 for n in self.spec.agents}
    normalize = {n: a.grpo.normalize_std for n, a in self.spec.agents.items()}
    count = 0

    def consume(result: EpisodeResult) -> bool:
      nonlocal count
      count += 1
      for name, groups in groups_of(result, normalize).items():
        if groups:
          self.journal.record(name, groups)
          take(name, groups)
          tokens[name] += sum(len(t) for g in groups for t in g.turn.tokens)
      return done() or count >= self.spec.rollout.max_step_queries

    source = ((i, self.query(i)) for i in itertools.count(self.next_query))
    consumed = self.engine.stream(self.workflow, source, consume)
    self.next_query += consumed
    return consumed, tokens

  def start_step(self, name: str, batch: Sequence[Group],
                 micro_batches: Sequence[Sequence[Group]]) -> Callable[[], dict[str, float]]:
    """Dispatch the agent's update on `batch` (see `Agent.start_step`)."""
    self.journal.trained(name, batch)
    return self.agents[name].start_step(batch, micro_batches)

  def train_agent(self, name: str) -> dict[str, float]:
    """Train the agent on its full batch, wait for the step, publish the new weights."""
    builder = self.buffers[name]
    stats = self.start_step(name, builder.kept, builder.micro_batches(final=True))()
    self.agents[name].publish()
    return stats

  def run_step(self) -> dict[str, dict[str, float]]:
    """One step of the configured schedule; returns its metrics lines."""
    self.recorder.step = self.step + 1  # the step the metrics lines will carry
    return self.schedule.run_step(self)

  def finish_step(self, lines: dict[str, dict[str, float]], t0: float, rollout_s: float,
                  queries: int) -> dict[str, dict[str, float]]:
    """Add step times, instance counts and the team line; queue the step's rows for
    the store; log the balancer's moves."""
    step_s = self.clock.now() - t0
    tokens = sum(l['tokens'] for l in lines.values())
    for name, line in lines.items():
      line['step_time_s'] = step_s
      line['instances'] = len(self.agents[name].pool.instances)
      line.update(self.agents[name].swap_stats())  # training pool: meshes, swaps
    self.journal.write()
    lines[TEAM] = dict(self._utilization(), **dict(
        reward_mean=float(np.nanmean([l['reward_mean'] for l in lines.values()])),
        reward_std=float(np.nanmean([l['reward_std'] for l in lines.values()])),
        accuracy=float(np.nanmean([l['accuracy'] for l in lines.values()])),
        policy_version=self.step, tokens=tokens, step_time_s=step_s, rollout_s=rollout_s,
        train_s=step_s - rollout_s, queries=queries, tokens_per_s=tokens / step_s,
        updated=sum(l['updated'] for l in lines.values()), rebalances=self._log_rebalances()))
    self.step += 1
    return lines

  def _utilization(self) -> dict[str, float]:
    """This step's busy fraction and bubbles per device group, from its spans."""
    for agent in self.agents.values():
      if agent.timeline is not None:
        agent.timeline.drain()  # the step's work is done; its spans are being recorded
    step = self.step + 1
    report = utilization.step_report(self.recorder.spans()).get(step)
    self.recorder.discard(step - 1)  # the previous step's spans may overlap this one
    return utilization.step_scalars(report) if report else {}

  def _log_rebalances(self) -> int:
    """Append the balancer's new decisions to `WORKDIR/rebalances.jsonl`; how many."""
    log = self.engine.balancer.log if self.engine.balancer else []
    new = log[self._rebalances_logged:]
    self._rebalances_logged = len(log)
    if new:
      with open(os.path.join(self.workdir, 'rebalances.jsonl'), 'a', encoding='utf-8') as f:
        f.writelines(json.dumps(dict(d, step=self.step)) + '\n' for d in new)
    return len(new)

  # -- the run ------------------------------------------------------------------------

  def run(self, log=print) -> dict:
    """Train until `spec.steps`, resuming from the workdir's checkpoints. The first
    Ctrl-C stops at the end of the current step, saved; a rerun resumes."""
    log(self.spec.placement.describe())
    for line in self.journal.store.recovered:
      log(f'warning: {line}')
    start_step = self.restore(log)
    if start_step:
      log(f'resumed from step {start_step} in {self.workdir}')
    writer = MetricsWriter(self.workdir, start_step)
    for problem in writer.problems:
      log(f'warning: {problem}')
    trace = os.path.join(self.workdir, spans.TRACE_FILE)
    self.recorder.write_to(spans.TraceWriter(trace, start_step))
    stalls = StallWatch()
    t0 = self.clock.now()
    try:
      with StopRequest() as stop:
        while self.step < self.spec.steps and not stop.requested:
          lines = self.run_step()
          for agent, values in lines.items():
            writer.write(self.step, agent, values)
            if agent != TEAM and values.get('updated'):
              warning = stalls.update(agent, self.step, values['zero_spread'],
                                      values.get('entropy', math.nan), values['accuracy'])
              if warning:
                log(f'warning: {warning}')
          if self.step % max(1, self.spec.steps // 100) == 0 or self.step == start_step + 1:
            log(format_step(self.step, self.spec.steps, lines))
          if (self.step % self.spec.checkpoint_every == 0 or self.step == self.spec.steps
              or stop.requested):
            self.save()
        if stop.requested:
          log(f'stopped at step {self.step} of {self.spec.steps} in {self.workdir} (saved); '
              'rerun the same command to resume.')
    finally:
      writer.close()
      self.close()
    return write_summary(self.workdir, self.clock.now() - t0,
                         utilization.run_summary(spans.load_spans(trace)), steps=self.step)

  def close(self) -> None:
    """Finish pending checkpoint saves and store writes; release the store."""
    for agent in self.agents.values():
      agent.close()
    self.journal.close()
    self.recorder.close()
