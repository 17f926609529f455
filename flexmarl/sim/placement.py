"""Where a simulated setup's agents train and serve: a Placement of the simulated cluster.

Placements of a setup:
- separate (FlexMARL): the rollout pool (`cluster.rollout_nodes`) is split evenly by
  devices between the agents, each instance `rollout_tp` devices; the training pool
  (`cluster.train_nodes`) gives each agent a mesh of `train_devices` of its own, or,
  with `training_meshes` = k > 0, k meshes of `train_devices` that the agents take
  turns on: the real `train.engine.TrainingEngine` binds them (`allocate`, `evict_lru`,
  prefetching), the simulated trainers charge the swaps at the links' bandwidths
  (`sim.trainer`), and `host_budget_bytes` (setup, default 0: unlimited) bounds the
  host memory for released states.
- colocated (hybrid engines such as MARTI's): the whole cluster is split evenly between
  the agents; an agent's instances and its trainer share its devices. Its trainer
  spans all of them; before training it offloads the instances' weights and loads its
  train state, after the optimizer step it offloads that state, and the instances load
  their weights back (see `sim.team.colocated_costs`).
"""

from __future__ import annotations

import ml_collections

from flexmarl.core.errors import ConfigError
from flexmarl.placement import plan as placement_lib
from flexmarl.train.pool_meshes import PoolMesh


def _instances(first: int, count: int, tp: int) -> tuple[placement_lib.MeshPlacement, ...]:
  return tuple(placement_lib.MeshPlacement(tuple(range(first + i * tp, first + (i + 1) * tp)),
                                           (1, tp)) for i in range(count))


def colocated_placement(setup: ml_collections.ConfigDict) -> placement_lib.Placement:
  """The whole cluster split evenly between the agents; each agent's trainer spans its
  share and its instances tile it."""
  c, agents = setup.cluster, setup.agents
  share = c.nodes * c.devices_per_node // len(agents)
  train, rollout = {}, {}
  for k, (name, a) in enumerate(agents.items()):
    if share < a.rollout_tp:
      raise ConfigError(f'config.agents.{name}.rollout_tp={a.rollout_tp}: a colocated share '
                        f'of the cluster is {share} devices; add nodes or lower rollout_tp.')
    devs = tuple(range(k * share, (k + 1) * share))
    train[name] = placement_lib.MeshPlacement(devs, (1, share))
    rollout[name] = _instances(devs[0], share // a.rollout_tp, a.rollout_tp)
  placement = placement_lib.Placement('shared', train, rollout)
  placement_lib.check(placement)
  return placement


def sim_placement(setup: ml_collections.ConfigDict, colocated: bool = False
                  ) -> placement_lib.Placement:
  """Separate pools (training meshes from the training pool, instances from an even
  split of the rollout pool or `instances` per agent where the setup gives it), or
  `colocated` (see the module doc)."""
  if colocated:
    return colocated_placement(setup)
  c, agents = setup.cluster, setup.agents
  if c.train_nodes + c.rollout_nodes > c.nodes:
    raise ConfigError(f'config.cluster: train_nodes={c.train_nodes} + rollout_nodes='
                      f'{c.rollout_nodes} exceed nodes={c.nodes}; shrink one of the pools.')
  train_devices = c.train_nodes * c.devices_per_node
  meshes = setup.get('training_meshes', 0)
  pool = ()
  if meshes:
    sizes = {a.train_devices for a in agents.values()}
    if len(sizes) != 1 or meshes * min(sizes) > train_devices:
      raise ConfigError(f'config.training_meshes={meshes}: a pool of meshes needs one '
                        f'train_devices for every agent (got {sorted(sizes)}) and '
                        f'meshes x train_devices <= {train_devices} (the training nodes).')
    size = sizes.pop()
    pool = tuple(placement_lib.MeshPlacement(tuple(range(i * size, (i + 1) * size)), (1, size))
                 for i in range(meshes))
  train_ids = iter(range(train_devices))
  first_rollout = train_devices
  rollout_devices = c.rollout_nodes * c.devices_per_node
  share = rollout_devices // len(agents)
  train, rollout, next_rollout = {}, {}, first_rollout
  for name, a in agents.items():
    if pool:
      train[name] = placement_lib.MeshPlacement((), (1, a.train_devices))
    else:
      devs = tuple(next(train_ids, None) for _ in range(a.train_devices))
      if None in devs:
        raise ConfigError(f'config.agents.{name}.train_devices={a.train_devices}: the '
                          f'training pool ({c.train_nodes} nodes) is used up; add train_nodes, '
                          'shrink the meshes, or set training_meshes to share them.')
      train[name] = placement_lib.MeshPlacement(devs, (1, a.train_devices))
    count = a.get('instances') or share // a.rollout_tp
    if count < 1 or next_rollout + count * a.rollout_tp > first_rollout + rollout_devices:
      raise ConfigError(f'config.agents.{name}: {count} rollout instances of {a.rollout_tp} '
                        f'devices do not fit the rollout pool ({rollout_devices} devices); '
                        'add rollout_nodes or lower instances / rollout_tp.')
    rollout[name] = _instances(next_rollout, count, a.rollout_tp)
    next_rollout += count * a.rollout_tp
  placement = placement_lib.Placement('separate', train, rollout, pool)
  placement_lib.check(placement)
  return placement


def pool_meshes(placement: placement_lib.Placement) -> list[PoolMesh]:
  """The training pool's meshes, named as the real run names them."""
  return [PoolMesh(f'pool{i}', m.devices, m.shape) for i, m in enumerate(placement.pool)]


def train_tracks(placement: placement_lib.Placement) -> list[str]:
  """The span tracks of the training device groups: one per pool mesh, or per agent."""
  if placement.pool:
    return [f'train/{m.name}' for m in pool_meshes(placement)]
  return [f'train/{name}' for name in placement.train]
