"""LoRA adapters: the config of an agent's adapters and the pure functions over them.

A LoRA agent's projection W (ours: input dims first, output dims last) computes
x·W + scale·(x·A)·B, with A [in..., rank] and B [rank, out...] its adapter, B zero at
the start (so the first forward is the base model's) and scale = alpha / rank. Only
the adapter leaves (`lora_a`, `lora_b`) train; the base leaves stay frozen.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from flexmarl.spec.validate import fail, refuse_unknown

# Projections an adapter may target, with their HF (and PEFT) module names.
TARGETS = {'q': 'self_attn.q_proj', 'k': 'self_attn.k_proj', 'v': 'self_attn.v_proj',
           'o': 'self_attn.o_proj', 'gate': 'mlp.gate_proj', 'up': 'mlp.up_proj',
           'down': 'mlp.down_proj'}
ADAPTER_LEAVES = ('lora_a', 'lora_b')


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
  """An agent's adapters (config `agents.NAME.model.lora`); rank 0: none, the full
  model trains."""

  rank: int = 0
  alpha: float = 32.0
  targets: tuple[str, ...] = tuple(TARGETS)

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  @classmethod
  def from_config(cls, field: str, values: Mapping[str, Any] | None) -> LoRAConfig:
    """The checked config of section `field` (unknown fields, a negative rank, a
    non-positive alpha and unknown or repeated targets refused)."""
    given = dict(values or {})
    refuse_unknown(field, given, [f.name for f in dataclasses.fields(cls)])
    cfg = cls(**given)
    rank, alpha = cfg.rank, cfg.alpha
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or rank < 0:
      fail(f'{field}.rank', rank, 'give a whole number >= 0 (0: no adapter, the full '
            'model trains; 8 to 64 are usual).')
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not alpha > 0:
      fail(f'{field}.alpha', alpha, 'give a number > 0 (the adapter scale is alpha / rank; '
            'alpha = 2 * rank is usual).')
    targets = (cfg.targets,) if isinstance(cfg.targets, str) else tuple(cfg.targets)
    bad = [t for t in targets if t not in TARGETS]
    if bad or not targets or len(set(targets)) != len(targets):
      fail(f'{field}.targets', cfg.targets, f'give distinct projections among '
            f'{list(TARGETS)} (unknown: {bad}).')
    return cls(int(rank), float(alpha), targets)


def delta(x: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
  """scale·(x·A)·B, contracting x's last dims with A's input dims."""
  low = jnp.tensordot(x, a, axes=a.ndim - 1)
  return scale * jnp.tensordot(low, b, axes=1)


def delta_stacked(x: jax.Array, a: jax.Array, b: jax.Array, scale: float,
                  rows: jax.Array) -> jax.Array:
  """`delta` with row i of x [B, ..., in...] through adapter `rows[i]` of the stacked
  a [K, in..., rank], b [K, rank, out...] (`stack`). Every row runs all K adapters' A
  (K·rank columns: a few percent of the base's work) and keeps its own. A copy of the
  adapters per row, the other way, is for 64 rows of a 30-layer model a gigabyte to
  write and then read at every decoded token (with the sampler's two-level `draw`, a
  batch of three agents' rows now takes 0.69× the time: experiments/benchmarks/RESULTS.md)."""
  rank, n_in, count = b.shape[1], a.ndim - 2, a.shape[0]
  xs = x.reshape(x.shape[:x.ndim - n_in] + (-1,))
  low = jnp.einsum('b...i,kir->b...kr', xs, a.reshape(count, -1, rank))
  pick = jax.nn.one_hot(rows, count, dtype=low.dtype)
  low = low * pick.reshape(pick.shape[:1] + (1,) * (low.ndim - 3) + (count, 1))
  out = jnp.einsum('b...kr,kro->b...o', low, b.reshape(count, rank, -1))
  return scale * out.reshape(out.shape[:-1] + b.shape[2:])


def stack(adapters: list[dict]) -> dict:
  """K agents' adapters (trees alike) as one tree, each leaf [K, ...]: what one
  rollout instance serves for K agents of one base."""
  return jax.tree.map(lambda *xs: jnp.stack(xs), *adapters)


def is_adapter(path: tuple) -> bool:
  return bool(path) and path[-1] in ADAPTER_LEAVES


def partition(params: dict, lora: LoRAConfig) -> tuple[dict, dict]:
  """(trainable, frozen) of a pure-dict params tree: with adapters, the adapter leaves
  and the rest; without, everything and {}."""
  if not lora.rank:
    return params, {}
  return _select(params, (), True), _select(params, (), False)


def _select(tree: dict, path: tuple, adapters: bool) -> dict:
  out = {}
  for key, value in tree.items():
    if isinstance(value, Mapping):
      sub = _select(value, path + (key,), adapters)
      if sub:
        out[key] = sub
    elif is_adapter(path + (key,)) == adapters:
      out[key] = value
  return out


def combine(trainable: dict, frozen: dict) -> dict:
  """The params tree of `partition`'s two halves."""
  out = dict(frozen)
  for key, value in trainable.items():
    out[key] = combine(value, out[key]) if isinstance(value, Mapping) and key in out else value
  return out


def merged(params: dict, lora: LoRAConfig) -> dict:
  """The params of the base model that computes what base + adapters compute: each
  target W + scale·A·B (as a nested dict without adapter leaves)."""
  if not lora.rank:
    return params
  out = {}
  for key, value in params.items():
    if not isinstance(value, Mapping):
      out[key] = value
      continue
    sub = merged(value, lora)
    for target in lora.targets:
      adapter = sub.pop(f'{target}_lora', None)
      if adapter is not None:
        a, b = adapter['lora_a'], adapter['lora_b']
        sub[target] = sub[target] + lora.scale * jnp.tensordot(a, b, axes=1).astype(a.dtype)
    out[key] = sub
  return out
