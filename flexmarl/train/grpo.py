"""GRPO, as pure functions.

Group-relative advantages, the clipped importance-ratio objective against the
behaviour logprobs, an optional KL penalty to a frozen reference (k3 estimator)
and an entropy bonus.

The loss is a token *sum*; the trainer divides the accumulated gradient by the
number of response tokens in the agent's whole global batch. Because the
gradient is linear in that sum, micro-batches accumulated this way give exactly
the update of the full batch, however the batch is split.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  clip_eps: float = 0.2
  kl_coef: float = 0.0  # > 0 keeps a frozen reference policy and adds k3 KL.
  entropy_coef: float = 0.0  # bonus at version 0, annealed linearly ...
  entropy_decay_steps: int = 0  # ... to 0 over this many updates (0: constant).
  normalize_std: bool = True  # divide advantages by the group's std (GRPO); off: Dr. GRPO.
  temperature: float = 1.0  # the sampling temperature the logprobs refer to.


def entropy_coef_at(cfg: GRPOConfig, version: int) -> float:
  """The entropy bonus for an agent's update number `version`.

  Early on the bonus keeps a tiny policy from collapsing onto one answer; once
  groups agree (zero advantages), Adam would turn the bonus alone into full-size
  steps toward randomness, so it is annealed away.
  """
  if not cfg.entropy_decay_steps:
    return cfg.entropy_coef
  return cfg.entropy_coef * max(0.0, 1.0 - version / cfg.entropy_decay_steps)


def group_advantages(rewards: np.ndarray, group_size: int, normalize_std: bool = True,
                     eps: float = 1e-6) -> np.ndarray:
  """(r - mean(group)) [/ (std(group) + eps)] for rewards laid out group after group."""
  r = np.asarray(rewards, np.float64).reshape(-1, group_size)
  adv = r - r.mean(axis=1, keepdims=True)
  if normalize_std:
    adv = adv / (r.std(axis=1, keepdims=True) + eps)
  return adv.reshape(-1).astype(np.float32)


def token_logprobs(logits: jax.Array, targets: jax.Array, temperature: float = 1.0
                   ) -> tuple[jax.Array, jax.Array]:
  """Logprob of each target token and the entropy of each position's distribution."""
  logp = jax.nn.log_softmax(logits / temperature, axis=-1)
  # A one-hot contraction, not a gather: its gradient is dense, where a gather's is a
  # scatter-add, which is slow on CPU.
  picked = jnp.sum(logp * jax.nn.one_hot(targets, logp.shape[-1], dtype=logp.dtype), axis=-1)
  entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
  return picked, entropy


def grpo_token_loss(logprobs: jax.Array, behaviour_logprobs: jax.Array,
                    advantages: jax.Array, entropy: jax.Array,
                    ref_logprobs: jax.Array | None, cfg: GRPOConfig,
                    entropy_coef: jax.Array | float) -> jax.Array:
  """Per-token loss [B, T] (to be masked and summed).

  advantages: [B], broadcast over a row's tokens.
  """
  ratio = jnp.exp(logprobs - behaviour_logprobs)
  adv = advantages[:, None]
  clipped = jnp.clip(ratio, 1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps)
  loss = -jnp.minimum(ratio * adv, clipped * adv) - entropy_coef * entropy
  if ref_logprobs is not None and cfg.kl_coef:
    log_r = ref_logprobs - logprobs
    loss = loss + cfg.kl_coef * (jnp.exp(log_r) - log_r - 1.0)  # k3 estimator
  return loss


def masked_sum(x: jax.Array, mask: jax.Array) -> jax.Array:
  return jnp.sum(jnp.where(mask, x, 0.0))
