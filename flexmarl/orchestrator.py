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

Data moves forward only: workflow → RolloutEngine → groups → AgentTrainer →
weights back to the sampler. Nothing but this class changes a version.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from flexmarl.config import AgentSpec, TeamSpec
from flexmarl.metrics.writer import TEAM, MetricsWriter, read_metrics
from flexmarl.models import sharding
from flexmarl.rollout.engine import EpisodeResult, RolloutEngine, Turn
from flexmarl.rollout.sampler import EmbeddedSampler
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
  correct: np.ndarray  # 1.0 / 0.0 per sample, NaN where the workflow did not say

  @property
  def size(self) -> int:
    return len(self.rewards)


def collect_groups(results: Sequence[EpisodeResult], agents: Sequence[str]
                   ) -> dict[str, list[Group]]:
  """Per agent, the groups of `results` in (query, turn) order."""
  out: dict[str, list[Group]] = {a: [] for a in agents}
  for res in results:
    for turn in res.turns:
      rewards = np.array([res.episode.rewards[s] for s in turn.sample_ids], np.float32)
      correct = np.array([float(res.episode.correct[s]) if s in res.episode.correct
                          else np.nan for s in turn.sample_ids], np.float32)
      out[turn.agent].append(Group(turn, rewards, correct))
  return out


def group_to_json(g: Group) -> dict:
  """A buffered group as JSON (checkpoint metadata): rows carried to the next step."""
  t = g.turn
  return dict(query_id=t.query_id, turn=t.turn, agent=t.agent, version=t.version,
              prompt_ids=t.prompt_ids, sample_ids=t.sample_ids,
              tokens=[x.tolist() for x in t.tokens], logprobs=[x.tolist() for x in t.logprobs],
              rewards=g.rewards.tolist(), correct=g.correct.tolist())


def group_from_json(d: dict) -> Group:
  turn = Turn(d['query_id'], d['turn'], d['agent'], d['version'], d['prompt_ids'],
              d['sample_ids'], [np.asarray(x, np.int32) for x in d['tokens']],
              [np.asarray(x, np.float32) for x in d['logprobs']])
  return Group(turn, np.asarray(d['rewards'], np.float32), np.asarray(d['correct'], np.float32))


def take_batch(groups: Sequence[Group], global_batch: int) -> tuple[list[Group], int]:
  """The first whole groups that fill `global_batch` rows; and the surplus row count."""
  kept, rows = [], 0
  for g in groups:
    if rows + g.size <= global_batch:
      kept.append(g)
      rows += g.size
  return kept, sum(g.size for g in groups) - rows


def batch_stats(groups: Sequence[Group]) -> dict[str, float]:
  """Reward mean/std and exact-match accuracy over the rows of `groups`."""
  if not groups:
    return dict(reward_mean=math.nan, reward_std=math.nan, accuracy=math.nan)
  rewards = np.concatenate([g.rewards for g in groups])
  correct = np.concatenate([g.correct for g in groups])
  known = correct[~np.isnan(correct)]
  return dict(reward_mean=float(rewards.mean()), reward_std=float(rewards.std()),
              accuracy=float(known.mean()) if known.size else math.nan)


def device_slices(spec: TeamSpec, devices: Sequence[jax.Device]) -> dict[str, list]:
  """Consecutive devices for each agent's mesh, in config order."""
  out, start = {}, 0
  for name, a in spec.agents.items():
    count = a.mesh_shape[0] * a.mesh_shape[1]
    out[name] = list(devices[start:start + count])
    start += count
  return out


class JointOrchestrator:

  def __init__(self, spec: TeamSpec, workflow: Workflow, tokenizer: TextTokenizer,
               workdir: str, devices: Sequence[jax.Device] | None = None):
    self.spec, self.workflow, self.tokenizer, self.workdir = spec, workflow, tokenizer, workdir
    slices = device_slices(spec, devices or jax.devices())
    self.trainers: dict[str, AgentTrainer] = {}
    self.samplers: dict[str, EmbeddedSampler] = {}
    for i, (name, a) in enumerate(spec.agents.items()):
      mesh = sharding.make_mesh(slices[name], a.mesh_shape)
      trainer = AgentTrainer(name, a.model, a.optimizer, a.grpo, mesh, seed=spec.seed * 1000 + i)
      self.trainers[name] = trainer
      self.samplers[name] = EmbeddedSampler(
          trainer.graphdef, trainer.params, max_prompt_len=spec.max_prompt_len,
          eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, batch_multiple=mesh.shape['data'])
    self.engine = RolloutEngine(
        self.samplers, {n: a.sampling for n, a in spec.agents.items()},
        {n: a.group_size for n, a in spec.agents.items()}, tokenizer, spec.seed)
    self.checkpointers = {n: AgentCheckpointer(workdir, n) for n in spec.agents}
    self.step = 0
    self.next_query = 0
    # Rows served at each agent's current version, not yet trained on.
    self.buffers: dict[str, list[Group]] = {n: [] for n in spec.agents}

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
      self.buffers[name] = [group_from_json(g) for g in meta['buffer']]
    self.step = step
    return step

  def save(self) -> None:
    meta = {'step': self.step, 'next_query': self.next_query}
    for name, ckpt in self.checkpointers.items():
      trainer = self.trainers[name]
      ckpt.save(self.step, trainer.train_state(),
                dict(meta, version=trainer.version,
                     buffer=[group_to_json(g) for g in self.buffers[name]]))

  # -- one step -----------------------------------------------------------------------

  def queries(self, count: int) -> list[Query]:
    """The next `count` queries of the run's stream; each depends only on (seed, index)."""
    out = [self.workflow.make_query(np.random.default_rng([self.spec.seed, i]), f'q{i}')
           for i in range(self.next_query, self.next_query + count)]
    self.next_query += count
    return out

  def rollout(self) -> tuple[int, dict[str, int]]:
    """Serve waves of queries into the buffers until all are full.

    Returns the number of queries and the response tokens served per agent."""
    queries, tokens = 0, {n: 0 for n in self.spec.agents}
    for _ in range(self.spec.max_waves):
      first = self.next_query
      batch = self.queries(self.spec.queries_per_wave)
      results = self.engine.run(self.workflow, batch, first)
      queries += len(batch)
      for name, gs in collect_groups(results, list(self.spec.agents)).items():
        self.buffers[name].extend(gs)
        tokens[name] += sum(len(t) for g in gs for t in g.turn.tokens)
      if all(self._buffered(n) >= a.global_batch for n, a in self.spec.agents.items()):
        break
    return queries, tokens

  def _buffered(self, name: str) -> int:
    return sum(g.size for g in self.buffers[name])

  def train_agent(self, name: str, groups: Sequence[Group]) -> dict[str, float]:
    """Accumulate the agent's micro-batches, then one optimizer step; publish."""
    a: AgentSpec = self.spec.agents[name]
    trainer = self.trainers[name]
    for start in range(0, len(groups), a.micro_batch // a.group_size):
      micro = groups[start:start + a.micro_batch // a.group_size]
      adv = np.concatenate([grpo.group_advantages(g.rewards, g.size, a.grpo.normalize_std)
                            for g in micro])
      batch = TrainBatch.from_rows(
          [g.turn.prompt_ids for g in micro for _ in range(g.size)],
          [t for g in micro for t in g.turn.tokens],
          [lp for g in micro for lp in g.turn.logprobs], adv,
          prompt_len=self.spec.max_prompt_len, response_len=a.sampling.max_new_tokens,
          pad_id=self.tokenizer.pad_id, batch_multiple=trainer.batch_multiple)
      trainer.accumulate(batch)
    stats = trainer.apply()
    self.publish(name)
    return stats

  def run_step(self) -> dict[str, dict[str, float]]:
    """One `sync` step: roll out, then train the full agents one after another."""
    t0 = time.perf_counter()
    versions = {n: t.version for n, t in self.trainers.items()}
    queries, served = self.rollout()
    rollout_s = time.perf_counter() - t0
    lines: dict[str, dict[str, float]] = {}
    for name, a in self.spec.agents.items():
      tokens = served[name]
      if self._buffered(name) < a.global_batch:
        lines[name] = dict(batch_stats(self.buffers[name]), policy_version=versions[name],
                           tokens=tokens, updated=0, rows=self._buffered(name))
        continue
      kept, surplus = take_batch(self.buffers[name], a.global_batch)
      self.buffers[name] = []
      t1 = time.perf_counter()
      stats = self.train_agent(name, kept)
      lines[name] = dict(batch_stats(kept), policy_version=versions[name], tokens=tokens,
                         updated=1, rows=a.global_batch, surplus_rows=surplus,
                         train_s=time.perf_counter() - t1, **stats)
    step_s = time.perf_counter() - t0
    tokens = sum(l['tokens'] for l in lines.values())
    for line in lines.values():
      line['step_time_s'] = step_s
    lines[TEAM] = dict(
        reward_mean=float(np.mean([l['reward_mean'] for l in lines.values()])),
        reward_std=float(np.mean([l['reward_std'] for l in lines.values()])),
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
      for c in self.checkpointers.values():
        c.wait()
    return write_summary(self.workdir, time.perf_counter() - t0)


def format_step(step: int, steps: int, lines: Mapping[str, Mapping[str, float]]) -> str:
  team = lines[TEAM]
  agents = '  '.join(f"{n}: r={l['reward_mean']:.2f} acc={l['accuracy']:.2f}"
                     for n, l in lines.items() if n != TEAM)
  return f"step {step}/{steps} [{team['step_time_s']:.2f}s, {team['tokens_per_s']:.0f} tok/s]  {agents}"


def write_summary(workdir: str, wall_s: float, window: int = 5) -> dict:
  """Per agent: first-step and last-`window`-step means of reward and accuracy."""
  lines = read_metrics(os.path.join(workdir, 'metrics.jsonl'))
  agents = sorted({l['agent'] for l in lines} - {TEAM})
  summary: dict = {'wall_s': wall_s, 'agents': {}}
  for agent in agents:
    mine = sorted((l for l in lines if l['agent'] == agent), key=lambda l: l['step'])
    last = mine[-window:]
    summary['agents'][agent] = {
        'first_reward': mine[0]['reward_mean'], 'first_accuracy': mine[0]['accuracy'],
        'last_reward': float(np.mean([l['reward_mean'] for l in last])),
        'last_accuracy': float(np.mean([l['accuracy'] for l in last])),
        'steps': mine[-1]['step']}
  team = [l for l in lines if l['agent'] == TEAM]
  run_time = sum(l['step_time_s'] for l in team)
  summary['tokens_per_s'] = sum(l['tokens'] for l in team) / run_time if run_time else 0.0
  summary['steps'] = len(team)
  with open(os.path.join(workdir, 'summary.json'), 'w', encoding='utf-8') as f:
    json.dump(summary, f, indent=2)
  return summary
