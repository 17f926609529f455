"""Joining (or starting) the Ray cluster of a run, and what the run keeps of it."""

from __future__ import annotations

import json
import os
from typing import Any

from flexmarl.cluster import nodes as nodes_lib
from flexmarl.placement import plan as placement_lib
from flexmarl.spec.cluster import ClusterSpec


class Cluster:
  """The Ray cluster a run uses: its nodes (planned devices numbered node after node),
  whether its devices are GPUs, and every worker process the run started
  (`processes`: device group → its ranks' node, pid and devices)."""

  def __init__(self, spec: ClusterSpec, local_devices: int):
    """Join `spec.address`, or start a cluster on this machine ('' ; stopped by
    `close`). `local_devices`: this process's JAX devices, the planned devices of a
    cluster without GPUs when `spec.devices` is 0."""
    import ray
    self.spec = spec
    self.cpu_devices = local_devices  # a CPU worker's XLA client gets as many
    self.started = not ray.is_initialized()
    if self.started:
      if spec.address:
        ray.init(address=spec.address, include_dashboard=False, log_to_driver=True)
      else:
        os.makedirs(spec.temp_dir, exist_ok=True)
        # Actors ask for no CPU (a JAX process uses what its devices need), so a laptop
        # runs as many workers as it has memory for.
        ray.init(include_dashboard=False, _temp_dir=spec.temp_dir, log_to_driver=True)
    alive = sorted((n for n in ray.nodes() if n['Alive']),
                   key=lambda n: (n['NodeManagerAddress'], n['NodeID']))
    gpus = [int(n['Resources'].get('GPU', 0)) for n in alive]
    self.gpus = sum(gpus) > 0
    if self.gpus:
      self.nodes = [nodes_lib.Node(n['NodeID'], n['NodeManagerAddress'], g)
                    for n, g in zip(alive, gpus) if g]
    else:
      self.nodes = nodes_lib.split_devices(spec.devices or local_devices,
                                           [(n['NodeID'], n['NodeManagerAddress'])
                                            for n in alive])
    self.processes: dict[str, list[Any]] = {}  # group → where its ranks run (refs, then dicts)
    self.actors: list[Any] = []  # every worker the run started

  def add_workers(self, group: str, actors: list, where: list) -> None:
    """Record the workers of one device group (`train:NAME`, `rollout:NAME:DEVICES`) and
    refs to where each of its processes runs, for `wait_started`, `save` and `close`."""
    self.processes[group] = list(where)
    self.actors.extend(actors)

  def wait_started(self) -> None:
    """Wait until every worker process has started (its trainer or sampler built);
    `processes` then says where each runs. A worker that failed to start raises here."""
    from flexmarl.cluster.remote import resolve
    for group, refs in self.processes.items():
      self.processes[group] = [resolve(r, group, 'start', self.spec.call_timeout_s)
                               if not isinstance(r, dict) else r for r in refs]

  @property
  def devices(self) -> int:
    """The planned devices: what placement numbers."""
    return sum(n.devices for n in self.nodes)

  def describe(self) -> str:
    kind = 'GPUs' if self.gpus else 'CPU devices'
    lines = [f'Ray cluster: {len(self.nodes)} node(s), {self.devices} planned {kind}: ' +
             ', '.join(f'{n.address} ({n.id[:12]}) devices {n.devices}' for n in self.nodes)]
    return '\n'.join(lines + [nodes_lib.describe(self.processes)])

  def save(self, workdir: str) -> None:
    """Add to `WORKDIR/placement.json` (which says which devices) which node and process
    holds each training mesh and rollout instance, under `cluster`."""
    path = os.path.join(workdir, placement_lib.FILENAME)
    with open(path, encoding='utf-8') as f:
      placed = json.load(f)
    placed['cluster'] = {'nodes': [vars(n) for n in self.nodes], 'processes': self.processes}
    with open(path, 'w', encoding='utf-8') as f:
      json.dump(placed, f, indent=2)

  def close(self) -> None:
    """Stop every worker of the run (and the cluster, if the run started it)."""
    import ray
    for actor in self.actors:
      ray.kill(actor, no_restart=True)
    self.actors.clear()
    if self.started:
      ray.shutdown()
