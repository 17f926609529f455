"""Where a run's processes live (config section `cluster`). Imports nothing heavy."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import ml_collections

from flexmarl.spec.validate import config_of, fail, in_range, one_of, read_section, whole_number

BACKENDS = ('local', 'ray')


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
  """How a run spreads over processes (config section `cluster`).

  - backend: 'local' runs everything in this process; 'ray' runs every rollout instance
    in a worker process of its own and every training mesh in a trainer group of its own
    (Ray actors), the driver (this process) keeping the orchestrator.
  - address: '' starts a Ray cluster on this machine for the run (and stops it after);
    'auto' or 'HOST:PORT' joins a cluster started with `ray start --head` (see
    docs/cluster.md).
  - devices: the devices the placement plans with under 'ray', numbered node after node
    (0: the cluster's GPUs when it has any, else this process's JAX devices).
  - devices_per_process: 0 puts each training mesh in one process per node it spans;
    k > 0 splits a mesh into processes of k devices (one per host of a TPU slice, or to
    test multi-process meshes on one machine). Rollout instances always run in one
    process.
  - call_timeout_s: how long the driver waits on any call to a worker before it names
    the worker and the call and stops.
  - worker_restarts: how often Ray restarts a dead rollout worker (it reloads the
    agent's current weights and serves its requests again).
  - run_restarts: how often the run resumes itself from its last checkpoint after a
    trainer process died.
  - temp_dir: Ray's session folder for a cluster started here (short: socket paths
    over 107 bytes fail).
  - rollout_cores, trainer_cores: the CPU cores (numbered on each node) that every
    rollout worker, and every trainer process, runs on, as `taskset -c` writes them:
    '0', '2-5', '0,4-7'; '' leaves the process to the OS. Keeps the two roles off each
    other's cores (docs/cluster.md says when that pays).
  """

  backend: str = 'local'
  address: str = ''
  devices: int = 0
  devices_per_process: int = 0
  call_timeout_s: float = 600.0
  worker_restarts: int = 3
  run_restarts: int = 2
  temp_dir: str = '/tmp/flexray'
  rollout_cores: str = ''
  trainer_cores: str = ''

  @property
  def on_ray(self) -> bool:
    """Whether the run's parts are Ray workers (`backend='ray'`), not this process's."""
    return self.backend == 'ray'

  @classmethod
  def from_config(cls, values: Mapping[str, Any] | None, field: str = 'cluster') -> ClusterSpec:
    c = read_section(cls, field, values)
    one_of(f'{field}.backend', c.backend, BACKENDS)
    whole_number(f'{field}.devices', c.devices, 0, "0: the cluster's GPUs, else this process's")
    whole_number(f'{field}.devices_per_process', c.devices_per_process, 0,
                 '0: one process per node a mesh spans')
    in_range(f'{field}.call_timeout_s', c.call_timeout_s, 1e-3, float('inf'),
             'must be > 0 seconds.')
    whole_number(f'{field}.worker_restarts', c.worker_restarts, 0)
    whole_number(f'{field}.run_restarts', c.run_restarts, 0)
    if len(c.temp_dir) > 60:
      fail(f'{field}.temp_dir', c.temp_dir, 'keep it under 60 characters: Ray puts socket '
           'files under it, and socket paths over 107 bytes fail.')
    for name in ('rollout_cores', 'trainer_cores'):
      cores = parse_cores(f'{field}.{name}', getattr(c, name))
      if cores and not c.on_ray:
        fail(f'{field}.{name}', getattr(c, name), "only Ray workers are pinned to cores: set "
             f"{field}.backend='ray', or leave it ''.")
      if cores and not c.address:  # a cluster started here: its nodes are this machine
        usable = _usable_cores()
        if not usable:
          fail(f'{field}.{name}', getattr(c, name), "this OS cannot pin a process to cores "
               "(no sched_setaffinity): leave it ''.")
        missing = sorted(set(cores) - set(usable))
        if missing:
          fail(f'{field}.{name}', getattr(c, name), f'this machine has no core {missing[0]} '
               f'that this process may use; it may use {list(usable)}.')
    if c.on_ray:
      try:
        import ray  # noqa: F401  (the check: installed with requirements.txt)
      except ImportError:
        fail(f'{field}.backend', 'ray', 'Ray is not installed: pip install -r requirements.txt '
             "(ray), or use --config.cluster.backend=local.")
    return c


def parse_cores(field: str, text: str) -> tuple[int, ...]:
  """'0,2-3' -> (0, 2, 3); '' -> () (no pinning). Errors name `field`."""
  cores: set[int] = set()
  for part in filter(None, (p.strip() for p in str(text).split(','))):
    low, dash, high = part.partition('-')
    if not (low.isdigit() and (high.isdigit() or not dash)) or (high and int(high) < int(low)):
      fail(field, text, "write cores as taskset -c does: '0', '2-5', '0,4-7' (or '' for any).")
    cores.update(range(int(low), int(high or low) + 1))
  return tuple(sorted(cores))


def _usable_cores() -> tuple[int, ...]:
  """The cores this process may run on."""
  return tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, 'sched_getaffinity') else ()


def cluster_config(**overrides: Any) -> ml_collections.ConfigDict:
  """Default cluster config (the fields of `ClusterSpec`): one process."""
  return config_of(ClusterSpec, **overrides)
