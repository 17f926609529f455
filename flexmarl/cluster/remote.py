"""The driver's side of a Ray run: rollout workers behind `Sampler`, trainer groups
behind `Trainer` and `Checkpointer`, and the factories that hand them to
`flexmarl.build.build_team`.

Every call to a worker returns at once (a Ray object ref); what the run waits on waits
with `call_timeout_s` and, past it, names the worker, the call and what to do. Weights
travel as host arrays that a trainer group puts into Ray's object store once per
version; every rollout worker of the agent reads them from there (zero-copy between the
processes of one node). Samples come back to the driver, which stays the experience
store's one writer.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from flexmarl.build import Factories
from flexmarl.cluster import nodes as nodes_lib
from flexmarl.cluster.workers import RolloutWorker, TrainerJob, TrainerRank, WeightsMissing
from flexmarl.config import AgentSpec, TeamSpec
from flexmarl.core.interfaces import RemoteState, Stats, Weights
from flexmarl.metrics import spans
from flexmarl.metrics.timeline import Timeline
from flexmarl.models.tokenizer import TextTokenizer
from flexmarl.placement import plan as placement_lib
from flexmarl.rollout.backends import MakeSampler
from flexmarl.rollout.sampler import PendingSamples, SampleBatch, Sampler, SamplingParams
from flexmarl.spec.cluster import ClusterSpec
from flexmarl.train import sizing


class WorkerLost(RuntimeError):
  """A worker process died. A rollout worker's batch is served again after Ray restarts
  it; a trainer group's state is gone, and the run resumes from its last checkpoint
  (`flexmarl.run.train` does so by itself, `cluster.run_restarts` times)."""


class WorkerTimeout(RuntimeError):
  """A worker did not answer within `cluster.call_timeout_s`."""


def resolve(ref, who: str, call: str, timeout: float):
  """`ray.get` with the timeout and the errors a user can act on."""
  import ray
  try:
    return ray.get(ref, timeout=timeout)
  except ray.exceptions.GetTimeoutError:
    raise WorkerTimeout(
        f'{who} did not answer {call} within {timeout:.0f} s (config.cluster.call_timeout_s). '
        'Check the worker\'s log (Ray session folder, logs/worker-*.err) and its node; raise '
        'the timeout if the call is just slow (a first compilation, a large checkpoint).'
    ) from None
  except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
    raise WorkerLost(f'{who} died during {call} ({type(e).__name__}).') from e


def resolve_resent(send: Callable[[], Any], who: str, call: str, timeout: float):
  """`resolve(send())`, sent again while Ray finds the worker unreachable but not dead
  (`ActorUnavailableError`: a killed process it has not yet seen die, or one still
  restarting) until `timeout`: the restarted worker serves the call. Only for calls
  that may run twice (setting weights; a batch, whose keys fix its samples)."""
  import ray
  deadline = time.monotonic() + timeout
  while True:
    try:
      return resolve(send(), who, call, max(1.0, deadline - time.monotonic()))
    except WorkerLost as e:
      if (not isinstance(e.__cause__, ray.exceptions.ActorUnavailableError)
          or time.monotonic() >= deadline):
        raise
      time.sleep(0.5)


@dataclasses.dataclass(frozen=True)
class Handle:
  """A result still being computed in a worker (a Ray object ref). It has JAX arrays'
  `block_until_ready`, which is all spans wait on (`metrics.timeline.Timeline`); that
  never raises (the caller's `get` does)."""

  ref: Any
  timeout: float  # the longest wait (config.cluster.call_timeout_s)
  nbytes: int = 0  # of the value, when it is an agent's parameters

  def block_until_ready(self) -> Handle:
    import ray
    ray.wait([self.ref], num_returns=1, timeout=self.timeout, fetch_local=False)
    return self


# -- rollout workers ----------------------------------------------------------------------


class _Pending:
  """A batch in a rollout worker. If the worker dies before answering, or restarted and
  lost its weights, the batch is served again by the restarted worker, with the weights
  it was submitted under: its samples are the ones it would have given (keys are per
  row)."""

  def __init__(self, sampler: RemoteSampler, args: tuple, weights: Handle, version: int):
    self.sampler, self.args, self.weights, self.version = sampler, args, weights, version
    self.ref = sampler.actor.generate.remote(*args, version)

  def done(self) -> bool:
    import ray
    ready, _ = ray.wait([self.ref], num_returns=1, timeout=0, fetch_local=False)
    return bool(ready)

  def result(self) -> SampleBatch:
    restarts = self.sampler.cluster.worker_restarts
    for attempt in range(restarts + 1):
      try:
        if attempt:
          self.ref = self.sampler.retry(self.args, self.weights, self.version)
        return resolve(self.ref, self.sampler.name, 'generate',
                       self.sampler.cluster.call_timeout_s)
      except (WorkerLost, WeightsMissing):
        if attempt == restarts:
          raise
    raise AssertionError('unreachable')


class RemoteSampler:
  """A rollout instance in a worker process of its own (a `Sampler`)."""

  def __init__(self, name: str, actor, cluster: ClusterSpec, weights: Handle, version: int):
    self.name, self.actor, self.cluster = name, actor, cluster
    self.weights, self.version = weights, version
    # Ray restarts a dead worker from its constructor's arguments: keep them alive.
    self._first = weights

  def submit(self, prompts: list[list[int]], keys: np.ndarray, params: SamplingParams,
             limits: np.ndarray | None = None) -> PendingSamples:
    return _Pending(self, (prompts, keys, params, limits), self.weights, self.version)

  def update_weights(self, state: Handle, version: int) -> None:
    self.weights, self.version = state, version
    self.actor.update_weights.remote(state.ref, version)

  def retry(self, args: tuple, weights: Handle, version: int):
    """After a crash (Ray restarted the worker with its first weights): serve `args`
    under `weights`, then go back to the current ones."""
    resolve_resent(lambda: self.actor.update_weights.remote(weights.ref, version), self.name,
                   'update_weights (after a restart)', self.cluster.call_timeout_s)
    ref = self.actor.generate.remote(*args, version)
    self.actor.update_weights.remote(self.weights.ref, self.version)
    return ref

  def serve(self, model_cfg: Any, params: Handle, version: int, **tokens: Any) -> bool:
    """False: a worker serves one agent (the balancer moves no instance under Ray)."""
    return False

  def close(self) -> None:
    import ray
    ray.kill(self.actor, no_restart=True)


# -- trainer groups ---------------------------------------------------------------------


class RemoteTrainer:
  """An agent's trainer group (a `Trainer`): one actor per process of its mesh, each
  sent every call with the same arguments. `params` is a `Handle` to the host arrays of
  the current parameters, fetched once per version. A dead process raises `WorkerLost`
  (the group's state is gone; the run resumes from its checkpoint)."""

  def __init__(self, name: str, ranks: Sequence[Any], cluster: ClusterSpec, batch_multiple: int,
               param_bytes: int):
    self.name, self.ranks, self.cluster = name, list(ranks), cluster
    self.batch_multiple, self.param_bytes = batch_multiple, param_bytes
    self._params: Handle | None = None
    self.lost = False

  def call(self, method: str, *args) -> list:
    """Send every rank the same call; the refs of their answers, in rank order."""
    return [getattr(r, method).remote(*args) for r in self.ranks]

  def get(self, refs: Sequence, call: str) -> list:
    try:
      return [resolve(r, f'trainer group of {self.name!r} (rank {i})', call,
                   self.cluster.call_timeout_s) for i, r in enumerate(refs)]
    except WorkerLost:
      self.lost = True
      raise

  @property
  def params(self) -> Handle:
    if self._params is None:
      self._params = Handle(self.call('host_params')[0], self.cluster.call_timeout_s,
                            self.param_bytes)
    return self._params

  def accumulate(self, batch, update: int) -> Handle:
    import ray
    ref = ray.put(batch)  # once, read by every rank
    return Handle(self.call('accumulate', ref, update)[0], self.cluster.call_timeout_s)

  def count_silent(self, tokens: int, rows: int) -> None:
    self.call('count_silent', tokens, rows)  # queued in order before the step

  def dispatch_apply(self, step: bool = True) -> Callable[[], Stats]:
    refs = self.call('apply', step)
    self._params = None
    return lambda: self.get(refs, 'apply')[0]

  def reset(self) -> None:
    self.get(self.call('reset'), 'reset')
    self._params = None

  def train_state(self) -> RemoteState:
    """The state stays in the group: checkpoints are written by its ranks
    (`RemoteCheckpointer`), so what the run holds is a token naming it."""
    return RemoteState(self.name)

  def load_train_state(self, state: RemoteState) -> None:
    if state != RemoteState(self.name):
      raise ValueError(f'agent {self.name!r}: a remote trainer takes only the state its own '
                       f'checkpointer restored, not {state!r}.')
    self._params = None


class RemoteCheckpointer:
  """Orbax checkpoints written and read by the ranks of a trainer group (every rank
  takes part, as Orbax wants of a multi-process mesh), under the run's workdir on a
  filesystem every node sees."""

  def __init__(self, trainer: RemoteTrainer, workdir: str):
    self.trainer = trainer
    self.directory = os.path.abspath(os.path.join(workdir, 'checkpoints', trainer.name))

  def steps(self) -> list[int]:
    return self.trainer.get(self.trainer.call('steps'), 'steps')[0]

  def save(self, step: int, train_state: RemoteState, meta: dict) -> None:
    self.trainer.call('save', step, meta)

  def restore(self, step: int, like: RemoteState) -> tuple[RemoteState, dict]:
    meta = self.trainer.get(self.trainer.call('restore', step), f'restore({step})')[0]
    return like, meta

  def wait(self) -> None:
    if not self.trainer.lost:
      self.trainer.get(self.trainer.call('wait'), 'wait (checkpoint save)')


# -- wiring -------------------------------------------------------------------------------


def _options(slot: nodes_lib.Slot, gpus: bool, restarts: int, cpu_devices: int) -> dict:
  """Ray actor options: pinned to the slot's node, with its devices set before JAX
  loads. GPUs: Ray assigns them (`CUDA_VISIBLE_DEVICES`). CPU: the worker's XLA client
  gets `cpu_devices` devices, as many as the driver's (XLA's CPU code differs in its
  last float bits with the device count), and the worker uses the first of them."""
  from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
  env = {}
  if not gpus:
    flags = [f for f in os.environ.get('XLA_FLAGS', '').split()
             if not f.startswith('--xla_force_host_platform_device_count')]
    count = max(cpu_devices, len(slot.devices))
    env = {'XLA_FLAGS': ' '.join(flags + [f'--xla_force_host_platform_device_count={count}']),
           'JAX_PLATFORMS': 'cpu'}
  return dict(num_cpus=0, num_gpus=len(slot.devices) if gpus else 0, max_restarts=restarts,
              runtime_env={'env_vars': env},
              scheduling_strategy=NodeAffinitySchedulingStrategy(slot.node.id, soft=False))


def start_trainer_group(job: TrainerJob, slots: Sequence[nodes_lib.Slot], gpus: bool,
                        cpu_devices: int, cluster: ClusterSpec, batch_multiple: int
                        ) -> tuple[RemoteTrainer, list]:
  """One actor per slot, joined into one JAX cluster (rank 0's node hosts its
  coordinator), each building the agent's trainer on the global mesh. Returns at once:
  the group, and refs to where each rank runs (ready once it has started); calls sent
  meanwhile queue behind the start."""
  import ray
  rank_cls = ray.remote(TrainerRank)
  counts = tuple(len(s.devices) for s in slots)
  ranks = [rank_cls.options(**_options(s, gpus, 0, cpu_devices)).remote(i, counts, s.devices)
           for i, s in enumerate(slots)]
  group = RemoteTrainer(job.name, ranks, cluster, batch_multiple,
                        sizing.param_nbytes(job.agent.model))
  return group, group.call('start', ranks[0].coordinator.remote(), job)


def ray_factories(spec: TeamSpec, tokenizers: Mapping[str, TextTokenizer], workdir: str,
                  cluster, recorder: spans.SpanRecorder) -> Factories:
  """The parts of a run as Ray actors on `cluster` (a `ray_cluster.Cluster`): a trainer
  group per training mesh, a rollout worker per instance, all started at once. Each
  factory hands its workers to `cluster.add_workers` (what `Cluster.wait_started` waits
  for and `Cluster.close` stops)."""
  import ray
  c = spec.cluster
  rollout_cls = ray.remote(RolloutWorker)
  trainers: dict[str, RemoteTrainer] = {}  # for their checkpointers

  def trainer(name: str, a: AgentSpec,
              mesh: placement_lib.MeshPlacement | None) -> RemoteTrainer:
    group = f'train:{name}'
    slots = nodes_lib.slots(group, mesh.devices, cluster.nodes, c.devices_per_process, False)
    job = TrainerJob(name, a, tokenizers[name].banned_ids, workdir, spec.compile_cache_dir,
                     c.trainer_cores)
    remote, started = start_trainer_group(
        job, slots, cluster.gpus, cluster.cpu_devices, c, a.layout.batch_multiple)
    cluster.add_workers(group, remote.ranks, started)
    trainers[name] = remote
    return remote

  def sampler(name: str, a: AgentSpec, trainer: RemoteTrainer) -> MakeSampler:
    def make(devices: tuple[int, ...], weights: Weights) -> Sampler:
      group = f'rollout:{name}:{"-".join(map(str, devices))}'
      slot, = nodes_lib.slots(group, devices, cluster.nodes, 0, True)
      actor = rollout_cls.options(**_options(slot, cluster.gpus, c.worker_restarts,
                                             cluster.cpu_devices)).remote(
          spec, name, tokenizers[name], workdir, devices, weights.params.ref, weights.version)
      cluster.add_workers(group, [actor], [actor.where.remote()])
      return RemoteSampler(group, actor, c, weights.params, weights.version)
    return make

  return Factories(trainer, sampler, lambda name: RemoteCheckpointer(trainers[name], workdir),
                   None, lambda name: Timeline(recorder, f'train:{name}'))
