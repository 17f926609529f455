"""Fitting a team to the devices there are, when the layout it asks for needs more:
which changes, and what each costs (see `fit`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flexmarl.core.errors import ConfigError
from flexmarl.placement.plan import (AgentDemand, Fit, Placement, derive, devices_needed,
                                pool_shapes, size)


def fit(demands: Mapping[str, AgentDemand], mode: str, device_ids: Sequence[int],
        pool_devices: int = 0, mesh_shapes: Sequence[tuple[int, ...]] = (), *,
        strict: bool = False, state_bytes: Callable[[], Mapping[str, int]] = dict
        ) -> Placement:
  """`derive`, fitted to the devices there are when the layout asked for needs more.

  A config that places anything explicitly (device ids, a training pool) is never
  changed, and `strict` never fits: both get `derive`'s refusal. Otherwise, on too few
  devices: with `separate`, rollout instances move onto their agents' training devices;
  if the agents' own meshes still do not fit, they share a training pool over every
  device (one mesh of each shape, more while devices remain). `state_bytes` gives each
  agent's training state (the cost of a pool's swaps). Even that not fitting raises
  `derive`'s error.
  """
  asked, n = devices_needed(demands, mode), len(device_ids)
  explicit = pool_devices or any(a.train_devices or a.instance_devices
                                 for a in demands.values())
  if explicit or asked <= n:
    return derive(demands, mode, device_ids, pool_devices, mesh_shapes)
  if strict:
    raise _refusal(demands, mode, device_ids, "(config.placement='strict'; 'fit' fits the "
                   'team to the devices there are.)')
  shapes = [tuple(a.mesh_shape) for a in demands.values()]
  changes: dict[str, Any] = {}
  costs = []
  if mode == 'separate':
    changes['rollout.devices'] = 'shared'
    costs.append(f'rollout.devices=shared: the {sum(a.instances for a in demands.values() if not a.serves_with)} '
                 "rollout instances run on training devices, so an agent's sampling and "
                 'gradient work queue on one device instead of overlapping.')
  if sum(map(size, shapes)) > n:
    pool_need = sum(map(size, dict.fromkeys(shapes)))
    if pool_need > n:
      raise _refusal(demands, mode, device_ids, f'Fitting the team to {n} devices failed '
                     f'too: a training pool needs one mesh of each agent shape, {pool_need} '
                     'devices.')
    meshes = pool_shapes(shapes, n)
    changes['training.pool_devices'] = n
    largest = max(state_bytes().values(), default=0)
    costs.append(f'training.pool_devices={n}: {len(demands)} agents take turns on '
                 f'{len(meshes)} training mesh(es) {meshes}; an agent waits while another '
                 f'trains, and between its turns its state (up to {largest / 2**20:.1f} MiB '
                 'an agent) moves to host memory and back.')
  placement = derive(demands, 'shared', device_ids, changes.get('training.pool_devices', 0))
  used = {d for m in [*placement.train.values(), *placement.pool] for d in m.devices}
  idle = [d for d in device_ids if d not in used]
  if idle:
    costs.append(f'devices {idle} stay idle (no agent has work for them in this layout).')
  return dataclasses.replace(placement, fitted=Fit(asked, n, changes, tuple(costs)))


def _refusal(demands: Mapping[str, AgentDemand], mode: str, device_ids: Sequence[int],
             note: str) -> ConfigError:
  """`derive`'s error for a layout that needs more devices than there are, with `note`."""
  try:
    derive(demands, mode, device_ids)
  except ConfigError as e:
    return ConfigError(f'{e} {note}')
  raise AssertionError(f'a layout needing {devices_needed(demands, mode)} devices fit in '
                       f'{len(device_ids)}')
