"""An agent's training state sized from shapes alone, and the checks that must pass
before anything compiles: a mesh larger than the training pool, a host budget smaller
than one agent's state. Nothing is allocated or compiled (`jax.eval_shape`)."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

import jax
import numpy as np
from flax import nnx

from flexmarl.errors import ConfigError
from flexmarl.models import lora, sharding, transformer
from flexmarl.models.lora import LoRAConfig
from flexmarl.train import bases
from flexmarl.train.optimizer import make_optimizer
from flexmarl.train.spec import GRPOConfig, OptimizerConfig

if TYPE_CHECKING:
  from flexmarl.agent_spec import AgentSpec
  from flexmarl.placement import Placement


def check_pool(pool_devices: int, layouts: Mapping[str, sharding.MeshLayout],
               field: str = 'agents.{name}.mesh_shape') -> None:
  """Every agent's mesh fits in the pool (agents may together need more: they take turns)."""
  for name, lay in layouts.items():
    if lay.size > pool_devices:
      raise ConfigError(
          f'config.{field.format(name=name)}={lay.shape}: a mesh over {lay.axes} needs '
          f'{lay.size} devices, but the training pool has {pool_devices}. Use a smaller mesh '
          f'shape, or give the training pool at least {lay.size} devices.')


def _abstract_params(model_cfg: transformer.ModelConfig) -> dict:
  model = nnx.eval_shape(lambda: transformer.Decoder(model_cfg, nnx.Rngs(params=0)))
  return nnx.to_pure_dict(nnx.state(model))


def param_count(model_cfg: transformer.ModelConfig) -> int:
  """The model's number of parameters, from shapes alone."""
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(_abstract_params(model_cfg)))


def param_nbytes(model_cfg: transformer.ModelConfig) -> int:
  """Bytes of the model's parameters (what a weight sync moves), from shapes alone."""
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(_abstract_params(model_cfg)))


def state_nbytes(model_cfg: transformer.ModelConfig, opt_cfg: OptimizerConfig,
                 grpo_cfg: GRPOConfig) -> int:
  """Bytes of one agent's state at rest (params, optimizer state of the trainable
  params, KL reference, RNG), from shapes alone: nothing is allocated or compiled. A
  LoRA agent's state holds its adapters only (its base is held apart, shared)."""
  params = lora.partition(_abstract_params(model_cfg), model_cfg.lora)[0]
  opt = jax.eval_shape(make_optimizer(opt_cfg).init, params)
  rng = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
  trees = [params, opt, rng] + ([params] if grpo_cfg.kl_coef else [])
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(trees))


def check_host_budget(budget_bytes: int, state_bytes: Mapping[str, int],
                      field: str = 'training.host_budget_bytes', unit: float = 1) -> None:
  """Host memory must hold at least the largest agent state (the one being swapped).
  `unit`: bytes per unit of the config field (1e9 for a field in GB)."""
  if not state_bytes:
    return
  name, largest = max(state_bytes.items(), key=lambda kv: kv[1])
  if budget_bytes < largest:
    raise ConfigError(
        f'config.{field}={budget_bytes / unit:.10g}: agent {name!r} alone has a state of '
        f'{largest} bytes ({largest / 2**20:.1f} MiB); raise the budget to at least '
        f'{largest / unit:.10g}, or leave it unset for no limit.')


def _mib(n: int) -> str:
  return f'{n / 2**20:.1f} MiB'


def describe_memory(agents: Mapping[str, AgentSpec], placement: Placement,
                    team_seed: int) -> str:
  """What the team holds, from shapes: per agent its state (what moves, swaps and is
  checkpointed; a LoRA agent's adapters) and its base (LoRA agents of one base share
  one copy per device group); per device group the most it holds: one copy of each
  base used there, the states of the agents training there (a training-pool mesh: the
  largest, agents take turns) and the weights of full agents served there."""
  state = {n: state_nbytes(a.model, a.optimizer, a.grpo) for n, a in agents.items()}
  weights = {n: _nbytes(_abstract_params(dataclasses.replace(a.model, lora=LoRAConfig())))
             for n, a in agents.items()}
  keys = {n: bases.base_key(a.model, a.checkpoint, bases.base_seed(
      bases.agent_seed(team_seed, i), a.base_seed))
          for i, (n, a) in enumerate(agents.items()) if a.model.lora.rank}
  sharers = collections.defaultdict(list)
  for n, key in keys.items():
    sharers[key].append(n)
  lines = ['memory (state: what moves and is checkpointed; base: held apart, one copy per '
           'device group):']
  for n, a in agents.items():
    base = (f'  base {keys[n][1]} {_mib(weights[n])} shared by {", ".join(sharers[keys[n]])}'
            if n in keys else '  (full model)')
    lines.append(f'  {n:<12} state {_mib(state[n])}{base}')
  groups: dict[tuple, dict] = collections.defaultdict(
      lambda: {'bases': {}, 'states': {}, 'weights': {}})
  pooled = [n for n, m in placement.train.items() if not m.devices]
  for mesh in placement.pool:
    g = groups[tuple(mesh.devices)]
    g['bases'].update({keys[n]: weights[n] for n in pooled if n in keys})
    if pooled:
      g['states']['one pool agent at a time'] = max(state[n] for n in pooled)
  for n in agents:
    train = tuple(placement.train[n].devices)
    if train:
      groups[train]['states'][n] = state[n]
      if n in keys:
        groups[train]['bases'][keys[n]] = weights[n]
    for inst in placement.rollout[n]:
      g = groups[tuple(inst.devices)]
      if n in keys:
        g['bases'][keys[n]] = weights[n]
      elif tuple(inst.devices) != train:
        g['weights'][n] = weights[n]
  lines.append('per device group:')
  for devices, g in groups.items():
    total = sum(g['bases'].values()) + sum(g['states'].values()) + sum(g['weights'].values())
    parts = [f'{len(g["bases"])} base(s) {_mib(sum(g["bases"].values()))}'] if g['bases'] else []
    parts += [f'state {k} {_mib(v)}' for k, v in g['states'].items()]
    parts += [f'weights {k} {_mib(v)}' for k, v in g['weights'].items()]
    lines.append(f'  {list(devices)}  {_mib(total)}: {", ".join(parts)}')
  return '\n'.join(lines)


def _nbytes(tree) -> int:
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
