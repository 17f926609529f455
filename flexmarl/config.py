"""Experiment config → checked, typed team spec.

Experiments are ml_collections ConfigDicts (`experiments/*.py: get_config()`).
`build_team_spec` checks every field before anything is compiled or written and
raises `ConfigError` naming the field, the bad value and the fix.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

from flexmarl import placement as placement_lib
from flexmarl.defaults import agent_config, part_of_run, rollout_config, training_config
from flexmarl.data.records import parse_sample_id
from flexmarl.errors import ConfigError
from flexmarl.models import hf, sharding
from flexmarl.models.transformer import PRESETS, ModelConfig
from flexmarl.rollout.sampler import SamplingParams
from flexmarl.train import pool as pool_lib
from flexmarl.train.grpo import LOSS_NORMS, GRPOConfig
from flexmarl.validate import (check_finite, fail, in_range, refuse_unknown, section,
                               whole_number)
from flexmarl.train.trainer import OptimizerConfig

ON_POLICY_SCHEDULES = ('sync', 'sync_parallel', 'flexmarl')  # staleness 0, same parameters
SCHEDULES = (*ON_POLICY_SCHEDULES, 'async:k')
BACKENDS = ('embedded', 'vllm')
# config.placement: 'fit' fits the team to the devices there are when they are too few
# for the layout asked for (see placement.fit); 'strict' refuses instead.
PLACEMENT_POLICIES = ('fit', 'strict')
ADMISSIONS = ('stream',)  # the rollout engine streams queries (the lockstep 'waves' is gone)

__all__ = ['ConfigError', 'AgentSpec', 'TeamSpec', 'RolloutSpec', 'TrainingSpec',
           'agent_config', 'rollout_config', 'training_config', 'part_of_run',
           'build_team_spec', 'parse_schedule']


@dataclasses.dataclass(frozen=True)
class AgentSpec:
  name: str
  model: ModelConfig
  sampling: SamplingParams
  optimizer: OptimizerConfig
  grpo: GRPOConfig
  group_size: int
  global_batch: int  # rows (samples) per optimizer step
  micro_batch: int  # rows per gradient accumulation
  mesh_shape: tuple[int, ...]
  mesh_axes: tuple[str, ...]  # names of the mesh_shape dims (see models.sharding)
  train_devices: tuple[int, ...]  # explicit device ids, or () to derive
  instances: int  # rollout instances at start
  min_instances: int  # the balancer never takes the agent below this
  max_instances: int  # ... nor above this
  instance_devices: tuple[tuple[int, ...], ...]  # explicit, one tuple per instance, or ()
  checkpoint: str = ''  # HF folder the policy starts from ('' : random initialisation)

  @property
  def layout(self) -> sharding.MeshLayout:
    return sharding.MeshLayout(self.mesh_shape, self.mesh_axes)


@dataclasses.dataclass(frozen=True)
class TrainingSpec:
  """The training pool (see `training_config`); pool_devices 0: no pool."""

  pool_devices: int = 0
  host_budget_bytes: int = 0  # 0: unlimited
  storage_dir: str = ''  # '' : WORKDIR/swap

@dataclasses.dataclass(frozen=True)
class RolloutSpec:
  """How the rollout tier serves queries (see `rollout_config`)."""

  backend: str
  devices: str  # 'shared' | 'separate'
  admission: str  # 'stream'
  query_concurrency: int
  max_step_queries: int
  max_batch: int
  balance: bool
  balance_threshold: float
  balance_cooldown_s: float
  sticky_conversations: bool
  query_timeout_s: float
  vllm: Mapping[str, Any]  # engine arguments of backend='vllm' (VLLMEngineConfig)


@dataclasses.dataclass(frozen=True)
class TeamSpec:
  seed: int
  steps: int
  schedule: str  # 'sync' | 'sync_parallel' | 'flexmarl' | 'async'
  max_staleness: int  # k of `async:k`; 0 (exactly on-policy) for the other schedules
  max_prompt_len: int
  tokenizer: str
  agents: Mapping[str, AgentSpec]
  rollout: RolloutSpec
  placement: placement_lib.Placement
  checkpoint_every: int
  training: TrainingSpec = TrainingSpec()


def _checkpoint_model(field: str, folder: str, dtype: str) -> ModelConfig:
  """The ModelConfig of an HF checkpoint folder, checked before anything loads."""
  if not os.path.isfile(os.path.join(folder, 'config.json')) or not glob.glob(
      os.path.join(folder, '*.safetensors')):
    fail(field, folder, 'give a Hugging Face model folder holding config.json and '
          '*.safetensors (e.g. one written by `python -m flexmarl.export`).')
  try:
    return hf.model_config_from_hf(folder, dtype=dtype)
  except (KeyError, ValueError) as e:
    raise ConfigError(f'config.{field}={folder!r}: {e}') from None


def _agent_spec(name: str, a: ml_collections.ConfigDict, vocab_size: int) -> AgentSpec:
  f = f'agents.{name}'
  model = dict(a.model)
  checkpoint = model.pop('checkpoint', '')
  preset = model.pop('preset')
  if preset not in PRESETS:
    fail(f'{f}.model.preset', preset, f'choose one of {sorted(PRESETS)}.')
  sizes = dict(PRESETS[preset])
  sizes.update({k: v for k, v in model.items() if k != 'vocab_size'})
  model_vocab = model.get('vocab_size') or vocab_size
  if model_vocab < vocab_size:
    fail(f'{f}.model.vocab_size', model_vocab,
          f'the tokenizer has {vocab_size} tokens; use 0 (take the tokenizer size) or more.')
  sizes['vocab_size'] = model_vocab
  if checkpoint:
    model_cfg = _checkpoint_model(f'{f}.model.checkpoint', checkpoint,
                                  model.get('dtype', 'float32'))
    if model_cfg.vocab_size < vocab_size:
      fail(f'{f}.model.checkpoint', checkpoint,
            f'its vocabulary has {model_cfg.vocab_size} tokens but the tokenizer '
            f'{vocab_size}; use the checkpoint\'s own tokenizer ({f}.tokenizer, or '
            'config.tokenizer for the whole team).')
  else:
    try:
      model_cfg = ModelConfig(**sizes)
    except (TypeError, ValueError) as e:
      raise ConfigError(f'config.{f}.model: {e}') from None
  for key in ('group_size', 'global_batch', 'micro_batch'):
    whole_number(f'{f}.{key}', a[key], 1)
  if a.global_batch % a.group_size:
    fail(f'{f}.global_batch', a.global_batch,
          f'must be a multiple of group_size={a.group_size} (GRPO groups are never split).')
  if a.micro_batch % a.group_size:
    fail(f'{f}.micro_batch', a.micro_batch,
          f'must be a multiple of group_size={a.group_size} so that no micro-batch '
          'splits a GRPO group.')
  if a.global_batch % a.micro_batch:
    fail(f'{f}.micro_batch', a.micro_batch,
          f'must divide global_batch={a.global_batch}; try '
          f'{[d for d in range(a.group_size, a.global_batch + 1, a.group_size) if a.global_batch % d == 0]}.')
  mesh = tuple(a.mesh_shape)
  try:
    layout = sharding.layout(mesh, tuple(a.get('mesh_axes', ())) or None)
  except ValueError as e:
    fail(f'{f}.mesh_shape', mesh, f'{e} Set {f}.mesh_axes to name its dims.')
  s = a.sampling
  if s.temperature <= 0:
    fail(f'{f}.sampling.temperature', s.temperature, 'must be > 0.')
  if not 0 < s.top_p <= 1:
    fail(f'{f}.sampling.top_p', s.top_p, 'must be in (0, 1].')
  whole_number(f'{f}.sampling.max_new_tokens', s.max_new_tokens, 1)
  o = a.optimizer
  if o.learning_rate <= 0:
    fail(f'{f}.optimizer.learning_rate', o.learning_rate, 'must be > 0.')
  if o.max_grad_norm <= 0:
    fail(f'{f}.optimizer.max_grad_norm', o.max_grad_norm, 'must be > 0.')
  for key in ('b1', 'b2'):
    in_range(f'{f}.optimizer.{key}', o[key], 0.0, 0.999999, 'must be in [0, 1).')
  in_range(f'{f}.optimizer.weight_decay', o.weight_decay, 0.0, math.inf)
  in_range(f'{f}.optimizer.final_lr_fraction', o.final_lr_fraction, 0.0, 1.0)
  whole_number(f'{f}.optimizer.decay_steps', o.decay_steps, 0)
  g = a.grpo
  for key in ('clip_eps', 'clip_eps_low', 'clip_eps_high'):
    if g.get(key) is not None:
      in_range(f'{f}.grpo.{key}', g[key], 0.0, math.inf, 'must be >= 0 (0.2 is usual; DAPO '
                'uses clip_eps_high=0.28).')
  if g.get('clip_eps_low') is not None and g.clip_eps_low >= 1:
    fail(f'{f}.grpo.clip_eps_low', g.clip_eps_low, 'must be < 1 (the ratio stays > 0).')
  for key in ('kl_coef', 'entropy_coef'):
    in_range(f'{f}.grpo.{key}', g[key], 0.0, math.inf, 'must be >= 0.')
  whole_number(f'{f}.grpo.entropy_decay_steps', g.entropy_decay_steps, 0)
  if g.get('loss_norm', 'token') not in LOSS_NORMS:
    fail(f'{f}.grpo.loss_norm', g.loss_norm, f'choose one of {list(LOSS_NORMS)}.')
  r = a.get('rollout', ml_collections.ConfigDict(dict(instances=1)))
  instances = r.get('instances', 1)
  lo, hi = r.get('min_instances', 1), r.get('max_instances', 0) or 2**31
  if not 1 <= lo <= instances <= hi:
    fail(f'{f}.rollout', dict(instances=instances, min_instances=lo, max_instances=hi),
          'need 1 <= min_instances <= instances <= max_instances (max_instances 0: no bound).')
  return AgentSpec(
      name=name, model=model_cfg,
      sampling=section(a, 'sampling', SamplingParams, f),
      optimizer=section(a, 'optimizer', OptimizerConfig, f),
      grpo=section(a, 'grpo', GRPOConfig, f, temperature=s.temperature,
                    max_new_tokens=s.max_new_tokens),
      group_size=a.group_size, global_batch=a.global_batch, micro_batch=a.micro_batch,
      mesh_shape=layout.shape, mesh_axes=layout.axes, checkpoint=checkpoint,
      train_devices=tuple(a.get('train_devices', ())), instances=instances,
      min_instances=lo, max_instances=hi,
      instance_devices=tuple(tuple(d) for d in r.get('devices', ())))


def _rollout_spec(r: ml_collections.ConfigDict) -> RolloutSpec:
  cfg = rollout_config()
  refuse_unknown('rollout', r, cfg)
  for key, value in r.items():
    cfg[key] = value
  if cfg.backend not in BACKENDS:
    fail('rollout.backend', cfg.backend, f'choose one of {list(BACKENDS)}.')
  if cfg.backend == 'vllm':
    from flexmarl.rollout import vllm_check
    try:
      vllm_check.import_vllm()
    except vllm_check.VLLMInstallError as e:
      fail('rollout.backend', 'vllm', str(e))
    from flexmarl.rollout.vllm_sampler import engine_config
    try:
      engine_config(**cfg.vllm.to_dict())
    except (TypeError, ValueError) as e:
      raise ConfigError(f'config.rollout.vllm: {e}') from None
  if cfg.admission not in ADMISSIONS:
    fail('rollout.admission', cfg.admission, f'choose one of {list(ADMISSIONS)}.')
  for key in ('query_concurrency', 'max_step_queries', 'max_batch'):
    if cfg[key] < 1:
      fail(f'rollout.{key}', cfg[key], 'must be >= 1.')
  if cfg.balance_threshold < 1:
    fail('rollout.balance_threshold', cfg.balance_threshold,
          'must be >= 1 (a load ratio; the paper uses 5).')
  for key in ('balance_cooldown_s', 'query_timeout_s'):
    if cfg[key] < 0:
      fail(f'rollout.{key}', cfg[key], 'must be >= 0 seconds.')
  return RolloutSpec(**cfg.to_dict())


def _check_vllm_agents(agents: Mapping[str, AgentSpec], rollout: RolloutSpec,
                       max_prompt_len: int) -> None:
  """What a vLLM engine would refuse when it starts or serves, refused with the config."""
  from flexmarl.rollout import vllm_check
  from flexmarl.rollout.vllm_sampler import engine_config
  sizes = vllm_check.cpu_head_sizes()
  max_model_len = engine_config(**rollout.vllm).max_model_len
  for name, a in agents.items():
    f = f'agents.{name}'
    if sizes is not None and a.model.head_dim not in sizes:
      fail(f'{f}.model.head_dim', a.model.head_dim,
           f'vLLM on CPU serves attention head sizes {sizes}; give the model one of them '
           f'(model.head_dim, or a model.checkpoint with such heads), or use '
           'rollout.backend=embedded.')
    if a.sampling.top_p < 1:
      fail(f'{f}.sampling.top_p', a.sampling.top_p, 'the vLLM backend reports the logprobs '
           'the trainer uses only without top-p; set top_p=1.0 or use rollout.backend=embedded.')
    if max_prompt_len + a.sampling.max_new_tokens > max_model_len:
      fail('rollout.vllm.max_model_len', max_model_len,
           f'agent {name!r} needs max_prompt_len + max_new_tokens = {max_prompt_len} + '
           f'{a.sampling.max_new_tokens} tokens; raise max_model_len to at least '
           f'{max_prompt_len + a.sampling.max_new_tokens}.')


def agent_spec(config: ml_collections.ConfigDict, name: str, vocab_size: int) -> AgentSpec:
  """One agent's checked spec from a whole experiment config (e.g. a run's saved one)."""
  if name not in config.agents:
    fail('agents', sorted(config.agents), f'has no agent {name!r}; name one of these.')
  return _agent_spec(name, config.agents[name], vocab_size)


def vllm_demand(config: ml_collections.ConfigDict, vocab_size: int | Mapping[str, int]
                ) -> tuple[int, float | None]:
  """The vLLM engines a run starts and the `rollout.vllm.gpu_memory_utilization` its
  config sets (None: unset), checked; (0, None) with the embedded sampler. Needs no
  devices: `run.build` plans GPU memory from it before JAX starts."""
  rollout = _rollout_spec(config.rollout)
  if rollout.backend != 'vllm':
    return 0, None
  vocab = (vocab_size if isinstance(vocab_size, Mapping)
           else dict.fromkeys(config.agents, vocab_size))
  engines = sum(agent_spec(config, n, vocab[n]).instances for n in config.agents)
  return engines, rollout.vllm.get('gpu_memory_utilization')


def _training_spec(t: Mapping[str, Any], agents: Mapping[str, AgentSpec]
                   ) -> tuple[TrainingSpec, list[tuple[int, ...]]]:
  """The checked training pool and its listed mesh shapes; nothing is compiled."""
  cfg = training_config().to_dict()
  refuse_unknown('training', t, cfg)
  for key, value in t.items():
    cfg[key] = value
  devices = cfg['pool_devices']
  if devices < 0:
    fail('training.pool_devices', devices, 'must be >= 0 (0: every agent on its own mesh).')
  if cfg['host_budget_gb'] < 0:
    fail('training.host_budget_gb', cfg['host_budget_gb'], 'must be >= 0 (0: unlimited).')
  shapes = [tuple(s) for s in cfg['mesh_shapes']]
  if devices:
    pool_lib.check_pool(devices, {n: a.layout for n, a in agents.items()})
    budget = int(cfg['host_budget_gb'] * 1e9)
    if budget:
      pool_lib.check_host_budget(
          budget, {n: pool_lib.state_nbytes(a.model, a.optimizer, a.grpo)
                   for n, a in agents.items()}, 'training.host_budget_gb', unit=1e9)
  elif shapes or cfg['host_budget_gb']:
    fail('training.pool_devices', devices, 'mesh_shapes and host_budget_gb need a training '
          'pool: give it devices, or leave them unset.')
  return TrainingSpec(devices, int(cfg['host_budget_gb'] * 1e9), cfg['storage_dir']), shapes


def parse_schedule(value: str) -> tuple[str, int]:
  """`config.schedule` → (schedule, max staleness): 'flexmarl' → ('flexmarl', 0),
  'async:2' → ('async', 2)."""
  if value in ON_POLICY_SCHEDULES:
    return value, 0
  name, _, k = str(value).partition(':')
  if name == 'async':
    if not k.isdigit() or int(k) < 1:
      fail('schedule', value, 'write async:k with a whole number k >= 1, the most versions '
            'a trained row may lag behind the parameters it updates (async:1, async:2, ...); '
            'for staleness 0 use flexmarl.')
    return 'async', int(k)
  fail('schedule', value, f'choose one of {list(SCHEDULES)}.')


def tokenizer_paths(config: ml_collections.ConfigDict) -> dict[str, str]:
  """Each agent's tokenizer: its own `agents.NAME.tokenizer`, else the team's."""
  return {name: a.get('tokenizer') or config.tokenizer for name, a in config.agents.items()}


def build_team_spec(config: ml_collections.ConfigDict, vocab_size: int | Mapping[str, int],
                    device_ids: Sequence[int], workflow_agents: Sequence[str]) -> TeamSpec:
  """Check the whole config and place the agents on `device_ids`; raise ConfigError on
  the first bad field. `vocab_size`: the tokenizer's, or each agent's tokenizer's."""
  check_finite(config)
  schedule, max_staleness = parse_schedule(config.schedule)
  whole_number('seed', config.seed, 0)
  whole_number('steps', config.steps, 1)
  if whole_number('max_prompt_len', config.max_prompt_len, 1) < 2:
    fail('max_prompt_len', config.max_prompt_len, 'must be >= 2 (BOS and one token).')
  if not config.agents:
    fail('agents', {}, 'define at least one agent (see flexmarl.config.agent_config).')
  for name in workflow_agents:
    if name not in config.agents:
      fail('workflow', name, f'the workflow calls agent {name!r}, which config.agents does '
            f'not define (defined: {sorted(config.agents)}); add it or rename it.')
  vocab = (vocab_size if isinstance(vocab_size, Mapping)
           else dict.fromkeys(config.agents, vocab_size))
  agents = {name: _agent_spec(name, a, vocab[name]) for name, a in config.agents.items()}
  rollout = _rollout_spec(config.rollout)
  if rollout.backend == 'vllm':
    _check_vllm_agents(agents, rollout, config.max_prompt_len)
  training, mesh_shapes = _training_spec(config.get('training') or {}, agents)
  policy = config.get('placement', 'fit')
  if policy not in PLACEMENT_POLICIES:
    fail('placement', policy, "choose 'fit' (fit the team to the devices there are) or "
          "'strict' (refuse a config that needs more devices than there are).")
  placement = placement_lib.fit(
      {n: placement_lib.AgentDemand(a.mesh_shape, a.instances, a.train_devices,
                                    a.instance_devices) for n, a in agents.items()},
      rollout.devices, device_ids, training.pool_devices, mesh_shapes,
      strict=policy == 'strict',
      state_bytes=lambda: {n: pool_lib.state_nbytes(a.model, a.optimizer, a.grpo)
                           for n, a in agents.items()},
      no_pool=('agents that start from model.checkpoint cannot share a training pool yet'
               if any(a.checkpoint for a in agents.values()) else ''))
  if placement.fitted:  # the spec says what runs: the fitted fields
    rollout = dataclasses.replace(rollout, devices=placement.mode)
    training = dataclasses.replace(training, pool_devices=placement.fitted.changes.get(
        'training.pool_devices', training.pool_devices))
  whole_number('checkpoint_every', config.checkpoint_every, 1)
  return TeamSpec(seed=config.seed, steps=config.steps, schedule=schedule,
                  max_staleness=max_staleness, max_prompt_len=config.max_prompt_len,
                  tokenizer=config.tokenizer, agents=agents, rollout=rollout,
                  placement=placement, checkpoint_every=config.checkpoint_every,
                  training=training)


def check_prompt_lengths(requests: Sequence[tuple[str, str, Sequence[str]]], tokenizers,
                         max_prompt_len: int) -> None:
  """Every prompt of a dry run (agent, prompt, sample_ids) encodes, with the agent's
  tokenizer (`tokenizers`: one, or a mapping per agent), and fits `max_prompt_len`.

  Prompts that embed an earlier answer are measured with that answer empty, so they
  can be longer in the run: leave room for `max_new_tokens` there."""
  longest = (0, '', '')
  for agent, prompt, ids in requests:
    query = parse_sample_id(ids[0]).query_id if ids else '?'
    try:
      tokenizer = tokenizers[agent] if isinstance(tokenizers, Mapping) else tokenizers
      n = len(tokenizer.encode(prompt))
    except ValueError as e:
      raise ConfigError(f'query {query}, agent {agent!r}: {e}') from None
    longest = max(longest, (n, agent, prompt))
  n, agent, prompt = longest
  if n > max_prompt_len:
    fail('max_prompt_len', max_prompt_len,
          f'agent {agent!r} is asked {prompt!r}, {n} tokens with BOS; set max_prompt_len >= {n} '
          '(more if prompts embed earlier answers).')
