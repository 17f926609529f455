"""Which node and process runs each planned device group: a pure function of the
placement's device ids and the nodes' capacities, so a placement planned with device
ids runs unchanged on a cluster.

Planned devices are numbered across the cluster, node after node: with two nodes of four
devices, ids 0-3 are the first node's and 4-7 the second's. A training mesh whose
devices span nodes runs as one process per node (or per `devices_per_process` devices),
the processes forming one `jax.distributed` cluster; a rollout instance runs in one
process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class Node:
  """A cluster node: Ray's id, its address, and the planned devices it holds."""

  id: str
  address: str
  devices: int


@dataclasses.dataclass(frozen=True)
class Slot:
  """One process of a device group: on `node`, over the planned `devices` (its local
  devices, in order)."""

  node: Node
  devices: tuple[int, ...]


def node_of(nodes: Sequence[Node]) -> dict[int, Node]:
  """Planned device id → the node that holds it (ids numbered node after node)."""
  owner, first = {}, 0
  for node in nodes:
    owner.update({d: node for d in range(first, first + node.devices)})
    first += node.devices
  return owner


def split_devices(total: int, node_ids: Sequence[tuple[str, str]]) -> list[Node]:
  """`total` planned devices over nodes without accelerators, as evenly as possible
  (the first nodes take one more)."""
  if not node_ids:
    raise ValueError('the Ray cluster has no alive node: start one (`ray start --head`).')
  share, extra = divmod(total, len(node_ids))
  return [Node(i, a, share + (k < extra)) for k, (i, a) in enumerate(node_ids)]


def slots(group: str, devices: Sequence[int], nodes: Sequence[Node], devices_per_process: int,
          one_process: bool) -> list[Slot]:
  """The processes that run device group `group`: its devices by node, in the
  placement's order, each node's share cut into processes of `devices_per_process`
  (0: one per node). `one_process`: refuse a group that would need more (a rollout
  instance)."""
  owner = node_of(nodes)
  unknown = [d for d in devices if d not in owner]
  if unknown:
    raise ValueError(
        f'{group} is placed on devices {list(devices)}, but the cluster holds planned devices '
        f'0-{len(owner) - 1} ({", ".join(f"{n.address}: {n.devices}" for n in nodes)}); '
        'add nodes, or set config.cluster.devices to what the cluster has.')
  by_node: dict[str, list[int]] = {}
  for d in devices:
    by_node.setdefault(owner[d].id, []).append(d)
  out = []
  for node_id, ids in by_node.items():
    node = next(n for n in nodes if n.id == node_id)
    size = devices_per_process or len(ids)
    if len(ids) % size:
      raise ValueError(f'{group} has {len(ids)} devices on node {node.address}, not a multiple '
                       f'of config.cluster.devices_per_process={devices_per_process}; choose a '
                       'divisor of every mesh\'s devices per node.')
    out += [Slot(node, tuple(ids[i:i + size])) for i in range(0, len(ids), size)]
  if one_process and len(out) > 1:
    raise ValueError(f'{group} would span {len(out)} processes (devices {list(devices)} over '
                     f'nodes {[s.node.address for s in out]}), but a rollout instance runs in one '
                     'process: give its devices on one node (agents.NAME.rollout.devices).')
  return out


def describe(processes: Mapping[str, Sequence[Mapping]]) -> str:
  """Start-up lines: each device group's processes (node, pid, devices)."""
  lines = ['processes (Ray):']
  for group, ranks in processes.items():
    where = '; '.join(f"{p['address']} pid {p['pid']} devices {p['devices']}" for p in ranks)
    lines.append(f'  {group:<24} {where}')
  return '\n'.join(lines)
