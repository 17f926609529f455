"""An agent's training state sized from shapes alone, and the checks that must pass
before anything compiles: a mesh larger than the training pool, a host budget smaller
than one agent's state. Nothing is allocated or compiled (`jax.eval_shape`), except by
`train_step_scratch`, which compiles one gradient to ask XLA what it holds."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import numpy as np
from flax import nnx

from flexmarl.core.errors import ConfigError
from flexmarl.models import lora, sharding, transformer
from flexmarl.train.batch import TrainBatch
from flexmarl.train.loss import loss_sum
from flexmarl.train.optimizer import make_optimizer
from flexmarl.train.spec import GRPOConfig, OptimizerConfig


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
  return nnx.to_pure_dict(transformer.abstract_model(model_cfg)[1])


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


def train_step_scratch(model_cfg: transformer.ModelConfig, grpo_cfg: GRPOConfig, rows: int,
                       prompt_len: int, response_len: int) -> int:
  """Bytes of scratch one micro-batch's gradient needs on one device: what the forward
  keeps for the backward (every layer's insides; with `model.remat` each layer's input)
  and the gradients in flight, beside the state and base the memory report counts. The
  longest case: `rows` rows, no two sharing a prompt, every prompt `prompt_len` tokens
  and every response `response_len`. XLA's own figure: the trainer's loss is lowered
  over shapes and compiled (seconds; a minute for a 0.5B model on a CPU), never run.
  A mesh that splits the batch holds its share of this on each device."""
  graphdef, state = transformer.abstract_model(model_cfg)
  trainable, frozen = lora.partition(nnx.to_pure_dict(state), model_cfg.lora)
  prompts = [[1] * prompt_len for _ in range(rows)]
  batch = TrainBatch.from_rows(
      prompts, [np.ones(response_len, np.int32)] * rows,
      [np.zeros(response_len, np.float32)] * rows, np.ones(rows, np.float32),
      prompt_len=prompt_len, response_len=response_len, pad_id=0,
      prompt_width_multiple=1)
  ref = lora.combine(trainable, frozen) if grpo_cfg.kl_coef else None

  def gradient(t, f, r, b):
    return jax.grad(lambda t: loss_sum(lora.combine(t, f), r, b, 0.0, graphdef=graphdef,
                                       cfg=grpo_cfg)[0])(t)
  compiled = jax.jit(gradient).lower(trainable, frozen, ref, dataclasses.asdict(batch)).compile()
  return int(compiled.memory_analysis().temp_size_in_bytes)


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
