"""Agent: one agent's trainer, rollout instances and checkpointer; it publishes weights.

`build_team` turns a checked TeamSpec and a Placement into agents: each trainer on its
mesh, each rollout instance a sampler on its own devices (or on the training devices
with `rollout.devices=shared`), weights copied there in the trainer's layout. With a
training pool (`placement.pool`) trainers start with their state in host memory and
one `TrainingEngine` binds them to the pool's meshes as they get work; the trainers
of a team share one `StepCache` either way.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from flexmarl.clock import Clock, RealClock
from flexmarl.config import AgentSpec, TeamSpec
from flexmarl.data.groups import Group
from flexmarl.metrics import spans
from flexmarl.models import hf, sharding
from flexmarl.placement import Placement
from flexmarl.rollout.pool import Instance, InstancePool
from flexmarl.rollout.sampler import EmbeddedSampler, Sampler, compile_generate
from flexmarl.tokenizer import TextTokenizer, per_agent
from flexmarl.train.checkpoint import AgentCheckpointer
from flexmarl.train.engine import TrainingEngine
from flexmarl.train.step import StepCache
from flexmarl.train.trainer import AgentTrainer, TrainBatch


class Timeline:
  """Spans of work dispatched to one device group, timed when their results are ready.

  Dispatch returns at once (JAX runs the work asynchronously), so a thread waits for
  each result in dispatch order; the device runs them in that order too, so a span
  starts when it was dispatched or when the previous one ended, whichever is later."""

  def __init__(self, recorder: spans.SpanRecorder, track: str):
    self.recorder, self.track = recorder, track
    self._waiter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=track)
    self._last_end = -float('inf')

  def add(self, name: str, outputs: Any, **args: Any) -> None:
    start = self.recorder.clock.now()
    args.setdefault('step', self.recorder.step)  # the step that dispatched it

    def wait() -> None:
      jax.block_until_ready(outputs)
      end = self.recorder.clock.now()
      self.recorder.add(self.track, name, max(start, self._last_end), end, **args)
      self._last_end = end
    self._waiter.submit(wait)

  def drain(self) -> None:
    """Wait until every span dispatched so far is recorded."""
    self._waiter.submit(lambda: None).result()

  def close(self) -> None:
    self._waiter.shutdown(wait=True)


# Mean |π_train/π_served − 1| over an on-policy batch's tokens above which the trainer
# and the sampler disagree on the prompt or the tokens (float32 agrees to ~1e-6; bf16
# sampling kernels to ~1e-2).
SERVED_LOGPROB_TOLERANCE = 0.05


def check_served_logprobs(agent: str, version: int, ratio_dev: float) -> None:
  """Raise if the trainer's logprobs of served tokens are not the sampler's: the update
  would then train a policy other than the one that answered."""
  if not ratio_dev <= SERVED_LOGPROB_TOLERANCE:
    raise RuntimeError(
        f'agent {agent!r}, update of version {version}: the trainer\'s logprobs of the '
        f'served tokens differ from the sampler\'s (mean |ratio - 1| = {ratio_dev:.3g}, '
        f'tolerance {SERVED_LOGPROB_TOLERANCE}) although every row is on-policy. The two '
        'disagree on the prompt, the tokens or the distribution: check that the rollout '
        'backend serves this agent\'s weights and tokenizer (special tokens, BOS) and the '
        'same temperature; this update was not saved.')


class Agent:

  def __init__(self, spec: AgentSpec, trainer: AgentTrainer, pool: InstancePool,
               checkpointer: AgentCheckpointer, *, prompt_len: int, pad_id: int,
               clock: Clock | None = None, recorder: spans.SpanRecorder | None = None,
               timeline: Timeline | None = None, engine: TrainingEngine | None = None):
    """`clock` times the steps (`train_s`); `recorder` gets weight-sync spans and
    `timeline` the spans of the training devices (a simulated team records its own).
    `engine`: the training pool's, which binds the trainer to a mesh for each piece of
    work; None: the trainer stays on its own mesh."""
    self.spec, self.trainer, self.pool, self.checkpointer = spec, trainer, pool, checkpointer
    self.prompt_len, self.pad_id, self.engine = prompt_len, pad_id, engine
    self.clock = clock or RealClock()
    self.recorder, self.timeline = recorder, timeline
    self._stepped = None  # params of the last optimizer step, until published
    self._checked = False  # served logprobs compared with the trainer's (first update)

  @property
  def name(self) -> str:
    return self.spec.name

  @property
  def version(self) -> int:
    return self.trainer.version

  def publish(self) -> None:
    """Send the trainer's current weights to every rollout instance of the agent: those
    of its last step, taken before its state could be swapped out."""
    params = self.trainer.params if self._stepped is None else self._stepped
    self._stepped = None
    start = self.clock.now()
    self.pool.publish(params, self.trainer.version)
    end = self.clock.now()
    if self.recorder is None:
      return
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    for inst in self.pool.instances:
      self.recorder.add(f'rollout:{inst.name}', spans.WEIGHT_SYNC, start, end, agent=self.name,
                        version=self.version, bytes=nbytes)

  def _train(self, work: Callable[[], None]) -> None:
    """Run `work` on the trainer: at once, or through the pool's engine."""
    if self.engine is None:
      work()
    else:
      self.engine.submit(self.name, work)
      self.engine.run()

  def swap_stats(self) -> dict:
    """Where the agent trained since the last call and its swap costs ({} without a pool)."""
    return {} if self.engine is None else self.engine.step_stats(self.name)

  def accumulate(self, micro: Sequence[Group]) -> None:
    """Add one micro-batch's gradient to the trainer's accumulator (dispatched, not
    awaited: it runs on the training devices while the caller goes on)."""
    batch = TrainBatch.from_rows(
        [g.turn.prompt_ids for g in micro for _ in range(g.size)],
        [t for g in micro for t in g.turn.tokens],
        [lp for g in micro for lp in g.turn.logprobs],
        np.concatenate([g.advantages for g in micro]),
        prompt_len=self.prompt_len, response_len=self.spec.sampling.max_new_tokens,
        pad_id=self.pad_id, batch_multiple=self.trainer.batch_multiple)

    def work() -> None:
      stats = self.trainer.accumulate(batch)
      if self.timeline is not None:
        self.timeline.add(spans.MICRO_BATCH, stats, agent=self.name, version=self.version,
                          tokens=batch.tokens)
    self._train(work)

  def start_step(self, batch: Sequence[Group], micro_batches: Sequence[Sequence[Group]]
                 ) -> Callable[[], dict[str, float]]:
    """Accumulate `micro_batches` (those of `batch` not yet accumulated) and dispatch the
    optimizer step without waiting; returns a function that waits and gives its stats.

    Each row's staleness (versions between the one that sampled it and the parameters
    it updates) is measured here, where the update happens."""
    t0 = self.clock.now()
    lags = np.array([self.version - g.turn.version for g in batch for _ in range(g.size)])
    for micro in micro_batches:
      self.accumulate(micro)
    version = self.version
    dispatched = []

    def step() -> None:
      dispatched.append(self.trainer.dispatch_apply())
      self._stepped = self.trainer.params
      if self.timeline is not None:
        self.timeline.add(spans.OPTIMIZER_STEP, self.trainer.params, agent=self.name,
                          version=version)
    self._train(step)
    result, = dispatched

    def finish() -> dict[str, float]:
      stats = dict(result(), train_s=self.clock.now() - t0, rows=len(lags),
                   staleness_max=int(lags.max()), staleness_mean=float(lags.mean()))
      if not self._checked and stats['staleness_max'] == 0 and 'ratio_dev' in stats:
        check_served_logprobs(self.name, version, stats['ratio_dev'])
        self._checked = True
      return stats
    return finish

  def close(self) -> None:
    self.checkpointer.wait()
    if self.timeline is not None:
      self.timeline.close()
    if self.engine is not None:
      self.engine.close()
    for inst in self.pool.instances:
      inst.sampler.close()


def _sampler_factory(a: AgentSpec, trainer: AgentTrainer, train_devices: tuple[int, ...],
                     devices_by_id: Mapping[int, jax.Device], spec: TeamSpec,
                     tokenizer: TextTokenizer, vllm_dir: str, compiled: dict
                     ) -> Callable[[tuple[int, ...], dict, int], Sampler]:
  """Builds this agent's sampler on given devices: a vLLM engine (rollout.backend=vllm,
  started from an export of the weights, under `vllm_dir`), or the embedded sampler in
  the trainer's layout. Instances of agents with the same model share one compiled
  sampling loop (`compiled`, per model config), so an instance that moves between
  such agents does not compile again."""
  if spec.rollout.backend == 'vllm':
    from flexmarl.rollout import vllm_sampler  # the optional extra
    engine = vllm_sampler.engine_config(**spec.rollout.vllm)

    def make_vllm(devices: tuple[int, ...], params: dict, version: int) -> Sampler:
      return vllm_sampler.VLLMSampler(
          a.model, params, workdir=os.path.join(vllm_dir, '-'.join(map(str, devices))),
          eos_id=tokenizer.stop_ids, pad_id=tokenizer.pad_id,
          banned_ids=tokenizer.banned_ids, engine=engine, version=version)
    return make_vllm
  generate_fn = compiled.setdefault(a.model, compile_generate(trainer.graphdef))

  def make(devices: tuple[int, ...], params: dict, version: int) -> Sampler:
    # On the trainer's own devices the published arrays are served as they are.
    mesh = sharding.make_mesh([devices_by_id[d] for d in devices], a.mesh_shape, a.mesh_axes)
    layout = (None if tuple(devices) == tuple(train_devices)
              else trainer.shardings_on(mesh))
    return EmbeddedSampler(trainer.graphdef, params, max_prompt_len=spec.max_prompt_len,
                           eos_id=tokenizer.stop_ids, pad_id=tokenizer.pad_id,
                           banned_ids=tokenizer.banned_ids,
                           batch_multiple=trainer.batch_multiple, version=version,
                           shardings=layout, generate_fn=generate_fn)
  return make


def build_team(spec: TeamSpec, placement: Placement,
               tokenizer: TextTokenizer | Mapping[str, TextTokenizer], workdir: str,
               devices: Sequence[jax.Device], recorder: spans.SpanRecorder
               ) -> dict[str, Agent]:
  """Every agent of `spec` on the devices `placement` gives it, each with its tokenizer
  (`tokenizer`: the team's, or one per agent)."""
  tokenizers = per_agent(tokenizer, spec.agents)
  by_id = {d.id: d for d in devices}
  steps, trainers, compiled = StepCache(), {}, {}
  for i, (name, a) in enumerate(spec.agents.items()):
    train = placement.train[name]
    init = None
    if placement.pool:
      where = a.layout
      if a.checkpoint:  # into host memory, where a pool trainer's state starts
        host = jax.sharding.SingleDeviceSharding(jax.devices('cpu')[0])
        init = jax.device_get(hf.load_params(a.checkpoint, a.model, jax.tree.map(
            lambda _: host, nnx.to_pure_dict(hf.abstract_params(a.model)[1]))))
    else:
      where = sharding.make_mesh([by_id[d] for d in train.devices], a.mesh_shape, a.mesh_axes)
      if a.checkpoint:  # read tensor by tensor straight onto the mesh
        init = hf.load_params(a.checkpoint, a.model,
                              sharding.param_shardings(hf.abstract_params(a.model)[1], where))
    trainers[name] = AgentTrainer(name, a.model, a.optimizer, a.grpo, where,
                                  seed=spec.seed * 1000 + i, steps=steps, init_params=init,
                                  banned_ids=tokenizers[name].banned_ids)
  engine = None
  if placement.pool:
    engine = TrainingEngine(
        trainers, [(f'pool{i}', [by_id[d] for d in m.devices], m.shape)
                   for i, m in enumerate(placement.pool)],
        spec.training.host_budget_bytes,
        spec.training.storage_dir or os.path.join(workdir, 'swap'), recorder=recorder,
        clock=recorder.clock)
  agents = {}
  for name, a in spec.agents.items():
    train, trainer = placement.train[name], trainers[name]
    make = _sampler_factory(a, trainer, train.devices, by_id, spec, tokenizers[name],
                            os.path.join(workdir, 'vllm', name), compiled)
    instances = [Instance(f'{name}/{j}', m.devices, make(m.devices, trainer.params, 0))
                 for j, m in enumerate(placement.rollout[name])]
    pool = InstancePool(name, instances, make, sticky=spec.rollout.sticky_conversations)
    pool.params = trainer.params
    agents[name] = Agent(a, trainer, pool, AgentCheckpointer(workdir, name),
                         prompt_len=spec.max_prompt_len, pad_id=tokenizers[name].pad_id,
                         clock=recorder.clock, recorder=recorder,
                         timeline=Timeline(recorder, f'train:{name}'), engine=engine)
  return agents
