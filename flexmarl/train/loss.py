"""The GRPO loss of one micro-batch over the model: the policy's logprobs of the
response tokens, then `train.grpo`'s pure per-token math, summed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from flexmarl.models import transformer
from flexmarl.train import grpo


def response_logprobs(graphdef, params, batch: dict, temperature: float,
                      banned_ids: tuple[int, ...] = ()):
  """Logprobs and entropies of the response tokens under `params`: [B, T] each, in the
  distribution the sampler draws from (`banned_ids` impossible)."""
  model = nnx.merge(graphdef, params)
  response_len = batch['responses'].shape[1]
  tokens = jnp.concatenate([batch['prompts'], batch['responses']], 1)
  valid = jnp.concatenate([batch['prompt_mask'], batch['response_mask']], 1)
  positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
  # The logits that predict the response: from the last prompt position on.
  logits, _ = model(tokens, positions, valid, last=response_len + 1)
  resp_logits = transformer.ban_tokens(logits[:, :-1], banned_ids)
  return grpo.token_logprobs(resp_logits, batch['responses'], temperature)


def loss_sum(params, ref_params, batch: dict, entropy_coef, *, graphdef, cfg: grpo.GRPOConfig,
             banned_ids: tuple[int, ...] = ()):
  """Token-summed GRPO loss of one micro-batch, plus summed diagnostics."""
  mask = batch['response_mask']
  logp, entropy = response_logprobs(graphdef, params, batch, cfg.temperature, banned_ids)
  ref_logp = None
  if ref_params is not None:
    ref_logp, _ = response_logprobs(graphdef, ref_params, batch, cfg.temperature, banned_ids)
    ref_logp = jax.lax.stop_gradient(ref_logp)
  behaviour = jnp.where(batch['on_policy'][:, None], jax.lax.stop_gradient(logp),
                        batch['behaviour_logprobs'])
  bonus = entropy_coef * batch['entropy_weight'][:, None]  # [B, 1]
  per_token = grpo.grpo_token_loss(logp, behaviour, batch['advantages'], entropy, ref_logp,
                                   cfg, bonus)
  served = jnp.exp(logp - batch['behaviour_logprobs'])  # against what the sampler saw
  stats = {
      'entropy': grpo.masked_sum(entropy, mask),
      'clipped': grpo.masked_sum(grpo.clipped_fraction_terms(jnp.exp(logp - behaviour), cfg),
                                 mask),
      'ratio_dev': grpo.masked_sum(jnp.abs(served - 1.0), mask),
      'entropy_bonus': grpo.masked_sum(jnp.broadcast_to(bonus, mask.shape), mask),
  }
  return grpo.masked_sum(per_token, mask), stats
