"""The GRPO loss of one micro-batch over the model: the policy's logprobs of the
response tokens, then `train.grpo`'s pure per-token math, summed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from flexmarl.models import transformer
from flexmarl.train import grpo


def response_logits(model: transformer.Decoder, batch: dict) -> jax.Array:
  """The fp32 logits [B, T, V] that predict each row's response tokens.

  Rows that share a prompt (a GRPO group) share its forward pass: the batch's distinct
  prompts (`shared_prompts`) run once, filling a KV cache that every row of the prompt
  reads, as the sampler's prefill does; then the rows' responses run against it. The
  gradient through the shared prompt is the sum over its rows, as if each row had run
  it: the same numbers as the whole rows would give, for a fraction of the work."""
  prompts, prompt_mask = batch['shared_prompts'], batch['shared_prompt_mask']
  responses = batch['responses']
  prompt_len, response_len = prompts.shape[1], responses.shape[1]
  cache = transformer.init_cache(model.cfg, prompts.shape[0], prompt_len + response_len - 1)
  kv_mask = jnp.pad(prompt_mask, ((0, 0), (0, response_len - 1)))
  positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=1) - 1, 0)
  layers = model.stacked_layers()  # once for both passes
  # The last prompt position predicts the first response token.
  first, cache = model(prompts, positions, kv_mask, cache, 0, last=1, layers=layers)
  if prompts.shape[0] != responses.shape[0]:  # else nothing is shared: row i is prompt i
    pick = jax.nn.one_hot(batch['prompt_of_row'], prompts.shape[0], dtype=first.dtype)
    # A one-hot contraction, not a gather: its gradient is a dot, not a scatter-add.
    of_rows = lambda x: jnp.einsum('bu,u...->b...', pick.astype(x.dtype), x)
    first, cache = of_rows(first), transformer.cache_rows(cache, of_rows)
  if response_len == 1:
    return first
  row_mask = batch['prompt_mask']
  kv_mask = jnp.concatenate([row_mask, batch['response_mask'][:, :-1]], 1)
  positions = jnp.sum(row_mask, axis=1, keepdims=True) + jnp.arange(response_len - 1)
  rest, _ = model(responses[:, :-1], positions, kv_mask, cache, prompt_len, layers=layers)
  return jnp.concatenate([first, rest], 1)


def response_logprobs(graphdef, params, batch: dict, temperature: float,
                      banned_ids: tuple[int, ...] = ()):
  """Logprobs and entropies of the response tokens under `params`: [B, T] each, in the
  distribution the sampler draws from (`banned_ids` impossible)."""
  logits = response_logits(nnx.merge(graphdef, params), batch)
  return grpo.token_logprobs(transformer.ban_tokens(logits, banned_ids), batch['responses'],
                             temperature)


def loss_sum(params, ref_params, batch: dict, entropy_coef, *, graphdef, cfg: grpo.GRPOConfig,
             banned_ids: tuple[int, ...] = ()):
  """Token-summed GRPO loss of one micro-batch, plus summed diagnostics."""
  mask = batch['response_mask']
  logp, entropy = response_logprobs(graphdef, params, batch, cfg.temperature, banned_ids)
  ref_logp = None
  if ref_params is not None:
    ref_logp, _ = response_logprobs(graphdef, ref_params, batch, cfg.temperature, banned_ids)
    ref_logp = jax.lax.stop_gradient(ref_logp)
  # NaN: a row the sampler did not serve (a replayed right answer, train.replay), read
  # as the trainer's own logprobs.
  sampler = jnp.where(jnp.isnan(batch['behaviour_logprobs']), jax.lax.stop_gradient(logp),
                      batch['behaviour_logprobs'])
  behaviour = jnp.where(batch['on_policy'][:, None], jax.lax.stop_gradient(logp), sampler)
  bonus = entropy_coef * batch['entropy_weight'][:, None]  # [B, 1]
  tis = grpo.tis_weights(logp, sampler, cfg.tis_cap) if cfg.tis_cap else None
  per_token = grpo.grpo_token_loss(logp, behaviour, batch['advantages'], entropy, ref_logp,
                                   cfg, bonus, tis)
  served = jnp.exp(logp - sampler)  # against what the sampler saw
  # Trainer against sampler on the sampled tokens (on-policy rows: the same parameters,
  # so only numerics differ; stale rows of async:k add their versions' difference).
  delta, kl = grpo.mismatch_terms(logp, sampler)
  stats = {
      'logprob_mismatch': grpo.masked_sum(delta, mask),
      'mismatch_kl': grpo.masked_sum(kl, mask),
      'entropy': grpo.masked_sum(entropy, mask),
      'clipped': grpo.masked_sum(grpo.clipped_fraction_terms(jnp.exp(logp - behaviour), cfg),
                                 mask),
      'ratio_dev': grpo.masked_sum(jnp.abs(served - 1.0), mask),
      'entropy_bonus': grpo.masked_sum(jnp.broadcast_to(bonus, mask.shape), mask),
  }
  return grpo.masked_sum(per_token, mask), stats
