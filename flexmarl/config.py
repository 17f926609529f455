"""Experiment config → checked, typed team spec.

Experiments are ml_collections ConfigDicts (`experiments/*.py: get_config()`).
`build_team_spec` checks every field before anything is compiled or written and
raises `ConfigError` naming the field, the bad value and the fix.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

from flexmarl.models import hf
from flexmarl.models.transformer import PRESETS, ModelConfig
from flexmarl.rollout.sampler import SamplingParams
from flexmarl.train.grpo import GRPOConfig
from flexmarl.train.trainer import OptimizerConfig

ON_POLICY_SCHEDULES = ('sync', 'sync_parallel', 'flexmarl')  # staleness 0, same parameters
SCHEDULES = (*ON_POLICY_SCHEDULES, 'async:k')
# Where each agent's rollout instance runs: on its training mesh, or on devices of its
# own (the paper's separate rollout and training pools: generation never queues behind
# the agent's own gradient work).
ROLLOUT_DEVICES = ('shared', 'separate')


class ConfigError(ValueError):
  """A config field is wrong; the message names the field, the value and the fix."""


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
  mesh_shape: tuple[int, int]  # (data, model)
  checkpoint: str = ''  # HF folder the policy starts from ('' : random initialisation)


@dataclasses.dataclass(frozen=True)
class TeamSpec:
  seed: int
  steps: int
  schedule: str  # 'sync' | 'sync_parallel' | 'flexmarl' | 'async'
  max_staleness: int  # k of `async:k`; 0 (exactly on-policy) for the other schedules
  max_prompt_len: int
  tokenizer: str
  agents: Mapping[str, AgentSpec]
  queries_per_wave: int
  max_waves: int
  separate_rollout_devices: bool
  checkpoint_every: int


def agent_config(preset: str = 'tiny', **overrides: Any) -> ml_collections.ConfigDict:
  """Default per-agent config; experiment files start from it and override fields."""
  cfg = ml_collections.ConfigDict(dict(
      # checkpoint: an HF Llama/Qwen2 folder; when set, the architecture comes from its
      # config.json (only dtype applies from here) and the weights from its safetensors.
      model=dict(preset=preset, vocab_size=0, qkv_bias=True, tie_embeddings=True,
                 dtype='float32', checkpoint=''),
      group_size=8,
      global_batch=64,
      micro_batch=16,
      mesh_shape=(1, 1),
      sampling=dict(temperature=1.0, top_p=1.0, max_new_tokens=4),
      optimizer=dict(learning_rate=3e-3, b1=0.9, b2=0.99, weight_decay=0.0, max_grad_norm=1.0,
                     decay_steps=0, final_lr_fraction=0.1),
      grpo=dict(clip_eps=0.2, kl_coef=0.0, entropy_coef=0.0, entropy_decay_steps=0,
                normalize_std=True),
  ))
  for key, value in overrides.items():
    cfg[key] = value
  return cfg


def _fail(field: str, value: Any, fix: str) -> None:
  raise ConfigError(f'config.{field}={value!r}: {fix}')


def _checkpoint_model(field: str, folder: str, dtype: str) -> ModelConfig:
  """The ModelConfig of an HF checkpoint folder, checked before anything loads."""
  if not os.path.isfile(os.path.join(folder, 'config.json')) or not glob.glob(
      os.path.join(folder, '*.safetensors')):
    _fail(field, folder, 'give a Hugging Face model folder holding config.json and '
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
    _fail(f'{f}.model.preset', preset, f'choose one of {sorted(PRESETS)}.')
  sizes = dict(PRESETS[preset])
  sizes.update({k: v for k, v in model.items() if k != 'vocab_size'})
  model_vocab = model.get('vocab_size') or vocab_size
  if model_vocab < vocab_size:
    _fail(f'{f}.model.vocab_size', model_vocab,
          f'the tokenizer has {vocab_size} tokens; use 0 (take the tokenizer size) or more.')
  sizes['vocab_size'] = model_vocab
  if checkpoint:
    model_cfg = _checkpoint_model(f'{f}.model.checkpoint', checkpoint,
                                  model.get('dtype', 'float32'))
    if model_cfg.vocab_size < vocab_size:
      _fail(f'{f}.model.checkpoint', checkpoint,
            f'its vocabulary has {model_cfg.vocab_size} tokens but the tokenizer '
            f'{vocab_size}; use the checkpoint\'s own tokenizer (config.tokenizer).')
  else:
    try:
      model_cfg = ModelConfig(**sizes)
    except (TypeError, ValueError) as e:
      raise ConfigError(f'config.{f}.model: {e}') from None
  for key in ('group_size', 'global_batch', 'micro_batch'):
    if a[key] < 1:
      _fail(f'{f}.{key}', a[key], 'must be a positive number of samples.')
  if a.global_batch % a.group_size:
    _fail(f'{f}.global_batch', a.global_batch,
          f'must be a multiple of group_size={a.group_size} (GRPO groups are never split).')
  if a.micro_batch % a.group_size:
    _fail(f'{f}.micro_batch', a.micro_batch,
          f'must be a multiple of group_size={a.group_size} so that no micro-batch '
          'splits a GRPO group.')
  if a.global_batch % a.micro_batch:
    _fail(f'{f}.micro_batch', a.micro_batch,
          f'must divide global_batch={a.global_batch}; try '
          f'{[d for d in range(a.group_size, a.global_batch + 1, a.group_size) if a.global_batch % d == 0]}.')
  mesh = tuple(a.mesh_shape)
  if len(mesh) != 2 or min(mesh) < 1:
    _fail(f'{f}.mesh_shape', mesh, 'give (data, model), each >= 1 device.')
  s = a.sampling
  if s.temperature <= 0:
    _fail(f'{f}.sampling.temperature', s.temperature, 'must be > 0.')
  if not 0 < s.top_p <= 1:
    _fail(f'{f}.sampling.top_p', s.top_p, 'must be in (0, 1].')
  if s.max_new_tokens < 1:
    _fail(f'{f}.sampling.max_new_tokens', s.max_new_tokens, 'must be >= 1.')
  if a.optimizer.learning_rate <= 0:
    _fail(f'{f}.optimizer.learning_rate', a.optimizer.learning_rate, 'must be > 0.')
  return AgentSpec(
      name=name, model=model_cfg,
      sampling=SamplingParams(**s.to_dict()),
      optimizer=OptimizerConfig(**a.optimizer.to_dict()),
      grpo=GRPOConfig(temperature=s.temperature, **a.grpo.to_dict()),
      group_size=a.group_size, global_batch=a.global_batch, micro_batch=a.micro_batch,
      mesh_shape=mesh, checkpoint=checkpoint)


def agent_spec(config: ml_collections.ConfigDict, name: str, vocab_size: int) -> AgentSpec:
  """One agent's checked spec from a whole experiment config (e.g. a run's saved one)."""
  if name not in config.agents:
    _fail('agents', sorted(config.agents), f'has no agent {name!r}; name one of these.')
  return _agent_spec(name, config.agents[name], vocab_size)


def parse_schedule(value: str) -> tuple[str, int]:
  """`config.schedule` → (schedule, max staleness): 'flexmarl' → ('flexmarl', 0),
  'async:2' → ('async', 2)."""
  if value in ON_POLICY_SCHEDULES:
    return value, 0
  name, _, k = str(value).partition(':')
  if name == 'async':
    if not k.isdigit() or int(k) < 1:
      _fail('schedule', value, 'write async:k with a whole number k >= 1, the most versions '
            'a trained row may lag behind the parameters it updates (async:1, async:2, ...); '
            'for staleness 0 use flexmarl.')
    return 'async', int(k)
  _fail('schedule', value, f'choose one of {list(SCHEDULES)}.')


def build_team_spec(config: ml_collections.ConfigDict, vocab_size: int, num_devices: int,
                    workflow_agents: Sequence[str]) -> TeamSpec:
  """Check the whole config; raise ConfigError on the first bad field."""
  schedule, max_staleness = parse_schedule(config.schedule)
  if config.steps < 1:
    _fail('steps', config.steps, 'must be >= 1.')
  if config.max_prompt_len < 2:
    _fail('max_prompt_len', config.max_prompt_len, 'must be >= 2 (BOS and one token).')
  if not config.agents:
    _fail('agents', {}, 'define at least one agent (see flexmarl.config.agent_config).')
  for name in workflow_agents:
    if name not in config.agents:
      _fail('workflow', name, f'the workflow calls agent {name!r}, which config.agents does '
            f'not define (defined: {sorted(config.agents)}); add it or rename it.')
  agents = {name: _agent_spec(name, a, vocab_size) for name, a in config.agents.items()}
  r = config.rollout
  if r.queries_per_wave < 1:
    _fail('rollout.queries_per_wave', r.queries_per_wave, 'must be >= 1.')
  if r.max_waves < 1:
    _fail('rollout.max_waves', r.max_waves, 'must be >= 1.')
  rollout_devices = r.get('devices', 'shared')
  if rollout_devices not in ROLLOUT_DEVICES:
    _fail('rollout.devices', rollout_devices, f'choose one of {list(ROLLOUT_DEVICES)}.')
  separate = rollout_devices == 'separate'
  needed = sum(s.mesh_shape[0] * s.mesh_shape[1] for s in agents.values()) * (1 + separate)
  if needed > num_devices:
    _fail('agents.*.mesh_shape', {n: s.mesh_shape for n, s in agents.items()},
          f'the meshes need {needed} devices'
          f'{" (training and rollout.devices=separate)" if separate else ""} but '
          f'{num_devices} are available; shrink the meshes'
          f'{", or set rollout.devices=shared" if separate else ""} (on CPU, set '
          'XLA_FLAGS=--xla_force_host_platform_device_count=N first).')
  if config.checkpoint_every < 1:
    _fail('checkpoint_every', config.checkpoint_every, 'must be >= 1 (steps).')
  return TeamSpec(seed=config.seed, steps=config.steps, schedule=schedule,
                  max_staleness=max_staleness,
                  max_prompt_len=config.max_prompt_len, tokenizer=config.tokenizer,
                  agents=agents, queries_per_wave=r.queries_per_wave, max_waves=r.max_waves,
                  separate_rollout_devices=separate,
                  checkpoint_every=config.checkpoint_every)
