"""Decoder-only transformer in the Llama / Qwen2 layout, written in Flax NNX.

RMSNorm, rotary position embeddings, grouped-query attention, a SwiGLU MLP and
optionally tied embeddings: the same parameter layout as HF Llama/Qwen2, so their
checkpoints can map onto it name for name.

Every parameter carries logical axis names (`out_sharding` metadata, not sharded
eagerly); `flexmarl.models.sharding` maps them onto a `jax.sharding.Mesh`.

The forward pass is functional in its KV cache: training calls it without a cache,
the sampler passes a cache and gets the updated cache back. That keeps the hot
loops as pure `jax.jit` functions over split state (`nnx.jit` costs about 0.6 ms
per call against 0.04 ms for `jax.jit` on split state).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flexmarl.models import lora as lora_lib
from flexmarl.models.lora import LoRAConfig
# The config and its named sizes live apart (read by parts that build no model); the
# decoder's users find them here too.
from flexmarl.models.model_config import PRESETS, ModelConfig  # noqa: F401
from flexmarl.models.rope import rope, rope_frequencies

# One layer's (key, value) cache: [batch, kv_heads, cache_len, head_dim] each: the
# layout attention reads (batch and head leading), so no step copies the cache to transpose it.
# A model's cache: a list of them, one per layer; with `scan_layers`, one (key, value)
# pair stacked over the layers ([layers, batch, ...]), what the scan reads and writes.
KVCache = list[tuple[jax.Array, jax.Array]] | tuple[jax.Array, jax.Array]


class Keys:
  """The keys `rngs.params()` would give in turn, with the stream's count written back
  once (`close`), not once per key: under a trace (`jax.jit`, `nnx.eval_shape`) each
  write of an Rngs count costs time that grows with the program traced so far (flax
  checks the new value's sharding, and a tracer's answer walks the program), which made
  building a 30-layer model with adapters take 25 s instead of well under one.
  `draw_base=False`: the base's random weights are left as shapes (their keys still
  counted), for a caller that wants a LoRA model's fresh adapters alone."""

  def __init__(self, rngs: nnx.Rngs, draw_base: bool = True):
    self.stream, self.draw_base = rngs.params, draw_base
    self.key, self.start, self.drawn = self.stream.key[...], self.stream.count[...], 0

  def __call__(self) -> jax.Array:
    self.drawn += 1
    return jax.random.fold_in(self.key, self.start + (self.drawn - 1))

  def close(self) -> None:
    self.stream.count[...] = self.start + self.drawn


def _param(keys: Keys, shape: tuple[int, ...], axes: tuple[str | None, ...],
           scale: float, dtype, adapter: bool = False) -> nnx.Param:
  key = keys()
  if adapter or keys.draw_base:
    value = jax.random.normal(key, shape, dtype) * scale
  else:
    value = jax.ShapeDtypeStruct(shape, dtype)
  return nnx.Param(value, out_sharding=axes, eager_sharding=False)


class LoRA(nnx.Module):
  """One projection's adapter: A [in..., rank] random, B [rank, out...] zero, so that
  it adds nothing until it trains. Served for several agents at once: leaves stacked
  over K agents ([K, in..., rank], [K, rank, out...], `lora.stack`) and `rows` [B] set
  (`route_adapters`), row i runs through adapter rows[i]."""

  def __init__(self, keys: Keys, in_shape: tuple[int, ...], out_shape: tuple[int, ...],
               in_axes: tuple[str | None, ...], out_axes: tuple[str | None, ...],
               cfg: LoRAConfig, dtype):
    self.lora_a = _param(keys, in_shape + (cfg.rank,), in_axes + (None,),
                         float(np.prod(in_shape)) ** -0.5, dtype, adapter=True)
    self.lora_b = nnx.Param(jnp.zeros((cfg.rank,) + out_shape, dtype),
                            out_sharding=(None,) + out_axes, eager_sharding=False)
    self.scale = cfg.scale
    self.rows: jax.Array | None = None

  def __call__(self, x: jax.Array) -> jax.Array:
    a, b = self.lora_a[...], self.lora_b[...]
    if self.rows is None:
      return lora_lib.delta(x, a, b, self.scale).astype(x.dtype)
    return lora_lib.delta_stacked(x, a, b, self.scale, self.rows).astype(x.dtype)


def route_adapters(module: nnx.Module, rows: jax.Array) -> nnx.Module:
  """`module` (merged from a state whose adapters are stacked over K agents, `lora.stack`)
  with row i of every input through adapter `rows[i]` (int [B]); returns it."""
  for _, sub in nnx.iter_modules(module):
    if isinstance(sub, LoRA):
      sub.rows = rows
    elif isinstance(sub, Decoder):
      sub.adapter_rows = rows  # the scan's blocks, merged afresh per layer, are routed too
  return module


def _add_adapters(module: nnx.Module, cfg: ModelConfig, keys: Keys,
                  projections: dict[str, tuple[int, tuple[str | None, ...]]]) -> None:
  """Give `module` a `NAME_lora` adapter for each of its `projections` (name →
  (input dims, logical axes of its weight)) that `cfg.lora` targets."""
  for name, (n_in, axes) in projections.items():
    if name in cfg.lora.targets:
      shape = getattr(module, name).shape
      setattr(module, f'{name}_lora', LoRA(keys, shape[:n_in], shape[n_in:], axes[:n_in],
                                           axes[n_in:], cfg.lora, jnp.dtype(cfg.dtype)))


def _adapted(module: nnx.Module, name: str, x: jax.Array, y: jax.Array) -> jax.Array:
  """`y` = x·W of projection `name`, plus its adapter's term if it has one."""
  adapter = getattr(module, f'{name}_lora', None)
  return y if adapter is None else y + adapter(x)


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, dtype):
    self.scale = nnx.Param(jnp.ones((dim,), dtype), out_sharding=('embed',),
                           eager_sharding=False)
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    var = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
    return (x * jax.lax.rsqrt(var + self.eps)).astype(x.dtype) * self.scale[...]


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, keys: Keys):
    dt = jnp.dtype(cfg.weights_dtype)
    s = cfg.hidden ** -0.5
    self.cfg = cfg
    self.q = _param(keys, (cfg.hidden, cfg.heads, cfg.head_dim), ('embed', 'heads', None), s, dt)
    self.k = _param(keys, (cfg.hidden, cfg.kv_heads, cfg.head_dim), ('embed', 'kv_heads', None), s, dt)
    self.v = _param(keys, (cfg.hidden, cfg.kv_heads, cfg.head_dim), ('embed', 'kv_heads', None), s, dt)
    self.o = _param(keys, (cfg.heads, cfg.head_dim, cfg.hidden), ('heads', None, 'embed'),
                    (cfg.heads * cfg.head_dim) ** -0.5, dt)
    if cfg.qkv_bias:
      zeros = lambda *shape: jnp.zeros(shape, dt)
      self.q_bias = nnx.Param(zeros(cfg.heads, cfg.head_dim), out_sharding=('heads', None), eager_sharding=False)
      self.k_bias = nnx.Param(zeros(cfg.kv_heads, cfg.head_dim), out_sharding=('kv_heads', None), eager_sharding=False)
      self.v_bias = nnx.Param(zeros(cfg.kv_heads, cfg.head_dim), out_sharding=('kv_heads', None), eager_sharding=False)

  def add_adapters(self, cfg: ModelConfig, keys: Keys) -> None:
    _add_adapters(self, cfg, keys, {
        'q': (1, ('embed', 'heads', None)), 'k': (1, ('embed', 'kv_heads', None)),
        'v': (1, ('embed', 'kv_heads', None)), 'o': (2, ('heads', None, 'embed'))})

  def __call__(self, x, positions, kv_mask, cache, write_index):
    cfg = self.cfg
    q = _adapted(self, 'q', x, jnp.einsum('bld,dhk->blhk', x, self.q[...]))
    k = _adapted(self, 'k', x, jnp.einsum('bld,dhk->blhk', x, self.k[...]))
    v = _adapted(self, 'v', x, jnp.einsum('bld,dhk->blhk', x, self.v[...]))
    if cfg.qkv_bias:
      q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
    inv_freq = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    q = rope(q, positions, inv_freq)
    k = rope(k, positions, inv_freq)
    length = x.shape[1]
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, H, L, D]: the cache layout
    if cache is not None:
      ck, cv = cache
      k = jax.lax.dynamic_update_slice_in_dim(ck, k, write_index, axis=2)
      v = jax.lax.dynamic_update_slice_in_dim(cv, v, write_index, axis=2)
      cache = (k, v)
    # Query i sits at cache slot write_index + i and sees slots <= that one.
    q_slot = write_index + jnp.arange(length)
    k_slot = jnp.arange(k.shape[2])
    mask = (k_slot[None, :] <= q_slot[:, None])[None] & kv_mask[:, None, :]  # [B, L, S]
    batch, groups = x.shape[0], cfg.heads // cfg.kv_heads
    # Each KV head's queries as one [groups * L] block: plain batched matmuls over (B, H).
    q = q.reshape(batch, length, cfg.kv_heads, groups, cfg.head_dim).transpose(0, 2, 3, 1, 4)
    q = q.reshape(batch, cfg.kv_heads, groups * length, cfg.head_dim)
    scores = jnp.einsum('bhqk,bhsk->bhqs', q, k).astype(jnp.float32) * cfg.head_dim ** -0.5
    scores = scores.reshape(batch, cfg.kv_heads, groups, length, -1)
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    probs = probs.reshape(batch, cfg.kv_heads, groups * length, -1)
    out = jnp.einsum('bhqs,bhsk->bhqk', probs, v).reshape(
        batch, cfg.kv_heads, groups, length, cfg.head_dim)
    out = out.transpose(0, 3, 1, 2, 4).reshape(batch, length, cfg.heads, cfg.head_dim)
    return _adapted(self, 'o', out, jnp.einsum('blhk,hkd->bld', out, self.o[...])), cache


class MLP(nnx.Module):

  def __init__(self, cfg: ModelConfig, keys: Keys):
    dt = jnp.dtype(cfg.weights_dtype)
    self.gate = _param(keys, (cfg.hidden, cfg.mlp), ('embed', 'mlp'), cfg.hidden ** -0.5, dt)
    self.up = _param(keys, (cfg.hidden, cfg.mlp), ('embed', 'mlp'), cfg.hidden ** -0.5, dt)
    self.down = _param(keys, (cfg.mlp, cfg.hidden), ('mlp', 'embed'), cfg.mlp ** -0.5, dt)

  def add_adapters(self, cfg: ModelConfig, keys: Keys) -> None:
    _add_adapters(self, cfg, keys, {'gate': (1, ('embed', 'mlp')), 'up': (1, ('embed', 'mlp')),
                                    'down': (1, ('mlp', 'embed'))})

  def __call__(self, x):
    gate = _adapted(self, 'gate', x, x @ self.gate[...])
    h = jax.nn.silu(gate) * _adapted(self, 'up', x, x @ self.up[...])
    return _adapted(self, 'down', h, h @ self.down[...])


class Block(nnx.Module):

  def __init__(self, cfg: ModelConfig, keys: Keys):
    dt = jnp.dtype(cfg.weights_dtype)
    self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps, dt)
    self.attn = Attention(cfg, keys)
    self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps, dt)
    self.mlp = MLP(cfg, keys)

  def __call__(self, x, positions, kv_mask, cache, write_index):
    h, cache = self.attn(self.attn_norm(x), positions, kv_mask, cache, write_index)
    x = x + h
    return x + self.mlp(self.mlp_norm(x)), cache


class Decoder(nnx.Module):
  """The policy: token ids in, next-token logits out."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs | Keys):
    dt = jnp.dtype(cfg.weights_dtype)
    keys = rngs if isinstance(rngs, Keys) else Keys(rngs)
    self.cfg = cfg
    self.adapter_rows: jax.Array | None = None  # see `route_adapters`
    # Small embeddings keep the initial policy near uniform (tied logits = x·E).
    self.embed = _param(keys, (cfg.vocab_size, cfg.hidden), ('vocab', 'embed'),
                        cfg.hidden ** -0.5, dt)
    self.blocks = nnx.List([Block(cfg, keys) for _ in range(cfg.layers)])
    self.norm = RMSNorm(cfg.hidden, cfg.norm_eps, dt)
    if not cfg.tie_embeddings:
      self.lm_head = _param(keys, (cfg.hidden, cfg.vocab_size), ('embed', 'vocab'),
                            cfg.hidden ** -0.5, dt)
    # Adapters draw their keys after every base weight: a seed gives the same base
    # with or without them.
    if cfg.lora.rank:
      for block in self.blocks:
        block.attn.add_adapters(cfg, keys)
        block.mlp.add_adapters(cfg, keys)
    keys.close()

  def stacked_layers(self) -> nnx.State | None:
    """The blocks' parameters stacked on a leading layer axis, what the scan runs over
    (None unless `cfg.scan_layers`). It copies the blocks' weights: a caller that runs
    the model several times in one program (the sampler's decode loop, a micro-batch's
    two passes) takes it once and passes it as `layers`."""
    if not self.cfg.scan_layers:
      return None
    return jax.tree.map(lambda *xs: jnp.stack(xs), *(nnx.state(b) for b in self.blocks))

  def __call__(self, tokens: jax.Array, positions: jax.Array, kv_mask: jax.Array,
               cache: KVCache | None = None, write_index: jax.Array | int = 0,
               last: int | None = None, layers: nnx.State | None = None
               ) -> tuple[jax.Array, KVCache | None]:
    """tokens, positions: [B, L]; kv_mask: [B, S] marks real (non-pad) key slots,
    S = L without a cache, the cache length with one. Returns fp32 logits [B, L, V],
    or only those of the `last` positions (the LM head is costly; callers often need
    a few). `layers`: `stacked_layers()`, taken once by the caller (scan_layers only)."""
    x = self.embed[...][tokens].astype(self.cfg.dtype)  # a bf16 base computes in dtype
    if self.cfg.scan_layers:
      block = nnx.graphdef(self.blocks[0])

      def layer(x, params_and_cache):
        params, layer_cache = params_and_cache
        layer_block = nnx.merge(block, params)
        if self.adapter_rows is not None:
          route_adapters(layer_block, self.adapter_rows)
        return layer_block(x, positions, kv_mask, layer_cache, write_index)

      if self.cfg.remat:  # keep each layer's input; recompute its insides for the backward
        layer = jax.checkpoint(layer)
      stacked = self.stacked_layers() if layers is None else layers
      x, new_cache = jax.lax.scan(layer, x, (stacked, cache))
    else:
      new_cache = [] if cache is not None else None
      for i, block in enumerate(self.blocks):
        x, layer_cache = block(x, positions, kv_mask, None if cache is None else cache[i],
                               write_index)
        if cache is not None:
          new_cache.append(layer_cache)
    x = self.norm(x if last is None else x[:, -last:])
    head = self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]
    return (x @ head).astype(jnp.float32), new_cache


def fresh_adapters(cfg: ModelConfig, seed: int) -> dict:
  """The adapters `Decoder(cfg, Rngs(params=seed))` starts with (a pure dict). The base's
  random weights are never drawn (`Keys(draw_base=False)`), and it runs eagerly: jitted,
  a 30-layer model's ~200 random draws took 15 s to compile."""
  model = Decoder(cfg, Keys(nnx.Rngs(params=seed), draw_base=False))
  return lora_lib.partition(nnx.to_pure_dict(nnx.state(model)), cfg.lora)[0]


def abstract_model(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
  """The decoder's graphdef and its state as shapes only (nothing allocated). Kept per
  config: a 30-layer model's shapes take ~0.7 s to build and a run asks a dozen times;
  each caller gets a State of its own to fill."""
  graphdef, state = _abstract_model(cfg)
  return graphdef, jax.tree.map(lambda x: x, state)


@functools.lru_cache(maxsize=16)
def _abstract_model(cfg: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
  return nnx.split(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))


def init_cache(cfg: ModelConfig, batch: int, length: int) -> KVCache:
  shape = (batch, cfg.kv_heads, length, cfg.head_dim)
  dt = jnp.dtype(cfg.dtype)
  if cfg.scan_layers:
    return (jnp.zeros((cfg.layers,) + shape, dt), jnp.zeros((cfg.layers,) + shape, dt))
  return [(jnp.zeros(shape, dt), jnp.zeros(shape, dt)) for _ in range(cfg.layers)]


def cache_rows(cache: KVCache, rows: Callable[[jax.Array], jax.Array]) -> KVCache:
  """`rows` (a function of a [B, ...] array, e.g. copying a shared prompt's entries to
  the rows that continue it) applied to every layer's keys and values."""
  if isinstance(cache, list):
    return [(rows(k), rows(v)) for k, v in cache]
  return tuple(jax.vmap(rows)(x) for x in cache)


def count_params(state: nnx.State) -> int:
  return sum(x.size for x in jax.tree.leaves(state))


# Far below any real logit but finite: a banned token's probability is exactly 0 in
# float32, and the entropy's p·log p stays 0 instead of NaN.
BANNED_LOGIT = -1e9


def ban_tokens(logits: jax.Array, ids: tuple[int, ...]) -> jax.Array:
  """`logits` [..., V] with the tokens `ids` made impossible. The sampler and the
  trainer both apply it, so the policy they sample and train is one distribution."""
  if not ids:
    return logits
  return logits.at[..., jnp.array(ids)].set(BANNED_LOGIT)
