"""The default config sections that experiment files start from, each documenting its
fields: `agent_config`, `rollout_config`, `training_config`, and `part_of_run` for
schedule lengths that follow `config.steps`. (`flexmarl.config` checks them.)"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ml_collections

from flexmarl.validate import refuse_unknown


def rollout_config(**overrides: Any) -> ml_collections.ConfigDict:
  """Default rollout config; experiment files start from it and override fields.

  - backend: 'embedded' (the JAX sampler) or 'vllm' (a vLLM engine per instance, weights
    synced in place after every update; needs the vllm extra, requirements-vllm.txt),
    with engine arguments in `vllm` (dtype, max_model_len, gpu_memory_utilization,
    kv_cache_bytes, enforce_eager, max_num_seqs, max_restarts).
  - devices: 'separate' gives every rollout instance devices of its own (the paper's
    separate rollout and training pools: generation never queues behind gradient
    work); 'shared' runs an agent's instances on its training devices. On too few
    devices for 'separate', placement may fit the team with 'shared' instead (see
    `config.placement` in flexmarl.placement.fit).
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
    (or storage) in between. With 0 and too few devices for a mesh per agent,
    placement may fit a pool over every device (`config.placement`: 'fit', the
    default; 'strict' refuses instead).
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
      # The agent's own tokenizer ('char', an HF folder or tokenizer.json); '' takes the
      # team's config.tokenizer. Agents from checkpoints of different model families
      # each name their checkpoint's.
      tokenizer='',
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
      refuse_unknown(key, value, cfg[key])
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
