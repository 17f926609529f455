"""The rollout tier's specs: how an agent samples (`SamplingParams`), how the tier
serves queries (`RolloutSpec`, config section `rollout`) and a vLLM engine's arguments
(`VLLMEngineConfig`, `rollout.vllm`). Each field and its default are written once,
here; each spec checks its own fields. Imports nothing heavy: the config reads it
before anything compiles."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import ml_collections

from flexmarl.rollout.context import OVERFLOW_POLICIES
from flexmarl.spec.validate import (config_of, fail, in_range, number, one_of, read_section,
                                    whole_number)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """An agent's sampling (config `agents.NAME.sampling`)."""

  temperature: float = 1.0
  top_p: float = 1.0
  max_new_tokens: int = 4

  @classmethod
  def from_config(cls, field: str, values: Mapping[str, Any] | None) -> SamplingParams:
    s = read_section(cls, field, values)
    if not number(f'{field}.temperature', s.temperature) > 0:
      fail(f'{field}.temperature', s.temperature, 'must be > 0.')
    if not 0 < number(f'{field}.top_p', s.top_p) <= 1:
      fail(f'{field}.top_p', s.top_p, 'must be in (0, 1].')
    whole_number(f'{field}.max_new_tokens', s.max_new_tokens, 1)
    return s


@dataclasses.dataclass(frozen=True)
class VLLMEngineConfig:
  """Engine arguments (config: `rollout.vllm.*`)."""

  dtype: str = 'float32'
  max_model_len: int = 512
  gpu_memory_utilization: float = 0.5
  # 0: vLLM's default (GPU: the memory fraction; CPU: VLLM_CPU_KVCACHE_SPACE)
  kv_cache_bytes: int = 0
  enforce_eager: bool = True
  max_num_seqs: int = 256
  # Prompt tokens one engine step may prefill; 0: 2048 (vLLM's default). Raised to
  # max_model_len and max_num_seqs if below: prompts are never split across steps
  # (see vllm_engine.scheduler_args).
  max_num_batched_tokens: int = 0
  max_restarts: int = 2  # per batch, after which its Future carries the error
  # Torch threads of an engine on CPU; 0: every core this process may use (see
  # vllm_engine.cpu_threads for when fewer pay).
  cpu_threads: int = 0


def engine_config(**kwargs: Any) -> VLLMEngineConfig:
  """A VLLMEngineConfig from config fields, with the field named on a typo."""
  names = {f.name for f in dataclasses.fields(VLLMEngineConfig)}
  unknown = sorted(set(kwargs) - names)
  if unknown:
    raise ValueError(f'config.rollout.vllm has unknown fields {unknown}; known: {sorted(names)}.')
  threads = kwargs.get('cpu_threads', 0)
  if not isinstance(threads, int) or isinstance(threads, bool) or threads < 0:
    raise ValueError(f'config.rollout.vllm.cpu_threads={threads!r}: give a whole number >= 0 '
                     '(0: every core this process may use).')
  return VLLMEngineConfig(**kwargs)


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
  """How the rollout tier serves queries (config section `rollout`).

  - backend: a name in the registry of rollout backends (flexmarl.rollout.backends, which
    checks it and what it needs with the rest of the config): 'embedded' (the JAX
    sampler) or 'vllm' (a vLLM engine per instance, weights synced in place after every
    update; needs the vllm extra, requirements-vllm.txt), with engine arguments in `vllm`
    (see VLLMEngineConfig; only the fields given).
  - devices: 'separate' gives every rollout instance devices of its own (the paper's
    separate rollout and training pools: generation never queues behind gradient
    work); 'shared' runs an agent's instances on its training devices. On too few
    devices for 'separate', placement may fit the team with 'shared' instead (see
    `config.placement` in flexmarl.placement.fit.fit).
  - query_concurrency: the queries in flight at once; a finished query's slot is
    refilled at once.
  - max_step_queries: the most queries one step may consume (a step ends earlier, as
    soon as every agent's batch is full).
  - max_batch: rows per generate call of one instance; requests that arrive while it
    is busy join its next batch.
  - balance: move idle instances from cold agents to hot ones when their load per
    instance differs by more than `balance_threshold`× (the paper's Δ = 5), at most
    once per `balance_cooldown_s`. Under vLLM only between agents of one architecture
    (a move is then one weight sync into the running engine).
  - sticky_conversations: keep a query's turns on one instance (for prefix caches).
  - query_timeout_s: a query running longer is an error naming it (0: no limit).
  - context_overflow: a prompt longer than `max_prompt_len` (a conversation grown over
    its turns) is 'refuse'd, naming the query, agent and turn, or has its oldest turns
    dropped ('drop_oldest', chat messages only; rollout/context.py). Never cut silently.
  - adapter_groups: groups of LoRA agents of one base whose adapters share rollout
    instances, e.g. (('router', 'math', 'code'),): each instance of the group's first
    agent holds the base once and every agent's adapter, and samples each row with its
    own agent's adapter and version. The agents of a group have the same model (and
    lora), base, mesh shape, sampling and rollout.instances; they keep their instances
    (the balancer moves none of them). One process only (not under Ray); under vLLM
    each instance is one engine of the base with every agent's adapter loaded.
  """

  backend: str = 'embedded'
  devices: str = 'shared'
  query_concurrency: int = 8
  max_step_queries: int = 256
  max_batch: int = 256
  balance: bool = True
  balance_threshold: float = 5.0
  balance_cooldown_s: float = 0.5
  sticky_conversations: bool = False
  query_timeout_s: float = 0.0
  context_overflow: str = 'refuse'
  adapter_groups: tuple[tuple[str, ...], ...] = ()
  vllm: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  @classmethod
  def from_config(cls, values: Mapping[str, Any] | None, field: str = 'rollout'
                  ) -> RolloutSpec:
    """The checked spec, but for `backend` and what it needs (`rollout.vllm`): the
    config checks those against the backend registry."""
    r = read_section(cls, field, values)
    for key in ('query_concurrency', 'max_step_queries', 'max_batch'):
      whole_number(f'{field}.{key}', getattr(r, key), 1)
    in_range(f'{field}.balance_threshold', r.balance_threshold, 1, float('inf'),
             'must be >= 1 (a load ratio; the paper uses 5).')
    for key in ('balance_cooldown_s', 'query_timeout_s'):
      in_range(f'{field}.{key}', getattr(r, key), 0, float('inf'), 'must be >= 0 seconds.')
    one_of(f'{field}.context_overflow', r.context_overflow, OVERFLOW_POLICIES)
    groups = r.adapter_groups
    if not isinstance(groups, (list, tuple)) or not all(
        isinstance(g, (list, tuple)) and all(isinstance(n, str) for n in g) for g in groups):
      fail(f'{field}.adapter_groups', groups, "give a list of groups of agent names, e.g. "
           "[['router', 'math', 'code']].")
    groups = tuple(tuple(g) for g in groups)
    return dataclasses.replace(r, adapter_groups=groups)


def rollout_config(**overrides: Any) -> ml_collections.ConfigDict:
  """Default rollout config (the fields of `RolloutSpec`); experiment files start from
  it and override fields."""
  return config_of(RolloutSpec, **overrides)
