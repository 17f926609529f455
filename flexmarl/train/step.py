"""Compiled train steps, one set per (model, optimizer, algorithm, mesh layout).

The steps' shardings are PartitionSpecs, not shardings on particular devices: the same
jitted functions run on any mesh of their layout (called inside `jax.set_mesh(mesh)`),
so agents of one model shape share them and an agent bound to another mesh of its
shape does not retrace. (XLA binds an executable to its devices: a new device set
costs a compile of the already-traced step, once.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec as P

from flexmarl.models import sharding

# loss(params, ref_params, batch, entropy_coef) -> (token-summed loss, summed stats)
LossFn = Callable[..., tuple[jax.Array, dict]]
# params -> (trainable, frozen) and back: only the trainable part has gradients and
# optimizer state (a LoRA agent's adapters; a full agent's everything, frozen {}).
Partition = Callable[[Any], tuple[Any, Any]]
Combine = Callable[[Any, Any], Any]


def train_everything(params) -> tuple[Any, dict]:
  return params, {}


def as_is(trainable, frozen):
  del frozen  # empty
  return trainable


def _is_spec(x) -> bool:
  return isinstance(x, P)


def opt_specs(tx: optax.GradientTransformation, abstract_params, specs):
  """The optimizer state's specs: moments like their parameters, scalars replicated."""
  abstract = jax.eval_shape(tx.init, abstract_params)
  return optax.tree_utils.tree_map_params(
      tx, lambda _, spec: spec, abstract, specs, transform_non_params=lambda _: P(),
      is_leaf=_is_spec)


@dataclasses.dataclass(frozen=True)
class Steps:
  """The accumulate / zeros / apply steps of one layout (see AgentTrainer for their use)."""

  layout: sharding.MeshLayout
  param_specs: Any
  opt_specs: Any  # of the optimizer state over the trainable params
  accumulate: Callable  # (params, ref_params, batch, acc, entropy_coef) -> (acc, stats)
  zeros: Callable  # params -> zero gradient accumulator (of the trainable params)
  # (trainable, opt_state, acc, tokens) -> (trainable, opt_state, grad_norm)
  apply: Callable
  partition: Partition
  combine: Combine

  def update(self, params, opt_state, acc, tokens):
    """One optimizer step of `params` -> (params, opt_state, grad_norm). The frozen
    part is not touched: the new params hold the very same arrays."""
    trainable, frozen = self.partition(params)
    trainable, opt_state, norm = self.apply(trainable, opt_state, acc, tokens)
    return self.combine(trainable, frozen), opt_state, norm

  def shardings(self, mesh: Mesh) -> dict:
    """Where a state's arrays live on `mesh`: {'params': ..., 'opt_state': ...}."""
    if sharding.layout_of(mesh) != self.layout:
      raise ValueError(f'mesh {sharding.layout_of(mesh)} does not have the layout {self.layout} '
                       'these steps were compiled for; bind to a mesh of that shape and axes.')
    return {'params': sharding.on_mesh(self.param_specs, mesh),
            'opt_state': sharding.on_mesh(self.opt_specs, mesh)}


def build_steps(loss: LossFn, tx: optax.GradientTransformation, abstract_params, param_specs,
                layout: sharding.MeshLayout, has_ref: bool,
                partition: Partition = train_everything, combine: Combine = as_is) -> Steps:
  """Jit the three steps over `layout`'s specs (mesh-free: call under jax.set_mesh).
  Gradients and the optimizer cover `partition`'s trainable part only."""
  train_specs = partition(param_specs)[0]
  o_specs = opt_specs(tx, partition(abstract_params)[0], train_specs)
  batch = sharding.batch_spec(layout.abstract())
  ref = param_specs if has_ref else None

  def accumulate(params, ref_params, batch, acc, entropy_coef):
    trainable, frozen = partition(params)
    (value, stats), grads = jax.value_and_grad(
        lambda t: loss(combine(t, frozen), ref_params, batch, entropy_coef), has_aux=True)(
            trainable)
    return jax.tree.map(jnp.add, acc, grads), dict(stats, loss=value)

  def apply(trainable, opt_state, acc, tokens):
    grads = jax.tree.map(lambda g: g / tokens, acc)
    updates, opt_state = tx.update(grads, opt_state, trainable)
    return optax.apply_updates(trainable, updates), opt_state, optax.tree.norm(grads)

  return Steps(
      layout=layout, param_specs=param_specs, opt_specs=o_specs,
      accumulate=jax.jit(accumulate, in_shardings=(param_specs, ref, batch, train_specs, None),
                         out_shardings=(train_specs, None), donate_argnums=3),
      zeros=jax.jit(lambda p: jax.tree.map(jnp.zeros_like, partition(p)[0]),
                    out_shardings=train_specs),
      apply=jax.jit(apply, in_shardings=(train_specs, o_specs, train_specs, None),
                    out_shardings=(train_specs, o_specs, None),
                    donate_argnums=(1, 2)),  # not params: a sampler may still be serving them
      partition=partition, combine=combine)


class StepCache:
  """Steps by key; one cache per team, handed to every AgentTrainer."""

  def __init__(self):
    self._steps: dict[Hashable, Steps] = {}

  def get(self, key: Hashable, build: Callable[[], Steps]) -> Steps:
    if key not in self._steps:
      self._steps[key] = build()
    return self._steps[key]

  def __len__(self) -> int:
    return len(self._steps)
