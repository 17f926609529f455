"""Placement as data: which devices form each agent's training mesh and each of its
rollout instances.

Derived from the config by default (training meshes first, in config order, on
consecutive devices; then, with `rollout.devices=separate`, each rollout instance on
devices of its own; with `shared`, instances run on their agent's training devices),
or given explicitly per agent (`train_devices`, `rollout.devices`).

With a training pool (`training.pool_devices` > 0) agents have no mesh of their own:
the pool's first devices are carved, consecutively, into meshes (`pool`), and an
agent is bound to a free one of its shape whenever it has work (`train.engine`); its
`train` entry then names its shape with no devices. With `rollout.devices=shared`
its instances run on the pool meshes of its shape (instance j of the k-th agent of a
shape on mesh (k + j) mod n of the n meshes of that shape); with `separate` on
devices outside the pool. It is checked
before anything compiles, printed at start-up, saved as `WORKDIR/placement.json`
and compared on resume. Devices are named by their `jax.Device.id`.

LoRA agents of one base may share their rollout instances (`rollout.adapter_groups`):
the group's first agent is placed as any agent is, and every other agent of the
group is served by those same instances, each holding the base once and
every agent's adapter (`adapter_groups` names the groups; an agent's `serves_with`
names its group's first agent).

When the devices are too few for the layout the config asks for and the config places
nothing explicitly, `fit` fits the team to the devices there are: rollout instances
move onto training devices (`rollout.devices=shared`), then, if the agents' own meshes
still do not fit, the agents share a training pool over every device. The choice and
what it costs are recorded in the placement (`Fit`); `strict` keeps the refusal.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from flexmarl.core.errors import ConfigError

MODES = ('shared', 'separate')
FILENAME = 'placement.json'


@dataclasses.dataclass(frozen=True)
class MeshPlacement:
  devices: tuple[int, ...]
  shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class AgentDemand:
  """What placement needs from one agent's config (empty tuples: derive)."""

  mesh_shape: tuple[int, ...]
  instances: int = 1
  train_devices: tuple[int, ...] = ()
  instance_devices: tuple[tuple[int, ...], ...] = ()
  serves_with: str = ''  # the agent whose instances serve this one's adapter ('': its own)


@dataclasses.dataclass(frozen=True)
class Fit:
  """How `fit` changed a layout that needed more devices than there are."""

  asked: int  # devices the layout the config asks for needs
  devices: int  # devices there are
  changes: Mapping[str, Any]  # config fields as fitted, e.g. {'rollout.devices': 'shared'}
  costs: tuple[str, ...]  # what each change costs, in words

  def to_dict(self) -> dict:
    return {'asked_devices': self.asked, 'devices': self.devices,
            'changes': dict(self.changes), 'costs': list(self.costs)}

  @classmethod
  def from_dict(cls, d: Mapping) -> Fit:
    return cls(d['asked_devices'], d['devices'], dict(d['changes']), tuple(d['costs']))


@dataclasses.dataclass(frozen=True)
class Placement:
  mode: str
  train: Mapping[str, MeshPlacement]
  rollout: Mapping[str, tuple[MeshPlacement, ...]]  # per agent, its instances
  pool: tuple[MeshPlacement, ...] = ()  # the training pool's meshes (train devices: ())
  fitted: Fit | None = None  # None: the layout the config asks for
  # agents whose adapters share instances: the first agent's, the others after it in
  # config order (in `rollout`, every agent of a group lists the same instances)
  adapter_groups: tuple[tuple[str, ...], ...] = ()

  def to_dict(self) -> dict:
    mesh = lambda m: {'devices': list(m.devices), 'shape': list(m.shape)}
    return {'mode': self.mode, 'train': {a: mesh(m) for a, m in self.train.items()},
            'rollout': {a: [mesh(m) for m in ms] for a, ms in self.rollout.items()},
            'pool': [mesh(m) for m in self.pool],
            'fitted': self.fitted.to_dict() if self.fitted else None,
            'adapter_groups': [list(g) for g in self.adapter_groups]}

  def group_of(self, agent: str) -> tuple[str, ...]:
    """The agents whose adapters share `agent`'s instances (() : it has its own)."""
    return next((g for g in self.adapter_groups if agent in g), ())

  @classmethod
  def from_dict(cls, d: Mapping) -> Placement:
    mesh = lambda m: MeshPlacement(tuple(m['devices']), tuple(m['shape']))
    fitted = d.get('fitted')
    return cls(d['mode'], {a: mesh(m) for a, m in d['train'].items()},
               {a: tuple(mesh(m) for m in ms) for a, ms in d['rollout'].items()},
               tuple(mesh(m) for m in d.get('pool', ())),
               Fit.from_dict(fitted) if fitted else None,
               tuple(tuple(g) for g in d.get('adapter_groups', ())))

  def describe(self) -> str:
    lines = []
    if self.fitted:
      f = self.fitted
      changes = ', '.join(f'{k}={v}' for k, v in f.changes.items())
      lines += [f'placement fitted to {f.devices} device(s) (the config asks for {f.asked}): '
                f'{changes}; --config.placement=strict refuses instead.',
                *(f'  cost: {c}' for c in f.costs)]
    lines.append(f'placement ({self.mode} rollout devices):')
    if self.pool:
      lines.append('  training pool: ' + ', '.join(f'{list(m.devices)} mesh {m.shape}'
                                                   for m in self.pool))
    for agent, m in self.train.items():
      inst = ', '.join(str(list(i.devices)) for i in self.rollout[agent])
      train = list(m.devices) if m.devices else 'pool'
      group = self.group_of(agent)
      shared = f' (one adapter of {", ".join(group)} on each)' if group else ''
      lines.append(f'  {agent:<12} train {train} mesh {m.shape}  rollout {inst}{shared}')
    return '\n'.join(lines)


def size(shape: Sequence[int]) -> int:
  return math.prod(shape)


def devices_needed(demands: Mapping[str, AgentDemand], mode: str) -> int:
  """Devices a derived layout without a pool takes: every agent's mesh, and with
  `separate` a mesh's worth per rollout instance (a shared instance counted once)."""
  return sum(size(a.mesh_shape) * (1 + (mode == 'separate' and not a.serves_with) * a.instances)
             for a in demands.values())


def pool_shapes(agent_shapes: Sequence[tuple[int, ...]], pool_devices: int
                ) -> list[tuple[int, ...]]:
  """The pool's mesh shapes when the config does not list them: one mesh of each
  distinct agent shape (in config order), then more, round-robin, while devices remain
  and a shape has more agents than meshes."""
  distinct = list(dict.fromkeys(agent_shapes))
  need = sum(map(size, distinct))
  if need > pool_devices:
    raise ConfigError(
        f'config.training.pool_devices={pool_devices}: one mesh of each agent shape '
        f'{distinct} needs {need} devices; give the pool at least {need}, or use fewer '
        'distinct mesh shapes.')
  shapes, left, grew = list(distinct), pool_devices - need, True
  while grew:
    grew = False
    for shape in distinct:
      if size(shape) <= left and shapes.count(shape) < agent_shapes.count(shape):
        shapes.append(shape)
        left -= size(shape)
        grew = True
  return sorted(shapes, key=distinct.index)


def derive(demands: Mapping[str, AgentDemand], mode: str, device_ids: Sequence[int],
           pool_devices: int = 0, mesh_shapes: Sequence[tuple[int, ...]] = ()) -> Placement:
  """The placement the config asks for; raises ConfigError on any conflict.
  `pool_devices` > 0: a training pool of meshes `mesh_shapes` (() derives them)."""
  if mode not in MODES:
    raise ConfigError(f'config.rollout.devices={mode!r}: choose one of {list(MODES)}.')
  if pool_devices:
    for name, a in demands.items():
      if a.train_devices:
        raise ConfigError(f'config.agents.{name}.train_devices={list(a.train_devices)}: with '
                          'a training pool agents train on its meshes; remove it, or set '
                          'training.pool_devices=0.')
  known = set(device_ids)
  explicit = [d for a in demands.values() for d in a.train_devices] + [
      d for a in demands.values() for devs in a.instance_devices for d in devs]
  free = [d for d in device_ids if d not in explicit]

  def take(field: str, count: int) -> tuple[int, ...]:
    if count > len(free):
      raise ConfigError(
          f'config.{field}: no {count} free devices left ({len(device_ids)} in all; this '
          f'placement needs about {devices_needed(demands, mode)}). Shrink the meshes or the '
          'instance counts'
          f'{", or set rollout.devices=shared" if mode == "separate" else ""} (on CPU, '
          'set XLA_FLAGS=--xla_force_host_platform_device_count=N before starting).')
    out = tuple(free[:count])
    del free[:count]
    return out

  def given(field: str, devices: Sequence[int], shape: Sequence[int]) -> tuple[int, ...]:
    unknown = [d for d in devices if d not in known]
    if unknown:
      raise ConfigError(f'config.{field}={list(devices)}: devices {unknown} do not exist; '
                        f'the ids here are {sorted(known)}.')
    if len(devices) != size(shape):
      raise ConfigError(f'config.{field}={list(devices)}: {len(devices)} devices for a mesh '
                        f'of shape {tuple(shape)}; give {size(shape)}.')
    return tuple(devices)

  pool: list[MeshPlacement] = []
  if pool_devices:
    shapes = [tuple(s) for s in mesh_shapes] or pool_shapes(
        [tuple(a.mesh_shape) for a in demands.values()], pool_devices)
    if sum(map(size, shapes)) > pool_devices:
      raise ConfigError(f'config.training.mesh_shapes={shapes}: they need '
                        f'{sum(map(size, shapes))} devices, the pool has {pool_devices}; '
                        'list fewer or smaller meshes, or give the pool more devices.')
    for name, a in demands.items():
      if tuple(a.mesh_shape) not in shapes:
        raise ConfigError(f'config.agents.{name}.mesh_shape={tuple(a.mesh_shape)}: no mesh of '
                          f'training.mesh_shapes={shapes} has this shape; add one.')
    devices = take('training.pool_devices', pool_devices)
    start = 0
    for shape in shapes:
      pool.append(MeshPlacement(devices[start:start + size(shape)], shape))
      start += size(shape)
  train: dict[str, MeshPlacement] = {}
  for name, a in demands.items():
    if pool:
      train[name] = MeshPlacement((), tuple(a.mesh_shape))
      continue
    field = f'agents.{name}.train_devices'
    devs = (given(field, a.train_devices, a.mesh_shape) if a.train_devices
            else take(f'agents.{name}.mesh_shape', size(a.mesh_shape)))
    train[name] = MeshPlacement(devs, tuple(a.mesh_shape))
  rollout: dict[str, tuple[MeshPlacement, ...]] = {}
  rank = {n: [m for m in demands if demands[m].mesh_shape == a.mesh_shape].index(n)
          for n, a in demands.items()}  # the agent's index among agents of its shape
  for name, a in demands.items():
    if a.serves_with:  # after the loop: its group's first agent's instances
      continue
    field = f'agents.{name}.rollout'
    if a.instances < 1:
      raise ConfigError(f'config.{field}.instances={a.instances}: every agent needs at least '
                        'one rollout instance.')
    if a.instance_devices and len(a.instance_devices) != a.instances:
      raise ConfigError(f'config.{field}.devices: {len(a.instance_devices)} device lists for '
                        f'instances={a.instances}; give one list per instance, or none.')
    insts = []
    for i in range(a.instances):
      if a.instance_devices:
        devs = given(f'{field}.devices[{i}]', a.instance_devices[i], a.mesh_shape)
      elif mode == 'separate':
        devs = take(f'{field}.instances', size(a.mesh_shape))
      elif pool:
        same = [m for m in pool if m.shape == tuple(a.mesh_shape)]
        devs = same[(rank[name] + i) % len(same)].devices
      else:
        devs = train[name].devices
      insts.append(MeshPlacement(devs, tuple(a.mesh_shape)))
    rollout[name] = tuple(insts)
  groups: dict[str, list[str]] = {}
  for name, a in demands.items():
    if a.serves_with:
      if demands.get(a.serves_with, a).serves_with != '':
        raise ConfigError(f'config.rollout.adapter_groups: agent {name!r} is to be served with '
                          f'{a.serves_with!r}, which is not the first agent of a group; list '
                          'each agent in one group only.')
      rollout[name] = rollout[a.serves_with]
      groups.setdefault(a.serves_with, [a.serves_with]).append(name)
  placement = Placement(mode, train, rollout, tuple(pool),
                        adapter_groups=tuple(tuple(g) for g in groups.values()))
  check(placement)
  return placement


def check(p: Placement) -> None:
  """No device in two training meshes; with `separate`, none shared by training and
  rollout or by two instances."""
  owner: dict[int, str] = {}

  def claim(devices: Sequence[int], who: str, fix: str) -> None:
    for d in devices:
      if d in owner:
        raise ConfigError(f'config.{who}: device {d} is already used by {owner[d]}; {fix}')
      owner[d] = who

  for name, m in p.train.items():
    claim(m.devices, f'agents.{name}.train_devices',
          'each agent trains on devices of its own: pick other devices.')
  for i, m in enumerate(p.pool):
    claim(m.devices, f'training.pool[{i}]', 'the pool takes the first free devices: pick '
          'explicit devices elsewhere, or shrink training.pool_devices.')
  if p.mode == 'separate':
    served_with = {n for g in p.adapter_groups for n in g[1:]}  # their group's instances
    for name, insts in p.rollout.items():
      if name in served_with:
        continue
      for i, m in enumerate(insts):
        claim(m.devices, f'agents.{name}.rollout.devices[{i}]',
              'with rollout.devices=separate every instance needs devices no trainer or other '
              'instance uses: pick other devices, or set rollout.devices=shared.')


def save(p: Placement, workdir: str) -> None:
  with open(os.path.join(workdir, FILENAME), 'w', encoding='utf-8') as f:
    json.dump(p.to_dict(), f, indent=2)


def load(workdir: str) -> Placement | None:
  path = os.path.join(workdir, FILENAME)
  if not os.path.exists(path):
    return None
  with open(path, encoding='utf-8') as f:
    return Placement.from_dict(json.load(f))


def check_resume(p: Placement, workdir: str) -> None:
  """A resumed run keeps each agent's mesh shapes (checkpoints are resharded onto new
  devices, but the agents and their instance counts must match)."""
  old = load(workdir)
  if old is None:
    return
  if set(old.train) != set(p.train):
    raise ConfigError(f'config.agents: the run in {workdir} has agents {sorted(old.train)}, '
                      f'this config {sorted(p.train)}; use a new --workdir or the old agents.')
  for name, m in p.train.items():
    if old.train[name].shape != m.shape:
      raise ConfigError(
          f'config.agents.{name}.mesh_shape={m.shape}: the run in {workdir} trained it on '
          f'{old.train[name].shape} ({FILENAME}); use a new --workdir or the old shape.')
