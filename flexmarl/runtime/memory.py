"""What a team holds in memory, from shapes alone: the report a run logs before it starts
(per agent its state and base, per device group the most it holds). Nothing is allocated."""

from __future__ import annotations

import collections
from collections.abc import Mapping

from flexmarl.placement.plan import Placement
from flexmarl.spec.agent import AgentSpec
from flexmarl.train import sizing


def _mib(n: int) -> str:
  return f'{n / 2**20:.1f} MiB'


def holdings(agents: Mapping[str, AgentSpec], placement: Placement
              ) -> tuple[dict[str, int], dict[str, int], dict[str, tuple], dict[tuple, dict]]:
  """(state bytes, base weight bytes, base keys of LoRA agents, per device group what it
  holds: {'bases', 'states', 'weights', 'training'})."""
  state = {n: sizing.state_nbytes(a.model, a.optimizer, a.grpo) for n, a in agents.items()}
  weights = {n: sizing.param_nbytes(a.model.without_adapters)
             for n, a in agents.items()}
  keys = {n: a.base_key for n, a in agents.items() if a.model.lora.rank}
  groups: dict[tuple, dict] = collections.defaultdict(
      lambda: {'bases': {}, 'states': {}, 'weights': {}, 'training': []})
  pooled = [n for n, m in placement.train.items() if not m.devices]
  for mesh in placement.pool:
    g = groups[tuple(mesh.devices)]
    g['bases'].update({keys[n]: weights[n] for n in pooled if n in keys})
    if pooled:
      g['states']['one pool agent at a time'] = max(state[n] for n in pooled)
      g['training'].append(pooled)
  for n in agents:
    train = tuple(placement.train[n].devices)
    if train:
      groups[train]['states'][n] = state[n]
      groups[train]['training'].append([n])
      if n in keys:
        groups[train]['bases'][keys[n]] = weights[n]
    for inst in placement.rollout[n]:
      g = groups[tuple(inst.devices)]
      if n in keys:
        g['bases'][keys[n]] = weights[n]
      elif tuple(inst.devices) != train:
        g['weights'][n] = weights[n]
  return state, weights, keys, dict(groups)


def held_bytes(group: Mapping) -> int:
  """What a device group holds at rest (one of `holdings`'s groups)."""
  return sum(sum(group[k].values()) for k in ('bases', 'states', 'weights'))


def describe_memory(agents: Mapping[str, AgentSpec], placement: Placement) -> str:
  """What the team holds, from shapes: per agent its state (what moves, swaps and is
  checkpointed; a LoRA agent's adapters) and its base (LoRA agents of one base share
  one copy per device group); per device group the most it holds: one copy of each
  base used there, the states of the agents training there (a training-pool mesh: the
  largest, agents take turns) and the weights of full agents served there. A train
  step's scratch (its activations) is not counted: `python -m flexmarl.plan_memory`
  compiles one and adds it."""
  state, weights, keys, groups = holdings(agents, placement)
  sharers = collections.defaultdict(list)
  for n, key in keys.items():
    sharers[key].append(n)
  lines = ['memory (state: what moves and is checkpointed; base: held apart, one copy per '
           'device group):']
  for n, a in agents.items():
    base = (f'  base {keys[n][1]} {_mib(weights[n])} shared by {", ".join(sharers[keys[n]])}'
            if n in keys else '  (full model)')
    lines.append(f'  {n:<12} state {_mib(state[n])}{base}')
  lines.append('per device group (a train step\'s activations not counted: '
               'python -m flexmarl.plan_memory adds them):')
  for devices, g in groups.items():
    parts = [f'{len(g["bases"])} base(s) {_mib(sum(g["bases"].values()))}'] if g['bases'] else []
    parts += [f'state {k} {_mib(v)}' for k, v in g['states'].items()]
    parts += [f'weights {k} {_mib(v)}' for k, v in g['weights'].items()]
    lines.append(f'  {list(devices)}  {_mib(held_bytes(g))}: {", ".join(parts)}')
  return '\n'.join(lines)
