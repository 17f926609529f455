"""One agent's spec (`AgentSpec`, config `agents.NAME`): its model, sampling, optimizer
and GRPO loss, batch sizes, training mesh and rollout instances. The configured fields
and their defaults are written once, on the dataclasses (here and in the parts' spec
modules); `agent_config` generates the config section from them, and
`AgentSpec.from_config` checks it before anything compiles."""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Hashable, Mapping
from typing import Any

import ml_collections

from flexmarl.core.errors import CheckpointFileError, ConfigError
from flexmarl.models import hf, peft, sharding, source
from flexmarl.models.lora import LoRAConfig
from flexmarl.models.transformer import PRESETS, ModelConfig
from flexmarl.rollout.spec import SamplingParams
from flexmarl.train import shared_base
from flexmarl.train.spec import GRPOConfig, OptimizerConfig
from flexmarl.spec.validate import (DERIVED, config_of, fail, read_section, refuse_unknown,
                               whole_number)

# The model fields besides a preset's sizes that the model section lists (so that a
# command-line flag can set them), with ModelConfig's defaults. Any other ModelConfig
# field may be given too; it overrides the preset's.
MODEL_OPTIONS = ('qkv_bias', 'tie_embeddings', 'dtype', 'base_dtype', 'scan_layers', 'remat')
NO_BOUND = 2**31  # max_instances of an agent whose rollout section sets 0


def model_config(preset: str = 'tiny') -> ml_collections.ConfigDict:
  """The model section: a preset's sizes (vocab_size 0: the tokenizer's), or with
  `checkpoint` an HF Llama/Qwen2 folder or a GGUF file, which gives the architecture
  (only dtype, base_dtype, scan_layers and remat apply from here) and the weights.
  `scan_layers` runs the layers as one scan: compiles in seconds whatever the depth.
  `remat` recomputes each layer's insides in the backward (gradient checkpointing):
  a train step holds one layer's activations, not all, for one more forward pass.
  `base_dtype` (LoRA agents): the frozen base's weights in another dtype than the
  adapters and the compute (`dtype`), e.g. bfloat16 under float32. `lora` (rank > 0)
  makes the agent adapters on that model, which stays frozen: LoRA agents of the same
  base (the same checkpoint, or the same `base_seed`) share one copy of it per device
  group. `base_seed` (no checkpoint): the seed of the random initialisation (-1: the
  agent's own); `adapter`: a PEFT adapter folder the agent's adapters start from."""
  options = {f.name: f.default for f in dataclasses.fields(ModelConfig)
             if f.name in MODEL_OPTIONS}
  return ml_collections.ConfigDict(dict(preset=preset, vocab_size=0, checkpoint='',
                                        base_seed=-1, adapter='',
                                        lora=config_of(LoRAConfig), **options))


@dataclasses.dataclass(frozen=True)
class AgentRollout:
  """An agent's rollout instances (config `agents.NAME.rollout`): how many at start, the
  balancer's bounds, and optionally explicit device ids, one tuple per instance."""

  instances: int = 1
  min_instances: int = 1  # the balancer never takes the agent below this ...
  max_instances: int = 0  # ... nor above this (0: no bound)
  devices: tuple[tuple[int, ...], ...] = ()

  @classmethod
  def from_config(cls, field: str, values: Mapping[str, Any] | None) -> AgentRollout:
    r = read_section(cls, field, values)
    hi = r.max_instances or NO_BOUND
    if not 1 <= r.min_instances <= r.instances <= hi:
      fail(field, dict(instances=r.instances, min_instances=r.min_instances, max_instances=hi),
           'need 1 <= min_instances <= instances <= max_instances (max_instances 0: no bound).')
    return dataclasses.replace(r, max_instances=hi, devices=tuple(tuple(d) for d in r.devices))


@dataclasses.dataclass(frozen=True)
class AgentSpec:
  """The checked spec of one agent. The fields with defaults are configured as they are
  (see `agent_config`); the others are read from the model and rollout sections."""

  name: str
  model: ModelConfig
  checkpoint: str  # HF folder the policy starts from ('' : random initialisation)
  base_seed: int  # seed of the random initialisation (-1: the agent's own)
  adapter: str  # PEFT folder a LoRA agent's adapters start from ('': fresh adapters)
  instances: int  # rollout instances at start
  min_instances: int  # the balancer never takes the agent below this
  max_instances: int  # ... nor above this
  instance_devices: tuple[tuple[int, ...], ...]  # explicit, one tuple per instance, or ()
  # The agent's own tokenizer ('char', an HF folder or tokenizer.json); '' takes the one
  # its model.checkpoint carries (GGUF, or a folder with tokenizer.json), else the team's
  # config.tokenizer: agents of different model families each speak through their own.
  tokenizer: str = ''
  group_size: int = 8
  global_batch: int = 64  # rows (samples) per optimizer step
  micro_batch: int = 16  # rows per gradient accumulation
  mesh_shape: tuple[int, ...] = (1, 1)
  mesh_axes: tuple[str, ...] = ()  # e.g. ('fsdp',) or ('fsdp', 'tensor'); (): ('data', 'model')
  train_devices: tuple[int, ...] = ()  # explicit jax device ids of the training mesh, or ()
  sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
  optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
  grpo: GRPOConfig = dataclasses.field(default_factory=GRPOConfig)
  # The agent's own seed (its adapters', or its full model's initialisation): derived once,
  # from the team's seed and the agent's place in config.agents (`shared_base.agent_seed`).
  seed: int = dataclasses.field(default=0, metadata=DERIVED)

  @property
  def layout(self) -> sharding.MeshLayout:
    return sharding.MeshLayout(self.mesh_shape, self.mesh_axes)

  @property
  def random_base_seed(self) -> int:
    """The seed of the agent's random base: `model.base_seed`, or (-1) its own."""
    return self.seed if self.base_seed < 0 else self.base_seed

  @property
  def base_key(self) -> Hashable:
    """What the agent's base shares with other agents' (`shared_base.base_key`)."""
    return shared_base.base_key(self.model, self.checkpoint, self.random_base_seed)

  @classmethod
  def from_config(cls, name: str, a: ml_collections.ConfigDict, vocab_size: int,
                  seed: int = 0) -> AgentSpec:
    """The checked spec of `config.agents[name]`; `vocab_size`: its tokenizer's; `seed`:
    the agent's own (`shared_base.agent_seed`)."""
    f = f'agents.{name}'
    given = a.to_dict() if isinstance(a, ml_collections.ConfigDict) else dict(a)
    defaults = agent_config().to_dict()
    refuse_unknown(f, given, defaults)
    a = ml_collections.ConfigDict({**defaults, **given})
    section = {**defaults['model'], **given.get('model', {})}
    base_seed, adapter = section.pop('base_seed'), section.pop('adapter')
    model, checkpoint = _model(f, section, vocab_size)
    _check_base(f'{f}.model', model, checkpoint, base_seed, adapter)
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
      sizes = range(a.group_size, a.global_batch + 1, a.group_size)
      fail(f'{f}.micro_batch', a.micro_batch, f'must divide global_batch={a.global_batch}; '
           f'try {[d for d in sizes if a.global_batch % d == 0]}.')
    mesh = tuple(a.mesh_shape)
    try:
      layout = sharding.layout(mesh, tuple(a.mesh_axes) or None)
    except ValueError as e:
      fail(f'{f}.mesh_shape', mesh, f'{e} Set {f}.mesh_axes to name its dims.')
    sampling = SamplingParams.from_config(f'{f}.sampling', a.sampling)
    rollout = AgentRollout.from_config(f'{f}.rollout', a.rollout)
    return cls(
        name=name, model=model, checkpoint=checkpoint, base_seed=int(base_seed),
        adapter=adapter, instances=rollout.instances,
        min_instances=rollout.min_instances, max_instances=rollout.max_instances,
        instance_devices=rollout.devices, tokenizer=a.tokenizer, group_size=a.group_size,
        global_batch=a.global_batch, micro_batch=a.micro_batch, mesh_shape=layout.shape,
        mesh_axes=layout.axes, train_devices=tuple(a.train_devices), sampling=sampling,
        optimizer=OptimizerConfig.from_config(f'{f}.optimizer', a.optimizer),
        grpo=GRPOConfig.from_config(f'{f}.grpo', a.grpo, sampling.temperature,
                                    sampling.max_new_tokens), seed=seed)


def agent_config(preset: str = 'tiny', **overrides: Any) -> ml_collections.ConfigDict:
  """Default per-agent config (the configured fields of `AgentSpec`, the model section
  of `model_config` and the rollout section of `AgentRollout`); experiment files start
  from it and override fields.

  A dict override updates that section field by field (`grpo=dict(kl_coef=0.1)` keeps
  the other GRPO fields). `grpo.clip_eps_low` / `clip_eps_high` are `clip_eps` unless set.
  """
  cfg = config_of(AgentSpec, model=model_config(preset), rollout=config_of(AgentRollout))
  for key, value in overrides.items():
    if isinstance(value, Mapping) and isinstance(cfg.get(key), ml_collections.ConfigDict):
      refuse_unknown(key, value, cfg[key])
      for field, v in value.items():
        cfg[key][field] = v
    else:
      cfg[key] = value
  return cfg


def _checkpoint_model(field: str, folder: str, dtype: str) -> ModelConfig:
  """The ModelConfig of an HF checkpoint folder, a GGUF file or a hub model (fetched
  here, where it is missing: models/source.py), checked before anything loads."""
  try:
    local = source.local(folder) if source.kind(folder) == source.HUB else folder
    if source.kind(folder) != source.GGUF and (
        not os.path.isfile(os.path.join(local, 'config.json'))
        or not glob.glob(os.path.join(local, '*.safetensors'))):
      fail(field, folder, 'give a Hugging Face model folder holding config.json and '
           '*.safetensors (e.g. one written by `python -m flexmarl.export`), a hub id '
           'ORG/NAME, a .gguf file, or package:NAME for the GGUF file an installed package '
           'ships.')
    return hf.model_config_from_hf(folder, dtype=dtype)
  except CheckpointFileError as e:  # it names the file; the message names the field
    raise ConfigError(f'config.{field}={folder!r}: {e.problem}') from None
  except (KeyError, ValueError) as e:
    raise ConfigError(f'config.{field}={folder!r}: {e}') from None


def _check_base(field: str, model: ModelConfig, checkpoint: str, base_seed: Any,
                adapter: str) -> None:
  """`base_seed` a whole number >= -1, and only without a checkpoint; `adapter` a PEFT
  folder whose rank, alpha and targets are the agent's `lora`."""
  whole_number(f'{field}.base_seed', base_seed, -1)
  if checkpoint and base_seed != -1:
    fail(f'{field}.base_seed', base_seed, f'the checkpoint {checkpoint!r} is the base; '
         'leave base_seed at -1 (it seeds a random base, for agents without a checkpoint).')
  if not adapter:
    return
  if not model.lora.rank:
    fail(f'{field}.adapter', adapter, f'set {field}.lora (rank > 0) to the adapter\'s '
         'rank, alpha and targets: only a LoRA agent starts from an adapter.')
  try:
    found = peft.peft_lora_config(adapter)
  except (FileNotFoundError, KeyError, ValueError) as e:
    raise ConfigError(f'config.{field}.adapter={adapter!r}: {e}') from None
  if (found.rank, found.alpha, set(found.targets)) != (
      model.lora.rank, model.lora.alpha, set(model.lora.targets)):
    fail(f'{field}.lora', dataclasses.asdict(model.lora),
         f'the adapter {adapter!r} has {dataclasses.asdict(found)}; set these.')


def _model(agent: str, section: Mapping[str, Any], vocab_size: int) -> tuple[ModelConfig, str]:
  """(the checked ModelConfig, the checkpoint folder or '') of agent field `agent`'s
  model section."""
  field = f'{agent}.model'
  model = dict(section)
  checkpoint = model.pop('checkpoint')
  preset = model.pop('preset')
  adapters = LoRAConfig.from_config(f'{field}.lora', model.pop('lora'))
  if preset not in PRESETS:
    fail(f'{field}.preset', preset, f'choose one of {sorted(PRESETS)}.')
  model_vocab = model.pop('vocab_size') or vocab_size
  if model_vocab < vocab_size:
    fail(f'{field}.vocab_size', model_vocab,
         f'the tokenizer has {vocab_size} tokens; use 0 (take the tokenizer size) or more.')
  if checkpoint:
    model_cfg = _checkpoint_model(f'{field}.checkpoint', checkpoint, model['dtype'])
    if model_cfg.vocab_size < vocab_size:
      fail(f'{field}.checkpoint', checkpoint,
           f'its vocabulary has {model_cfg.vocab_size} tokens but the tokenizer '
           f'{vocab_size}; use the checkpoint\'s own tokenizer ({agent}.tokenizer, or '
           'config.tokenizer for the whole team).')
    try:
      return dataclasses.replace(model_cfg, lora=adapters, scan_layers=model['scan_layers'],
                                 remat=model['remat'], base_dtype=model['base_dtype']
                                 ), checkpoint
    except ValueError as e:
      raise ConfigError(f'config.{field}: {e}') from None
  try:
    return ModelConfig(**{**PRESETS[preset], **model, 'vocab_size': model_vocab,
                          'lora': adapters}), ''
  except (TypeError, ValueError) as e:
    raise ConfigError(f'config.{field}: {e}') from None
