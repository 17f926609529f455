"""JointOrchestrator: owns policy versions and the schedule.

Schedule `sync` (the reference every faster schedule must equal). A step rolls
out waves of queries, every agent serving its current version, until every
agent's buffer holds its global batch or `max_waves` waves were served. Then each
agent whose batch is full trains, one after another: its first `global_batch`
rows in (query, turn) order, whole GRPO groups only, in micro-batches whose
gradients are accumulated, then one optimizer step; the new weights go to its
sampler as the next version, and rows past the batch are dropped (counted as
surplus: they belong to the old version). An agent whose batch is not full keeps
its rows for the next step; it has not changed version, so they stay on-policy.
No agent waits on another's batch, and a cold agent never stalls the team.

The other schedules give the same numbers and differ only in *when* work runs:
- `sync_parallel`: after the rollout, the full agents train at the same time.
- `flexmarl`: the micro-batch pipeline. Each agent's batch is built as its groups
  arrive, wave by wave; a micro-batch's gradient is dispatched as soon as it is
  complete, and runs on the agent's devices while the rollout goes on. Once the
  agent's batch is full, its optimizer step is dispatched at once, however long the
  other agents' batches take; the new weights are published at the end of the step
  (the rows it is still served until then are surplus, as under `sync`). Batches and
  micro-batches are cut exactly as under `sync`, and accumulated in the same order,
  so the parameters are the same.

`async:k` trades exactness for overlap (bounded staleness). At the start of a step,
every agent whose buffer holds a global batch trains on its oldest rows (dispatched
to its training devices, not awaited) while the rollout of the step goes on serving
the weights from before that update; the new weights are published when both are
done. Rows are not dropped when a batch is full: they wait for the next one, as long
as they are at most k versions older than the parameters they would update; older
rows are dropped, never trained on, and counted (`stale_dropped`). The loss's importance ratio is taken against each row's
behaviour logprobs, so it corrects for the lag. Which version serves which wave is
fixed by the step count alone, so runs stay reproducible and resumable.

Data moves forward only: workflow → RolloutEngine → groups (written to the
ExperienceStore, and cut into batches) → AgentTrainer → weights back to the sampler.
Nothing but this class changes a version.

Restarts: the run resumes from the newest checkpoint that every agent has, with the
rows each agent had not yet trained on (the checkpoint names them; they are read back
from the ExperienceStore), and serves the next queries again. Sampling
keys depend only on (seed, agent, version, sample_id), so it draws the same rows as
the run that died; the store keeps each row once and marks rows consumed only once a
checkpoint holds the update that trained on them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np

from flexmarl.config import AgentSpec, TeamSpec
from flexmarl.metrics.writer import TEAM, MetricsWriter, read_metrics
from flexmarl.models import sharding
from flexmarl.rollout.engine import EpisodeResult, RolloutEngine, Turn
from flexmarl.rollout.sampler import EmbeddedSampler
from flexmarl.store.experience_store import ExperienceStore, Row
from flexmarl.tokenizer import TextTokenizer
from flexmarl.train import grpo
from flexmarl.train.checkpoint import AgentCheckpointer
from flexmarl.train.trainer import AgentTrainer, TrainBatch
from flexmarl.workflows.base import Query, Workflow


@dataclasses.dataclass
class Group:
  """One served request with its rewards: the unit GRPO normalizes over."""

  turn: Turn
  rewards: np.ndarray
  advantages: np.ndarray  # fixed once the group is complete, before any gradient
  correct: np.ndarray  # 1.0 / 0.0 per sample, NaN where the workflow did not say

  @property
  def size(self) -> int:
    return len(self.rewards)


def collect_groups(results: Sequence[EpisodeResult], normalize_std: Mapping[str, bool]
                   ) -> dict[str, list[Group]]:
  """Per agent (the keys of `normalize_std`), the groups of `results` in (query, turn)
  order, with their GRPO advantages."""
  out: dict[str, list[Group]] = {a: [] for a in normalize_std}
  for res in results:
    for turn in res.turns:
      rewards = np.array([res.episode.rewards[s] for s in turn.sample_ids], np.float32)
      correct = np.array([float(res.episode.correct[s]) if s in res.episode.correct
                          else np.nan for s in turn.sample_ids], np.float32)
      adv = grpo.group_advantages(rewards, len(rewards), normalize_std[turn.agent])
      out[turn.agent].append(Group(turn, rewards, adv, correct))
  return out


def group_ref(g: Group) -> dict:
  """A buffered group as the checkpoint names it: its rows live in the ExperienceStore."""
  t = g.turn
  return dict(query_id=t.query_id, turn=t.turn, agent=t.agent, sample_ids=t.sample_ids,
              correct=g.correct.tolist())


def groups_from_store(store: ExperienceStore, agent: str, refs: Sequence[dict]) -> list[Group]:
  """The groups `refs` name, read back from the agent's store table (one read)."""
  ids = [s for ref in refs for s in ref['sample_ids']]
  inconsistent = (f'agent {agent!r}: the checkpoint carries rows that the store does not hold '
                  'with reward and advantage')
  try:
    rows = {r.sample_id: r for r in store.read(agent, sample_ids=ids,
                                                ready=('reward', 'advantage'))}
  except ValueError as e:  # rows missing altogether
    raise RuntimeError(f'{inconsistent}: {e}. The workdir is inconsistent.') from e
  missing = [s for s in ids if s not in rows]
  if missing:
    raise RuntimeError(f'{inconsistent}: {missing[:5]}. The workdir is inconsistent.')
  out = []
  for ref in refs:
    mine = [rows[s] for s in ref['sample_ids']]
    turn = Turn(ref['query_id'], ref['turn'], ref['agent'], mine[0].policy_version,
                mine[0].prompt_ids.tolist(), ref['sample_ids'], [r.response_ids for r in mine],
                [r.logprobs for r in mine])
    out.append(Group(turn, np.array([r.reward for r in mine], np.float32),
                     np.array([r.advantage for r in mine], np.float32),
                     np.asarray(ref['correct'], np.float32)))
  return out


def check_fits(group: Group, global_batch: int) -> None:
  """A GRPO group is never split, so it must fit in one global batch."""
  if group.size > global_batch:
    raise ValueError(
        f'agent {group.turn.agent!r}: query {group.turn.query_id} asked for a group of '
        f'{group.size} samples (generate(n={group.size})), more than its global_batch='
        f'{global_batch}; GRPO groups are never split: raise '
        f'config.agents.{group.turn.agent}.global_batch or ask for fewer samples.')


class BatchBuilder:
  """One agent's global batch at its current version, built group by group.

  Groups arrive in (query, turn) order. Until the batch is full (the rows offered
  reach `global_batch`), a group is kept while it fits in `global_batch` rows, else
  counted as surplus; once it is full, every group is surplus. Kept groups are cut into
  micro-batches of `micro_groups` groups, in order: the cut never depends on when
  groups arrived.
  """

  def __init__(self, global_batch: int, micro_groups: int):
    self.global_batch, self.micro_groups = global_batch, micro_groups
    self.kept: list[Group] = []
    self.kept_rows = self.surplus_rows = 0
    self.cut = 0  # kept groups already handed out in micro-batches

  def add(self, group: Group) -> None:
    check_fits(group, self.global_batch)
    if not self.full and self.kept_rows + group.size <= self.global_batch:
      self.kept.append(group)
      self.kept_rows += group.size
    else:
      self.surplus_rows += group.size

  @property
  def full(self) -> bool:
    return self.kept_rows + self.surplus_rows >= self.global_batch

  def micro_batches(self, final: bool = False) -> list[list[Group]]:
    """The micro-batches completed since the last call (with `final`, the remainder too)."""
    out = []
    while len(self.kept) - self.cut >= self.micro_groups or (final and self.cut < len(self.kept)):
      out.append(self.kept[self.cut:self.cut + self.micro_groups])
      self.cut += len(out[-1])
    return out


class StaleBuffer:
  """One agent's served groups under `async:k`, oldest first.

  The rollout runs ahead of training, so a group may wait across steps. It is trained
  on while its version is at most `max_staleness` behind the parameters it updates;
  once it is older it is dropped (and counted), never trained on.
  """

  def __init__(self, global_batch: int, micro_groups: int, max_staleness: int):
    self.global_batch, self.micro_groups = global_batch, micro_groups
    self.max_staleness = max_staleness
    self.kept: list[Group] = []

  def add(self, group: Group) -> None:
    check_fits(group, self.global_batch)
    self.kept.append(group)

  def _fresh(self, group: Group, version: int) -> bool:
    return version - group.turn.version <= self.max_staleness

  def fresh_rows(self, version: int) -> int:
    """Rows that may still update parameters at `version`."""
    return sum(g.size for g in self.kept if self._fresh(g, version))

  def drop_stale(self, version: int) -> int:
    """Drop the groups too old to update parameters at `version`; returns their rows."""
    before = sum(g.size for g in self.kept)
    self.kept = [g for g in self.kept if self._fresh(g, version)]
    return before - sum(g.size for g in self.kept)

  def take(self) -> list[list[Group]]:
    """The oldest whole groups up to `global_batch` rows, cut into micro-batches."""
    batch, rows = [], 0
    while self.kept and rows + self.kept[0].size <= self.global_batch:
      rows += self.kept[0].size
      batch.append(self.kept.pop(0))
    return [batch[i:i + self.micro_groups] for i in range(0, len(batch), self.micro_groups)]


def batch_stats(groups: Sequence[Group]) -> dict[str, float]:
  """Reward mean/std and exact-match accuracy over the rows of `groups`."""
  if not groups:
    return dict(reward_mean=math.nan, reward_std=math.nan, accuracy=math.nan)
  rewards = np.concatenate([g.rewards for g in groups])
  correct = np.concatenate([g.correct for g in groups])
  known = correct[~np.isnan(correct)]
  return dict(reward_mean=float(rewards.mean()), reward_std=float(rewards.std()),
              accuracy=float(known.mean()) if known.size else math.nan)


def device_slices(spec: TeamSpec, devices: Sequence[jax.Device]
                  ) -> tuple[dict[str, list], dict[str, list]]:
  """Consecutive devices for each agent's training mesh, in config order, then (with
  `rollout.devices=separate`) as many again for each agent's rollout instance.

  Returns (training devices, rollout devices) per agent; shared rollout devices are
  the training ones."""
  free = iter(devices)
  take = lambda a: [next(free) for _ in range(a.mesh_shape[0] * a.mesh_shape[1])]
  train = {name: take(a) for name, a in spec.agents.items()}
  rollout = ({name: take(a) for name, a in spec.agents.items()}
             if spec.separate_rollout_devices else train)
  return train, rollout


class JointOrchestrator:

  def __init__(self, spec: TeamSpec, workflow: Workflow, tokenizer: TextTokenizer,
               workdir: str, devices: Sequence[jax.Device] | None = None):
    self.spec, self.workflow, self.tokenizer, self.workdir = spec, workflow, tokenizer, workdir
    train_devices, rollout_devices = device_slices(spec, devices or jax.devices())
    self.trainers: dict[str, AgentTrainer] = {}
    self.samplers: dict[str, EmbeddedSampler] = {}
    for i, (name, a) in enumerate(spec.agents.items()):
      mesh = sharding.make_mesh(train_devices[name], a.mesh_shape)
      trainer = AgentTrainer(name, a.model, a.optimizer, a.grpo, mesh, seed=spec.seed * 1000 + i)
      self.trainers[name] = trainer
      rollout_mesh = sharding.make_mesh(rollout_devices[name], a.mesh_shape)
      self.samplers[name] = EmbeddedSampler(
          trainer.graphdef, trainer.params, max_prompt_len=spec.max_prompt_len,
          eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
          batch_multiple=rollout_mesh.shape['data'],
          shardings=(sharding.same_layout(trainer.shardings, rollout_mesh)
                     if spec.separate_rollout_devices else None))
    self.engine = RolloutEngine(
        self.samplers, {n: a.sampling for n, a in spec.agents.items()},
        {n: a.group_size for n, a in spec.agents.items()}, tokenizer, spec.seed)
    self.checkpointers = {n: AgentCheckpointer(workdir, n) for n in spec.agents}
    # Every served row, durably; rows are marked consumed once a checkpoint holds the
    # update that trained on them.
    self.store = ExperienceStore.open(os.path.join(workdir, 'store'), agents=list(spec.agents))
    self._trained_since_save: dict[str, list[str]] = {n: [] for n in spec.agents}
    # Rows are appended once a step per agent (an append costs ≈10 ms of fsyncs, however
    # small), on one background thread, in order, off the rollout's critical path.
    self._rows: dict[str, list[Row]] = {n: [] for n in spec.agents}
    self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='store')
    self._writes: list[concurrent.futures.Future] = []
    self.step = 0
    self.next_query = 0
    # Each agent's rows served, not yet trained on: its batch at its current version
    # (a BatchBuilder), or under `async:k` every row still fresh enough (a StaleBuffer).
    self.builders = {n: self._new_builder(n) for n in spec.agents}

  # -- versions and persistence -------------------------------------------------------

  def publish(self, name: str) -> None:
    """Send an agent's current weights to its rollout instance."""
    trainer = self.trainers[name]
    self.samplers[name].update_weights(trainer.params, trainer.version)

  def restore(self) -> int:
    """Resume from the newest step every agent has a checkpoint for; 0 if none."""
    common = set.intersection(*(set(c.steps()) for c in self.checkpointers.values()))
    if not common:
      return 0
    step = max(common)
    for name, ckpt in self.checkpointers.items():
      state, meta = ckpt.restore(step, self.trainers[name].train_state())
      self.trainers[name].load_train_state(state, meta['version'])
      self.publish(name)
      self.next_query = meta['next_query']
      for g in groups_from_store(self.store, name, meta['buffer']):
        self.builders[name].add(g)
      carried = [s for g in self.builders[name].kept for s in g.turn.sample_ids]
      if carried and self.store.count(name, sample_ids=carried, consumed=True):
        raise RuntimeError(
            f'agent {name!r}: checkpoint {step} carries rows that the store marks consumed '
            f'(trained on and checkpointed later); the workdir {self.workdir} is inconsistent.')
    self.step = step
    return step

  def save(self) -> None:
    """Checkpoint every agent; then mark the rows those updates trained on consumed.

    The rows a checkpoint carries over are read back from the store on restore, so
    every pending append is durable before any checkpoint is written."""
    self.flush_writes()
    meta = {'step': self.step, 'next_query': self.next_query}
    for name, ckpt in self.checkpointers.items():
      trainer = self.trainers[name]
      ckpt.save(self.step, trainer.train_state(),
                dict(meta, version=trainer.version,
                     buffer=[group_ref(g) for g in self.builders[name].kept]))
    for ckpt in self.checkpointers.values():
      ckpt.wait()
    for name, ids in self._trained_since_save.items():
      self.store.mark_consumed(name, ids)
      ids.clear()

  # -- one step -----------------------------------------------------------------------

  def queries(self, count: int) -> list[Query]:
    """The next `count` queries of the run's stream; each depends only on (seed, index)."""
    out = [self.workflow.make_query(np.random.default_rng([self.spec.seed, i]), f'q{i}')
           for i in range(self.next_query, self.next_query + count)]
    self.next_query += count
    return out

  def _new_builder(self, name: str) -> BatchBuilder | StaleBuffer:
    a = self.spec.agents[name]
    if self.spec.schedule == 'async':
      return StaleBuffer(a.global_batch, a.micro_batch // a.group_size, self.spec.max_staleness)
    return BatchBuilder(a.global_batch, a.micro_batch // a.group_size)

  def rollout(self, take: Callable[[str, list[Group]], None], done: Callable[[], bool]
              ) -> tuple[int, dict[str, int]]:
    """Serve waves of queries until `done()` (or `max_waves`), handing each agent's
    groups to `take` wave by wave, in (query, turn) order.

    Returns the number of queries and, per agent, the response tokens served."""
    queries, tokens = 0, {n: 0 for n in self.spec.agents}
    normalize = {n: a.grpo.normalize_std for n, a in self.spec.agents.items()}
    for _ in range(self.spec.max_waves):
      first = self.next_query
      batch = self.queries(self.spec.queries_per_wave)
      results = self.engine.run(self.workflow, batch, first)
      queries += len(batch)
      for name, gs in collect_groups(results, normalize).items():
        self.record(name, gs)
        take(name, gs)
        tokens[name] += sum(len(t) for g in gs for t in g.turn.tokens)
      if done():
        break
    return queries, tokens

  def record(self, name: str, groups: Sequence[Group]) -> None:
    """Queue served rows, with rewards and advantages, for the agent's store table."""
    for g in groups:
      t = g.turn
      self._rows[name] += [
          Row(sid, t.version, t.prompt_ids, tokens, logprobs, float(r), float(a))
          for sid, tokens, logprobs, r, a in zip(t.sample_ids, t.tokens, t.logprobs,
                                                 g.rewards, g.advantages)]

  def write_rows(self) -> None:
    """Append the queued rows in the background.

    A rerun after a crash serves the same queries at the same versions and so draws
    the same rows: their append is a no-op (and raises if anything differs)."""
    self.flush_writes(wait=False)
    for name, rows in self._rows.items():
      if rows:
        self._writes.append(self._writer.submit(self.store.append, name, rows))
    self._rows = {n: [] for n in self.spec.agents}

  def flush_writes(self, wait: bool = True) -> None:
    """Re-raise any failed append; with `wait`, first let every pending one finish."""
    pending = []
    for f in self._writes:
      if wait or f.done():
        f.result()
      else:
        pending.append(f)
    self._writes = pending

  def accumulate(self, name: str, micro: Sequence[Group]) -> None:
    """Add one micro-batch's gradient to the agent's accumulator."""
    a: AgentSpec = self.spec.agents[name]
    trainer = self.trainers[name]
    adv = np.concatenate([g.advantages for g in micro])
    trainer.accumulate(TrainBatch.from_rows(
        [g.turn.prompt_ids for g in micro for _ in range(g.size)],
        [t for g in micro for t in g.turn.tokens],
        [lp for g in micro for lp in g.turn.logprobs], adv,
        prompt_len=self.spec.max_prompt_len, response_len=a.sampling.max_new_tokens,
        pad_id=self.tokenizer.pad_id, batch_multiple=trainer.batch_multiple))

  def start_step(self, name: str, batch: Sequence[Group],
                 micro_batches: Sequence[Sequence[Group]]) -> Callable[[], dict[str, float]]:
    """Accumulate `micro_batches` (those of `batch` not yet accumulated) and dispatch
    the agent's optimizer step, without waiting for it; returns a function that waits
    for the step and gives its stats.

    The staleness of each row (versions between the one that sampled it and the
    parameters it updates) is measured here, where the update happens."""
    t0 = time.perf_counter()
    lags = np.array([self.trainers[name].version - g.turn.version
                     for g in batch for _ in range(g.size)])
    self._trained_since_save[name] += [s for g in batch for s in g.turn.sample_ids]
    for micro in micro_batches:
      self.accumulate(name, micro)
    result = self.trainers[name].dispatch_apply()

    def finish() -> dict[str, float]:
      return dict(result(), train_s=time.perf_counter() - t0, rows=len(lags),
                  staleness_max=int(lags.max()), staleness_mean=float(lags.mean()))
    return finish

  def train_agent(self, name: str) -> dict[str, float]:
    """Train the agent on its full batch, wait for the step, publish the new weights."""
    builder = self.builders[name]
    stats = self.start_step(name, builder.kept, builder.micro_batches(final=True))()
    self.publish(name)
    return stats

  def run_step(self) -> dict[str, dict[str, float]]:
    """One step of the configured schedule; returns its metrics lines."""
    if self.spec.schedule == 'async':
      return self._async_step()
    return self._sync_step()

  def _sync_step(self) -> dict[str, dict[str, float]]:
    """`sync`, `sync_parallel`, `flexmarl`: roll out, then train the agents whose batch
    is full (under `flexmarl`, micro-batches completed during the rollout already ran)."""
    t0 = time.perf_counter()
    versions = {n: t.version for n, t in self.trainers.items()}
    early = {n: 0 for n in self.spec.agents}
    stepped: dict[str, Callable[[], dict[str, float]]] = {}  # flexmarl: dispatched steps

    def take(name: str, groups: list[Group]) -> None:
      builder = self.builders[name]
      for g in groups:
        builder.add(g)  # once the batch is full, surplus
      if self.spec.schedule != 'flexmarl' or name in stepped:
        return
      # Dispatched, not awaited: each runs on the agent's training devices while the
      # rollout goes on; the step too, once the batch is full.
      for micro in builder.micro_batches(final=builder.full):
        self.accumulate(name, micro)
        early[name] += 1
      if builder.full:
        stepped[name] = self.start_step(name, builder.kept, [])

    queries, served = self.rollout(take, lambda: all(b.full for b in self.builders.values()))
    rollout_s = time.perf_counter() - t0
    full = [n for n, b in self.builders.items() if b.full]
    if self.spec.schedule == 'sync_parallel':
      with concurrent.futures.ThreadPoolExecutor(max(1, len(full))) as pool:
        stats = dict(zip(full, pool.map(self.train_agent, full)))
    elif self.spec.schedule == 'flexmarl':
      stats = {name: stepped[name]() for name in full}
      for name in full:
        self.publish(name)
    else:
      stats = {name: self.train_agent(name) for name in full}
    lines: dict[str, dict[str, float]] = {}
    for name, builder in self.builders.items():
      line = dict(batch_stats(builder.kept), policy_version=versions[name],
                  tokens=served[name], rows=builder.kept_rows, updated=int(name in stats),
                  early_micro_batches=early[name])
      if name in stats:
        line.update(surplus_rows=builder.surplus_rows, **stats[name])
        self.builders[name] = self._new_builder(name)
      lines[name] = line
    return self._finish_step(lines, t0, rollout_s, queries)

  def _async_step(self) -> dict[str, dict[str, float]]:
    """`async:k`: agents with a full buffer train while the rollout serves the weights
    from before those updates; publish when both are done."""
    t0 = time.perf_counter()
    versions = {n: t.version for n, t in self.trainers.items()}
    dropped = {n: b.drop_stale(versions[n]) for n, b in self.builders.items()}
    batches = {n: b.take() for n, b in self.builders.items()
               if b.fresh_rows(versions[n]) >= self.spec.agents[n].global_batch}
    # The versions this step's rows will be trained at, at the earliest.
    after = {n: v + (n in batches) for n, v in versions.items()}
    served: dict[str, list[Group]] = {n: [] for n in self.spec.agents}

    def take(name: str, groups: list[Group]) -> None:
      served[name] += groups
      for g in groups:
        self.builders[name].add(g)

    def done() -> bool:
      return all(b.fresh_rows(after[n]) >= self.spec.agents[n].global_batch
                 for n, b in self.builders.items())

    # Dispatched, not awaited: the updates run on the training devices while the
    # rollout serves the weights the samplers hold (from before these updates).
    training = {n: self.start_step(n, [g for m in micro for g in m], micro)
                for n, micro in batches.items()}
    queries, tokens = self.rollout(take, done)
    rollout_s = time.perf_counter() - t0
    stats = {n: finish() for n, finish in training.items()}
    for name in stats:
      self.publish(name)
    lines: dict[str, dict[str, float]] = {}
    for name, buffer in self.builders.items():
      line = dict(batch_stats(served[name]), policy_version=versions[name],
                  tokens=tokens[name], updated=int(name in stats), stale_dropped=dropped[name],
                  buffered_rows=sum(g.size for g in buffer.kept))
      line.update(stats.get(name, {}))
      lines[name] = line
    return self._finish_step(lines, t0, rollout_s, queries)

  def _finish_step(self, lines: dict[str, dict[str, float]], t0: float, rollout_s: float,
                   queries: int) -> dict[str, dict[str, float]]:
    """Add step times and the team line; queue the step's rows for the store."""
    step_s = time.perf_counter() - t0
    tokens = sum(l['tokens'] for l in lines.values())
    for line in lines.values():
      line['step_time_s'] = step_s
    self.write_rows()
    lines[TEAM] = dict(
        reward_mean=float(np.nanmean([l['reward_mean'] for l in lines.values()])),
        reward_std=float(np.nanmean([l['reward_std'] for l in lines.values()])),
        accuracy=float(np.nanmean([l['accuracy'] for l in lines.values()])),
        policy_version=self.step, tokens=tokens, step_time_s=step_s, rollout_s=rollout_s,
        train_s=step_s - rollout_s, queries=queries, tokens_per_s=tokens / step_s,
        updated=sum(l['updated'] for l in lines.values()))
    self.step += 1
    return lines

  # -- the run ------------------------------------------------------------------------

  def run(self, log=print) -> dict:
    """Train until `spec.steps`, resuming from the workdir's checkpoints."""
    start_step = self.restore()
    if start_step:
      log(f'resumed from step {start_step} in {self.workdir}')
    writer = MetricsWriter(self.workdir, start_step)
    t0 = time.perf_counter()
    try:
      while self.step < self.spec.steps:
        lines = self.run_step()
        for agent, values in lines.items():
          writer.write(self.step, agent, values)
        if self.step % max(1, self.spec.steps // 100) == 0 or self.step == start_step + 1:
          log(format_step(self.step, self.spec.steps, lines))
        if self.step % self.spec.checkpoint_every == 0 or self.step == self.spec.steps:
          self.save()
    finally:
      writer.close()
      self.close()
    return write_summary(self.workdir, time.perf_counter() - t0)

  def close(self) -> None:
    """Finish pending checkpoint saves and store writes; release the store."""
    for c in self.checkpointers.values():
      c.wait()
    self.flush_writes()
    self._writer.shutdown()
    self.store.close()


def format_step(step: int, steps: int, lines: Mapping[str, Mapping[str, float]]) -> str:
  team = lines[TEAM]
  agents = '  '.join(f"{n}: r={l['reward_mean']:.2f} acc={l['accuracy']:.2f}"
                     for n, l in lines.items() if n != TEAM)
  return f"step {step}/{steps} [{team['step_time_s']:.2f}s, {team['tokens_per_s']:.0f} tok/s]  {agents}"


def write_summary(workdir: str, wall_s: float, window: int = 5) -> dict:
  """Per agent: reward and accuracy of its first update, and the mean over its last
  `window` updates (single steps of small batches are noisy); NaN for an agent that
  has not updated yet."""
  lines = read_metrics(os.path.join(workdir, 'metrics.jsonl'))
  agents = sorted({l['agent'] for l in lines} - {TEAM})
  summary: dict = {'wall_s': wall_s, 'agents': {}}
  for agent in agents:
    mine = sorted((l for l in lines if l['agent'] == agent and l['updated']),
                  key=lambda l: l['step'])
    first, last = mine[:1], mine[-window:]
    mean = lambda ls, key: float(np.mean([l[key] for l in ls])) if ls else math.nan
    summary['agents'][agent] = {
        'first_reward': mean(first, 'reward_mean'), 'first_accuracy': mean(first, 'accuracy'),
        'last_reward': mean(last, 'reward_mean'), 'last_accuracy': mean(last, 'accuracy'),
        'updates': len(mine)}
  team = [l for l in lines if l['agent'] == TEAM]
  run_time = sum(l['step_time_s'] for l in team)
  summary['tokens_per_s'] = sum(l['tokens'] for l in team) / run_time if run_time else 0.0
  summary['steps'] = len(team)
  with open(os.path.join(workdir, 'summary.json'), 'w', encoding='utf-8') as f:
    json.dump(summary, f, indent=2)
  return summary
