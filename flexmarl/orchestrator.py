"""JointOrchestrator: the run loop. It owns the query stream, the metrics, save and
restore; the schedule (`schedules.py`) decides when rollout and training run, and calls
back only through the narrow `StepContext` the orchestrator implements. The team is
built in `flexmarl.build`.

Data moves forward only: workflow → RolloutEngine → groups (journaled to the
ExperienceStore, and cut into batches by the schedule) → the agent's update → weights
back to its rollout instances. An agent's version changes only in `Agent.update`, which
only the schedule calls.

Restarts: the run resumes from the newest checkpoint that every agent has, with the
rows each agent had not yet trained on (the checkpoint names them; they are read back
from the ExperienceStore), and serves the next queries again. Sampling keys depend
only on (seed, agent, version, sample_id), so it draws the same rows as the run that
died; the store keeps each row once and marks rows consumed only once a checkpoint
holds the update that trained on them.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np

from flexmarl.agent import Agent
from flexmarl.config import TeamSpec
from flexmarl.core.clock import Clock
from flexmarl.core.interfaces import Stats
from flexmarl.data.groups import Group
from flexmarl.data.journal import CarriedRowsLost, Journal, group_ref, groups_from_store
from flexmarl.journaled_rollout import JournaledRollout
from flexmarl.metrics import spans, utilization
from flexmarl.metrics.no_update import UpdateWatch
from flexmarl.metrics.stall import StallWatch
from flexmarl.metrics.starvation import StarvationWatch
from flexmarl.metrics.summary import format_step, write_summary
from flexmarl.metrics.team import team_line
from flexmarl.metrics.writer import TEAM, MetricsWriter
from flexmarl.rollout.engine import RolloutEngine
from flexmarl.rollout.held_out import evaluate, format_eval
from flexmarl.rollout.stream import RolloutStream
from flexmarl.runtime import memory
from flexmarl.runtime.interrupt import StopRequest
from flexmarl.schedules import Lines, Schedule, StepResult
from flexmarl.train.checkpoint import restore_latest
from flexmarl.workflows.base import Query, Workflow


class JointOrchestrator:
  """Runs a built team (see `flexmarl.build`): the step loop, metrics, save and restore.
  It is the schedule's `StepContext`: the schedule calls back only through `rollout`,
  `accumulate`, `update`, `publish` and `version`."""

  def __init__(self, spec: TeamSpec, workflow: Workflow, agents: Mapping[str, Agent],
               rollout_engine: RolloutEngine, journal: Journal, schedule: Schedule, workdir: str,
               clock: Clock, recorder: spans.SpanRecorder):
    self.spec, self.workflow, self.workdir = spec, workflow, workdir
    self.agents, self.rollout_engine, self.journal = dict(agents), rollout_engine, journal
    self.schedule, self.clock, self.recorder = schedule, clock, recorder
    self.step = 0
    self.next_query = 0
    self._rebalances_logged = 0
    self._started: RolloutStream | None = None  # the next step's, begun early
    self._step_end = 0.0  # when the last step's schedule returned
    self._skipped = 0  # queries the last step's admission skipped
    self._generated = dict.fromkeys(spec.agents, 0)  # response tokens sampled, so far
    self.on_close: list[Callable[[], None]] = []  # run by `close`, last
    self.starvation = StarvationWatch(list(spec.agents), spec.rollout.max_step_queries)

  # -- the step context: what a schedule calls ------------------------------------------

  def version(self, name: str) -> int:
    return self.agents[name].version

  def query(self, index: int) -> Query:
    """Query `index` of the run's stream; it depends only on (seed, index)."""
    return self.workflow.make_query(np.random.default_rng([self.spec.seed, index]), f'q{index}')

  @contextlib.contextmanager
  def rollout(self) -> Iterator[JournaledRollout]:
    """Stream queries from the next unconsumed one (see `Rollout`), or go on with the
    stream `start_rollout` began; every agent expects to train (`Agent.expect_training`).
    Leaving the block abandons the queries still in flight: they are served again next
    step (at the next version), so what a step consumes depends only on the stream."""
    results, self._started = self._started or self._open_stream(), None
    for agent in self.agents.values():
      agent.expect_training()
    rollout = JournaledRollout(results, self.spec, self.journal, self.starvation, self.agents)
    try:
      yield rollout
    finally:
      results.close()
      self.next_query += rollout.queries
      self._skipped = rollout.skipped

  def start_rollout(self) -> None:
    """Dispatch the next step's first requests now, to the weights published so far
    (an instance takes an update's weights behind it): they generate while this step
    waits for its stats and finishes its host work (metrics, the store's queue, a
    checkpoint). The next `rollout` continues this stream. A no-op after the run's
    last step."""
    if self._started is None and self.step + 1 < self.spec.steps:
      self._started = self._open_stream()
      self._started.start()

  def serve_from(self, index: int) -> None:
    """The next step serves queries from stream index `index` on (a rollout begun
    early is abandoned)."""
    self._drop_started()
    self.next_query = index

  def _open_stream(self) -> RolloutStream:
    """The query stream from the next unconsumed query, admitted by the schedule's
    demand (rollout/admission.py)."""
    source = ((i, self.query(i)) for i in itertools.count(self.next_query))
    filtered = frozenset(n for n, a in self.spec.agents.items() if a.grpo.dynamic_sampling)
    return self.rollout_engine.stream(self.workflow, source, need=self.schedule.needs,
                                      filtered=filtered)

  def _drop_started(self) -> None:
    """Abandon a rollout `start_rollout` began (before a restore, or at the end)."""
    if self._started is not None:
      self._started.close()
      self._started = None

  def accumulate(self, name: str, micro: Sequence[Group]) -> None:
    """Dispatch one micro-batch's gradient of agent `name`."""
    self.agents[name].accumulate(micro)

  def update(self, name: str, batch: Sequence[Group],
             micro_batches: Sequence[Sequence[Group]]) -> Callable[[], Stats]:
    """Dispatch agent `name`'s update on `batch` (see `Agent.update`); its rows are
    marked trained on in the store once a checkpoint holds the update."""
    self.journal.trained(name, batch)
    return self.agents[name].update(batch, micro_batches)

  def publish(self, name: str) -> None:
    self.agents[name].publish()

  # -- versions and persistence -------------------------------------------------------

  def restore(self, log=print) -> int:
    """Resume from the newest step every agent has an intact checkpoint for (a damaged
    newer one is skipped, and said so); 0 if none."""
    self._drop_started()  # it would serve queries from before the restore
    step, states, metas, warnings = restore_latest(
        {n: a.checkpointer for n, a in self.agents.items()},
        {n: a.train_state() for n, a in self.agents.items()})
    for warning in warnings:
      log(f'warning: {warning}')
    if not step:
      return 0
    for name, agent in self.agents.items():
      meta = metas[name]
      agent.restore(states[name], meta)
      self.next_query = meta['next_query']
      self.journal.resumed(name, meta.get('trained', []))
      groups = self._carried_groups(name, step, meta['buffer'], log)
      self.schedule.carry(name, groups)
      carried = [s for g in groups for s in g.served.sample_ids]
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
    """Checkpoint every agent (its carried rows are read back from the store on restore,
    so every append is durable first); then mark the rows its updates trained on consumed
    (it names them too: a resume from it marks them, should a crash cut the marks off)."""
    self.journal.flush()
    meta = {'step': self.step, 'next_query': self.next_query}
    carried = self.schedule.carried()
    for name, agent in self.agents.items():
      agent.checkpointer.save(self.step, agent.train_state(),
                              dict(meta, **agent.counters(),
                                   buffer=[group_ref(g) for g in carried[name]],
                                   trained=self.journal.to_consume(name)))
    for agent in self.agents.values():
      agent.checkpointer.wait()
    self.journal.checkpointed(self.step, {n: [s for g in groups for s in g.served.sample_ids]
                                          for n, groups in carried.items()},
                              self.spec.store_keep_steps)

  # -- a step -------------------------------------------------------------------------

  def run_step(self) -> Lines:
    """One step of the configured schedule; returns its metrics lines (per agent, and
    the team's). Queues the step's rows for the store and logs the balancer's moves."""
    self.recorder.step = self.step + 1  # the step the metrics lines will carry
    # A step whose rollout began in the step before begins where that one ended.
    t0 = self._step_end if self._started is not None else self.clock.now()
    result: StepResult = self.schedule.run_step(self)
    self._step_end = self.clock.now()
    step_s = self._step_end - t0
    lines = result.lines
    generated = self.rollout_engine.generated
    for name, line in lines.items():
      # Everything sampled for the agent since the last step, trained on or not (surplus
      # rows, queries cut in flight): against `trained_tokens`, what admission saves.
      line['generated_tokens'] = generated[name] - self._generated[name]
      self._generated[name] = generated[name]
      line['step_time_s'] = step_s
      line['instances'] = len(self.agents[name].pool.instances)
      line.update(self.agents[name].swap_stats())  # training pool: meshes, swaps
    lines[TEAM] = team_line(lines, step_s=step_s, rollout_s=result.rollout_s,
                            queries=result.queries, skipped_queries=self._skipped,
                            tokens=result.tokens,
                            rebalances=self._log_rebalances(),
                            utilization=self._utilization())
    # After the spans' drain: the store's thread would hold the interpreter's lock
    # while the drain waits for the timeline's thread.
    self.journal.write(self.step + 1)
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
    log = self.rollout_engine.balancer.log if self.rollout_engine.balancer else []
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
    log(memory.describe_memory(self.spec.agents, self.spec.placement))
    for line in self.journal.store.recovered:
      log(f'warning: {line}')
    writer = None
    try:  # whatever fails from here on, close() still stops the parts (and Ray's workers)
      start_step = self.restore(log)
      if start_step:
        log(f'resumed from step {start_step} in {self.workdir}')
      writer = MetricsWriter(self.workdir, start_step)
      for problem in writer.problems:
        log(f'warning: {problem}')
      trace = os.path.join(self.workdir, spans.TRACE_FILE)
      self.recorder.write_to(spans.TraceWriter(trace, start_step, self.spec.trace_steps))
      stalls, t0 = StallWatch(), self.clock.now()
      batches = {n: a.global_batch for n, a in self.spec.agents.items()}
      waits = UpdateWatch(batches, self.spec.rollout.max_step_queries)
      if not start_step and self.spec.evaluates_after(0):
        self.evaluate(writer, log)  # the starting weights: the "before" figure
      with StopRequest() as stop:
        while self.step < self.spec.steps and not stop.requested:
          lines = self.run_step()
          for agent, values in lines.items():
            writer.write(self.step, agent, values)
            if agent != TEAM and values.get('updated'):
              for line in stalls.lines(agent, self.step, values,
                                       self.agents[agent].spec.grpo):
                log(line)
          for warning in [*self.starvation.end_step(self.step),
                          *waits.end_step(self.step, lines)]:
            log(f'warning: {warning}')
          if self.step % max(1, self.spec.steps // 100) == 0 or self.step == start_step + 1:
            log(format_step(self.step, self.spec.steps, lines))
          if self.spec.evaluates_after(self.step):
            self.evaluate(writer, log)
          if (self.step % self.spec.checkpoint_every == 0 or self.step == self.spec.steps
              or stop.requested):
            self.save()
        if stop.requested:
          log(f'stopped at step {self.step} of {self.spec.steps} in {self.workdir} (saved); '
              'rerun the same command to resume.')
    finally:
      if writer is not None:
        writer.close()
      self.close()
    return write_summary(self.workdir, self.clock.now() - t0,
                         utilization.run_summary(spans.load_spans(trace)), steps=self.step,
                         global_batches=batches,
                         max_step_queries=self.spec.rollout.max_step_queries)

  def evaluate(self, writer: MetricsWriter, log=print) -> None:
    """Held-out evaluation of the published weights (`held_out`); an early rollout is dropped."""
    self._drop_started()
    lines = evaluate(self.rollout_engine, self.workflow, self.clock)
    writer.write_lines(self.step, lines)
    log(format_eval(self.step, lines))

  def close(self) -> None:
    """Finish pending checkpoint saves and store writes; release the store; then run
    `on_close` (e.g. stop the run's worker processes). Each runs even if one before it
    raised (the error is raised once all have run)."""
    self._drop_started()
    with contextlib.ExitStack() as stack:  # runs its callbacks last-in first-out
      for close in [*(a.close for a in self.agents.values()), self.journal.close,
                    self.recorder.close, *self.on_close][::-1]:
        stack.callback(close)
