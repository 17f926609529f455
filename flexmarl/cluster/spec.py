"""Where a run's processes live (config section `cluster`). Imports nothing heavy."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import ml_collections

from flexmarl.validate import config_of, fail, in_range, one_of, read_section, whole_number

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
  """

  backend: str = 'local'
  address: str = ''
  devices: int = 0
  devices_per_process: int = 0
  call_timeout_s: float = 600.0
  worker_restarts: int = 3
  run_restarts: int = 2
  temp_dir: str = '/tmp/flexray'

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
    if c.backend == 'ray':
      try:
        import ray  # noqa: F401  (the check: installed with requirements.txt)
      except ImportError:
        fail(f'{field}.backend', 'ray', 'Ray is not installed: pip install -r requirements.txt '
             "(ray), or use --config.cluster.backend=local.")
    return c


def cluster_config(**overrides: Any) -> ml_collections.ConfigDict:
  """Default cluster config (the fields of `ClusterSpec`): one process."""
  return config_of(ClusterSpec, **overrides)
