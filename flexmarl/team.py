"""Agent: one agent's trainer, rollout instances and checkpointer; it publishes weights.

`build_team` turns a checked TeamSpec and a Placement into agents: each trainer on its
mesh, each rollout instance a sampler on its own devices (or on the training devices
with `rollout.devices=shared`), weights copied there in the trainer's layout.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from flexmarl.clock import Clock, RealClock
from flexmarl.config import AgentSpec, TeamSpec
from flexmarl.data.groups import Group
from flexmarl.metrics import spans
from flexmarl.models import hf, sharding
from flexmarl.placement import Placement
from flexmarl.rollout.pool import Instance, InstancePool
from flexmarl.rollout.sampler import EmbeddedSampler, Sampler, compile_generate
from flexmarl.tokenizer import TextTokenizer
from flexmarl.train.checkpoint import AgentCheckpointer
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


class Agent:

  def __init__(self, spec: AgentSpec, trainer: AgentTrainer, pool: InstancePool,
               checkpointer: AgentCheckpointer, *, prompt_len: int, pad_id: int,
               clock: Clock | None = None, recorder: spans.SpanRecorder | None = None,
               timeline: Timeline | None = None):
    """`clock` times the steps (`train_s`); `recorder` gets weight-sync spans and
    `timeline` the spans of the training devices (a simulated team records its own)."""
    self.spec, self.trainer, self.pool, self.checkpointer = spec, trainer, pool, checkpointer
    self.prompt_len, self.pad_id = prompt_len, pad_id
    self.clock = clock or RealClock()
    self.recorder, self.timeline = recorder, timeline

  @property
  def name(self) -> str:
    return self.spec.name

  @property
  def version(self) -> int:
    return self.trainer.version

  def publish(self) -> None:
    """Send the trainer's current weights to every rollout instance of the agent."""
    start = self.clock.now()
    self.pool.publish(self.trainer.params, self.trainer.version)
    end = self.clock.now()
    if self.recorder is None:
      return
    nbytes = sum(x.nbytes for x in jax.tree.leaves(self.trainer.params))
    for inst in self.pool.instances:
      self.recorder.add(f'rollout:{inst.name}', spans.WEIGHT_SYNC, start, end, agent=self.name,
                        version=self.version, bytes=nbytes)

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
    stats = self.trainer.accumulate(batch)
    if self.timeline is not None:
      self.timeline.add(spans.MICRO_BATCH, stats, agent=self.name, version=self.version,
                        tokens=batch.tokens)

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
    result = self.trainer.dispatch_apply()
    if self.timeline is not None:
      self.timeline.add(spans.OPTIMIZER_STEP, self.trainer.params, agent=self.name,
                        version=version)

    def finish() -> dict[str, float]:
      return dict(result(), train_s=self.clock.now() - t0, rows=len(lags),
                  staleness_max=int(lags.max()), staleness_mean=float(lags.mean()))
    return finish

  def close(self) -> None:
    self.checkpointer.wait()
    if self.timeline is not None:
      self.timeline.close()
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
          eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, engine=engine, version=version)
    return make_vllm
  generate_fn = compiled.setdefault(a.model, compile_generate(trainer.graphdef))

  def make(devices: tuple[int, ...], params: dict, version: int) -> Sampler:
    # On the trainer's own devices the published arrays are served as they are.
    mesh = sharding.make_mesh([devices_by_id[d] for d in devices], a.mesh_shape)
    layout = (None if tuple(devices) == tuple(train_devices)
              else sharding.same_layout(trainer.shardings, mesh))
    return EmbeddedSampler(trainer.graphdef, params, max_prompt_len=spec.max_prompt_len,
                           eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                           batch_multiple=trainer.batch_multiple, version=version,
                           shardings=layout, generate_fn=generate_fn)
  return make


def build_team(spec: TeamSpec, placement: Placement, tokenizer: TextTokenizer, workdir: str,
               devices: Sequence[jax.Device], recorder: spans.SpanRecorder
               ) -> dict[str, Agent]:
  """Every agent of `spec` on the devices `placement` gives it."""
  by_id = {d.id: d for d in devices}
  agents, compiled = {}, {}
  for i, (name, a) in enumerate(spec.agents.items()):
    train = placement.train[name]
    mesh = sharding.make_mesh([by_id[d] for d in train.devices], a.mesh_shape)
    init = None
    if a.checkpoint:  # read tensor by tensor straight onto the mesh
      init = hf.load_params(a.checkpoint, a.model,
                            sharding.param_shardings(hf.abstract_params(a.model)[1], mesh))
    trainer = AgentTrainer(name, a.model, a.optimizer, a.grpo, mesh, seed=spec.seed * 1000 + i,
                           init_params=init)
    make = _sampler_factory(a, trainer, train.devices, by_id, spec, tokenizer,
                            os.path.join(workdir, 'vllm', name), compiled)
    instances = [Instance(f'{name}/{j}', m.devices, make(m.devices, trainer.params, 0))
                 for j, m in enumerate(placement.rollout[name])]
    pool = InstancePool(name, instances, make, sticky=spec.rollout.sticky_conversations)
    pool.params = trainer.params
    agents[name] = Agent(a, trainer, pool, AgentCheckpointer(workdir, name),
                         prompt_len=spec.max_prompt_len, pad_id=tokenizer.pad_id,
                         clock=recorder.clock, recorder=recorder,
                         timeline=Timeline(recorder, f'train:{name}'))
  return agents
