"""Rotary position embeddings, with HF's 'linear' and 'llama3' frequency scaling."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

ROPE_SCALING_TYPES = ('default', 'linear', 'llama3')


def rope_frequencies(head_dim: int, theta: float,
                     scaling: tuple[tuple[str, Any], ...] = ()) -> jax.Array:
  """Inverse frequencies [head_dim / 2], with HF's 'linear' or 'llama3' scaling."""
  half = head_dim // 2
  inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
  s = dict(scaling)
  kind = s.get('rope_type', s.get('type', 'default'))
  if kind == 'default':
    return inv_freq
  if kind == 'linear':
    return inv_freq / s['factor']
  if kind == 'llama3':
    factor, low, high = s['factor'], s['low_freq_factor'], s['high_freq_factor']
    old_len = s['original_max_position_embeddings']
    wavelen = 2 * jnp.pi / inv_freq
    scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return jnp.where(medium, smoothed, scaled)
  raise ValueError(f'model.rope_scaling type {kind!r} is not supported; supported: '
                   f'{list(ROPE_SCALING_TYPES)}.')


def rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """Rotary embedding, HF 'rotate_half' convention. x: [B, L, H, D]."""
  half = x.shape[-1] // 2
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, L, half]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)
