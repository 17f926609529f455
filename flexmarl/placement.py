"""Placement as data: which devices form each agent's training mesh and each of its
rollout instances.

Derived from the config by default (training meshes first, in config order, on
consecutive devices; then, with `rollout.devices=separate`, each rollout instance on
devices of its own; with `shared`, instances run on their agent's training devices),
or given explicitly per agent (`train_devices`, `rollout.devices`). It is checked
before anything compiles, printed at start-up, saved as `WORKDIR/placement.json`
and compared on resume. Devices are named by their `jax.Device.id`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence

from flexmarl.errors import ConfigError

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


@dataclasses.dataclass(frozen=True)
class Placement:
  mode: str
  train: Mapping[str, MeshPlacement]
  rollout: Mapping[str, tuple[MeshPlacement, ...]]  # per agent, its instances

  def to_dict(self) -> dict:
    mesh = lambda m: {'devices': list(m.devices), 'shape': list(m.shape)}
    return {'mode': self.mode, 'train': {a: mesh(m) for a, m in self.train.items()},
            'rollout': {a: [mesh(m) for m in ms] for a, ms in self.rollout.items()}}

  @classmethod
  def from_dict(cls, d: Mapping) -> Placement:
    mesh = lambda m: MeshPlacement(tuple(m['devices']), tuple(m['shape']))
    return cls(d['mode'], {a: mesh(m) for a, m in d['train'].items()},
               {a: tuple(mesh(m) for m in ms) for a, ms in d['rollout'].items()})

  def describe(self) -> str:
    lines = [f'placement ({self.mode} rollout devices):']
    for agent, m in self.train.items():
      inst = ', '.join(str(list(i.devices)) for i in self.rollout[agent])
      lines.append(f'  {agent:<12} train {list(m.devices)} mesh {m.shape}  rollout {inst}')
    return '\n'.join(lines)


def _size(shape: Sequence[int]) -> int:
  return math.prod(shape)


def derive(demands: Mapping[str, AgentDemand], mode: str, device_ids: Sequence[int]
           ) -> Placement:
  """The placement the config asks for; raises ConfigError on any conflict."""
  if mode not in MODES:
    raise ConfigError(f'config.rollout.devices={mode!r}: choose one of {list(MODES)}.')
  known = set(device_ids)
  explicit = [d for a in demands.values() for d in a.train_devices] + [
      d for a in demands.values() for devs in a.instance_devices for d in devs]
  free = [d for d in device_ids if d not in explicit]

  def take(field: str, count: int) -> tuple[int, ...]:
    if count > len(free):
      needed = sum(_size(a.mesh_shape) * (1 + (mode == 'separate') * a.instances)
                   for a in demands.values())
      raise ConfigError(
          f'config.{field}: no {count} free devices left ({len(device_ids)} in all; this '
          f'placement needs about {needed}). Shrink the meshes or the instance counts'
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
    if len(devices) != _size(shape):
      raise ConfigError(f'config.{field}={list(devices)}: {len(devices)} devices for a mesh '
                        f'of shape {tuple(shape)}; give {_size(shape)}.')
    return tuple(devices)

  train: dict[str, MeshPlacement] = {}
  for name, a in demands.items():
    field = f'agents.{name}.train_devices'
    devs = (given(field, a.train_devices, a.mesh_shape) if a.train_devices
            else take(f'agents.{name}.mesh_shape', _size(a.mesh_shape)))
    train[name] = MeshPlacement(devs, tuple(a.mesh_shape))
  rollout: dict[str, tuple[MeshPlacement, ...]] = {}
  for name, a in demands.items():
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
        devs = take(f'{field}.instances', _size(a.mesh_shape))
      else:
        devs = train[name].devices
      insts.append(MeshPlacement(devs, tuple(a.mesh_shape)))
    rollout[name] = tuple(insts)
  placement = Placement(mode, train, rollout)
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
  if p.mode == 'separate':
    for name, insts in p.rollout.items():
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
