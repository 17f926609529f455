"""The processes of a Ray run, as plain classes (`remote.py` makes them Ray actors).

Each process sees only its own devices: Ray sets them before JAX loads (the CPU device
count in `XLA_FLAGS`, or `CUDA_VISIBLE_DEVICES` for its GPUs), and a trainer rank joins
its group's `jax.distributed` cluster before any other JAX call. Nothing here decides
anything: the driver sends each call, and a trainer group's ranks all get the same
calls with the same arguments, in the same order.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import Any

import numpy as np

from flexmarl.config import AgentSpec, TeamSpec
from flexmarl.core.interfaces import Weights
from flexmarl.models.tokenizer import TextTokenizer
from flexmarl.rollout import backends
from flexmarl.rollout.sampler import SampleBatch, SamplingParams
from flexmarl.runtime import compile_cache
from flexmarl.runtime import malloc
from flexmarl.spec.cluster import parse_cores


class WeightsMissing(RuntimeError):
  """A rollout worker was asked to serve weights it does not hold (it restarted)."""


def where(devices: tuple[int, ...]) -> dict[str, Any]:
  """This process: its node, address, pid, planned and local devices, the cores its
  threads may run on."""
  import jax
  import ray
  return {'node': ray.get_runtime_context().get_node_id()[:12],
          'address': ray.util.get_node_ip_address(), 'pid': os.getpid(),
          'devices': list(devices),
          'local_devices': [str(d) for d in jax.local_devices()[:len(devices)]],
          'cores': _cores_used()}


def _cores_used() -> list[int]:
  """Every core some thread of this process may run on ([] where the OS does not say)."""
  if not os.path.isdir('/proc/self/task'):
    return []
  cores: set[int] = set()
  for thread in os.listdir('/proc/self/task'):
    try:
      cores |= os.sched_getaffinity(int(thread))
    except ProcessLookupError:  # the thread ended meanwhile
      pass
  return sorted(cores)


def pin_to_cores(text: str, field: str) -> None:
  """Run every thread of this process, and those it starts later, on the cores `text`
  names (`cluster.rollout_cores` / `cluster.trainer_cores`; '' leaves them be). Called
  before JAX starts its threads, which then inherit the cores."""
  cores = parse_cores(f'cluster.{field}', text)
  if not cores:
    return
  if not hasattr(os, 'sched_setaffinity'):
    raise ValueError(f"config.cluster.{field}={text!r}: this OS cannot pin a process to cores "
                     "(no sched_setaffinity); leave it ''.")
  usable = set(os.sched_getaffinity(0))
  if not set(cores) <= usable:
    raise ValueError(f'config.cluster.{field}={text!r}: this node ({socket.gethostname()}) has '
                     f'no core {min(set(cores) - usable)} that the worker may use; it may use '
                     f'{sorted(usable)}. Name cores that every node has.')
  for thread in os.listdir('/proc/self/task'):
    try:
      os.sched_setaffinity(int(thread), cores)
    except ProcessLookupError:  # the thread ended meanwhile
      pass


class RolloutWorker:
  """One rollout instance: a sampler of the run's rollout backend over this process's
  devices (`Backend.worker_sampler`), serving the weights it was last given. A restarted
  worker (Ray restarts it after a crash) starts again from its first weights; the driver
  re-sends the current ones before it serves again."""

  def __init__(self, spec: TeamSpec, agent: str, tokenizer: TextTokenizer, workdir: str,
               devices: tuple[int, ...], weights: dict, version: int):
    pin_to_cores(spec.cluster.rollout_cores, 'rollout_cores')
    malloc.return_freed_memory()
    compile_cache.use(spec.compile_cache_dir)
    self.devices = devices
    self.sampler = backends.get(spec.rollout.backend).worker_sampler(
        spec, agent, tokenizer, workdir, devices, Weights(weights, version))

  def where(self) -> dict[str, Any]:
    return where(self.devices)

  def update_weights(self, weights: dict, version: int) -> int:
    self.sampler.update_weights(weights, version)
    return version

  def generate(self, prompts: list[list[int]], keys: np.ndarray, params: SamplingParams,
               limits: np.ndarray | None, version: int) -> SampleBatch:
    """Serve the batch with the weights of `version`, or refuse (a restarted worker that
    missed the driver's last weights)."""
    if self.sampler.version != version:
      raise WeightsMissing(f'serving version {self.sampler.version}, asked for {version}')
    return self.sampler.submit(prompts, keys, params, limits).result()


@dataclasses.dataclass(frozen=True)
class TrainerJob:
  """What every rank of a trainer group builds: agent `name`'s trainer from `agent` (its
  seed too), its checkpoints under `workdir`."""

  name: str
  agent: AgentSpec
  banned_ids: tuple[int, ...]
  workdir: str
  compile_cache_dir: str = ''
  cores: str = ''  # cluster.trainer_cores


class TrainerRank:
  """One process of an agent's trainer group. With several ranks the group is one
  `jax.distributed` cluster and one global mesh over all their devices; every rank runs
  every step (JAX's multi-controller model), rank 0 answers with the host values."""

  def __init__(self, rank: int, counts: tuple[int, ...], devices: tuple[int, ...]):
    """`counts`: how many devices each rank of the group uses (its first local ones)."""
    malloc.return_freed_memory()
    self.rank, self.counts, self.devices = rank, counts, devices
    self.size = len(counts)
    self.trainer = self.checkpointer = None

  def coordinator(self) -> str:
    """A free address on this node for the group's coordination service (rank 0)."""
    import ray
    with socket.socket() as s:
      s.bind(('', 0))
      port = s.getsockname()[1]
    return f'{ray.util.get_node_ip_address()}:{port}'

  def start(self, coordinator: str, job: TrainerJob) -> dict[str, Any]:
    """Join the group's JAX cluster, then build the trainer on the global mesh."""
    pin_to_cores(job.cores, 'trainer_cores')
    import jax
    if self.size > 1:
      jax.distributed.initialize(coordinator, self.size, self.rank)
    compile_cache.use(job.compile_cache_dir)
    from flexmarl.build import agent_trainer
    from flexmarl.models import sharding
    from flexmarl.train.checkpoint import AgentCheckpointer
    a = job.agent
    mesh = sharding.make_mesh([d for p, k in enumerate(self.counts)
                               for d in jax.local_devices(process_index=p)[:k]],
                              a.mesh_shape, a.mesh_axes)
    self.trainer = agent_trainer(job.name, a, mesh, job.banned_ids)
    self.checkpointer = AgentCheckpointer(job.workdir, job.name)
    return self.where()

  def where(self) -> dict[str, Any]:
    return where(self.devices)

  def accumulate(self, batch, update: int) -> None:
    """One micro-batch's gradient; returns once it is computed (the actor runs its calls
    one after another, so the driver's next call queues behind it, not on it)."""
    import jax
    jax.block_until_ready(self.trainer.accumulate(batch, update))

  def count_silent(self, tokens: int, rows: int) -> None:
    self.trainer.count_silent(tokens, rows)

  def apply(self, step: bool) -> dict[str, float]:
    return self.trainer.dispatch_apply(step)()

  def reset(self) -> None:
    self.trainer.reset()

  def host_params(self) -> dict | None:
    """The parameters as host arrays (rank 0; None elsewhere): what rollout workers load."""
    return _host(self.trainer.params, self.size, self.rank)

  def save(self, step: int, meta: dict) -> None:
    self.checkpointer.save(step, self.trainer.train_state(), meta)

  def wait(self) -> None:
    self.checkpointer.wait()

  def steps(self) -> list[int]:
    return self.checkpointer.steps()

  def restore(self, step: int) -> dict:
    """Restore checkpoint `step` into the trainer; its metadata."""
    state, meta = self.checkpointer.restore(step, self.trainer.train_state())
    self.trainer.load_train_state(state)
    return meta


def _host(params, size: int, rank: int):
  import jax
  if size == 1:
    return jax.device_get(params)
  from jax.experimental import multihost_utils
  gathered = multihost_utils.process_allgather(params, tiled=True)
  return gathered if rank == 0 else None
