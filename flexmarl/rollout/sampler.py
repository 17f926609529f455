"""Samplers: the rollout backends behind one interface.

A sampler turns a batch of prompts into sampled responses with the per-token
logprobs of the sampled tokens, serving one policy version. `submit` returns at
once with a pending result, so the rollout engine keeps every instance busy and
collects whichever finishes first. Backends: `EmbeddedSampler` (batched, jitted,
KV cache; runs anywhere JAX runs) and vLLM engines (`vllm_sampler.py`), registered
by name in `backends.py`. The rollout engine only sees the `Sampler` protocol.

Randomness: every row brings its own key, derived from (seed, agent, version,
sample_id) by the caller, so what a sample draws never depends on which other
requests share its batch or in which order they arrived. The embedded sampler
turns a row's key into one uniform per step, all before its decode loop, and draws
each token by inverting the step's CDF (`draw`): a per-step random draw over the
whole vocabulary cost a third of the loop on CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flexmarl.models import transformer
from flexmarl.models.layout import (PROMPT_WIDTH_MULTIPLE, bucket, distinct_prompts, left_pad,
                                    padded_width)
from flexmarl.rollout.spec import SamplingParams


@dataclasses.dataclass
class SampleBatch:
  """Sampler output for B rows. tokens/logprobs: [B, T] (pad after EOS);
  lengths: [B] response lengths including the EOS token when one was drawn."""

  tokens: np.ndarray
  logprobs: np.ndarray
  lengths: np.ndarray


class PendingSamples(Protocol):
  """A submitted batch (`concurrent.futures.Future` satisfies this)."""

  def done(self) -> bool:
    """Non-blocking: is the result ready?"""

  def result(self) -> SampleBatch:
    """Block until the batch is generated; the host-side result."""


class Sampler(Protocol):
  """What the rollout engine needs from a backend (one rollout instance)."""

  version: int

  def submit(self, prompts: list[list[int]], keys: np.ndarray, params: SamplingParams,
             limits: np.ndarray | None = None) -> PendingSamples:
    """Start generating; returns as soon as the work is dispatched. `limits` [B]: each
    row's own cap on new tokens (<= params.max_new_tokens; None: that cap for all)."""

  def update_weights(self, state: dict, version: int) -> None:
    """Serve `state` (the trainer's parameters, a pure dict) as `version` from now on."""

  def serve(self, model_cfg: transformer.ModelConfig, params: dict, version: int, *,
            eos_id: int | tuple[int, ...], pad_id: int, banned_ids: tuple[int, ...] = ()
            ) -> bool:
    """Serve another agent (of `model_cfg`, its `params` as `version`, its token ids)
    from this instance in place, for a balancer move; False, and nothing changed, when
    the move takes a new sampler instead."""

  def close(self) -> None:
    """Release the instance's resources."""


def sample_key(seed: int, agent: str, version: int, sample_id: str) -> np.ndarray:
  """A raw uint32[2] PRNG key that depends only on its arguments (stable hash)."""
  digest = hashlib.blake2b(f'{seed}|{agent}|{version}|{sample_id}'.encode(), digest_size=8).digest()
  return np.frombuffer(digest, dtype=np.uint32).copy()


def _filter_top_p(logits: jax.Array, top_p: jax.Array) -> jax.Array:
  """Mask the tail of each row outside the smallest set with mass >= top_p."""
  sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep = mass_before < top_p
  threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(logits >= threshold, logits, -jnp.inf)


# `draw` inverts the CDF in two levels: which block of this many tokens, then which token
# in it. One cumulative sum over a 49k-token vocabulary was half of a decode step's
# sampling on CPU (64 rows: 22 ms a step, two levels 4 ms).
CDF_BLOCK = 256


def draw(logits: jax.Array, uniform: jax.Array) -> jax.Array:
  """One token per row of `logits` [B, V] from softmax(logits), by inverting the CDF at
  `uniform` [B] (in [0, 1)): the first token whose cumulative probability exceeds it.
  A token of probability 0 (banned, filtered out) is never drawn, whatever the rounding
  of the cumulative sums."""
  batch, vocab = logits.shape
  probs = jax.nn.softmax(logits, axis=-1)
  probs = jnp.pad(probs, ((0, 0), (0, -vocab % CDF_BLOCK))).reshape(batch, -1, CDF_BLOCK)
  mass = probs.sum(-1)  # [B, blocks]
  cdf = jnp.cumsum(mass, axis=-1)
  total = cdf[:, -1:]
  u = jnp.minimum(uniform[:, None] * total, jnp.nextafter(total, 0))
  block = jnp.argmax((cdf > u) & (mass > 0), axis=-1)
  inner = jnp.take_along_axis(probs, block[:, None, None], 1)[:, 0]  # [B, CDF_BLOCK]
  start = jnp.take_along_axis(cdf - mass, block[:, None], 1)
  past = (start + jnp.cumsum(inner, axis=-1) > u) & (inner > 0)
  # Rounding may leave the block's own sum short of u: then its last possible token.
  last = CDF_BLOCK - 1 - jnp.argmax(inner[:, ::-1] > 0, axis=-1)
  return block * CDF_BLOCK + jnp.where(past.any(-1), jnp.argmax(past, axis=-1), last)


def generate_tokens(graphdef: nnx.GraphDef, state: nnx.State, prompts: jax.Array,
                    prompt_mask: jax.Array, prompt_of_row: jax.Array, keys: jax.Array,
                    temperature: jax.Array, top_p: jax.Array, limits: jax.Array,
                    adapter_rows: jax.Array | None = None,
                    prompt_adapters: jax.Array | None = None, *, max_new_tokens: int,
                    stop_ids: tuple[int, ...], pad_id: int, banned_ids: tuple[int, ...],
                    use_top_p: bool):
  """Pure sampling loop: prefill the prompts, then decode until every row has drawn a
  stop id or its limit of new tokens (`limits` [B], each <= `max_new_tokens`).

  `prompts`, `prompt_mask` [U, P]: the batch's distinct prompts (`layout.distinct_prompts`);
  row i continues prompt `prompt_of_row[i]`. Each prompt is prefilled once, however many
  rows sample it (a GRPO group's rows share theirs), and its KV cache copied to its rows.

  `adapter_rows` [B], `prompt_adapters` [U]: `state` holds several agents' LoRA
  adapters stacked (`lora.stack`) over one base, and row i (prompt u) is sampled
  (prefilled) with adapter `adapter_rows[i]` (`prompt_adapters[u]`,
  `transformer.route_adapters`); None: `state` is one model.

  `banned_ids` are never drawn (the policy is the distribution without them, as the
  trainer computes it). Returns tokens [B, T], logprobs [B, T] of the sampled tokens
  under the temperature-scaled distribution, and lengths [B].
  """
  if adapter_rows is None:
    model = prefill = nnx.merge(graphdef, state)
  else:
    model = transformer.route_adapters(nnx.merge(graphdef, state), adapter_rows)
    prefill = transformer.route_adapters(nnx.merge(graphdef, state), prompt_adapters)
  cfg = model.cfg
  greedy = temperature <= 0  # traced: greedy evaluation and sampling share one program
  batch, prompt_len = prompt_of_row.shape[0], prompts.shape[1]
  cache = transformer.init_cache(cfg, prompts.shape[0], prompt_len + max_new_tokens)
  kv_mask = jnp.pad(prompt_mask, ((0, 0), (0, max_new_tokens)))
  positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=1) - 1, 0)
  logits, cache = prefill(prompts, positions, kv_mask, cache, 0, last=1)
  if prompts.shape[0] != batch:  # else nothing is shared: prompt_of_row is 0..B-1
    of_rows = lambda x: jnp.take(x, prompt_of_row, axis=0)
    logits, kv_mask, positions = of_rows(logits), of_rows(kv_mask), of_rows(positions)
    cache = transformer.cache_rows(cache, of_rows)
  layers = model.stacked_layers()  # once, not per decoded token

  # Every row's uniforms for every step, at once (see the module docstring).
  uniforms = jax.vmap(lambda key: jax.random.uniform(key, (max_new_tokens,)))(keys)

  def step(carry):
    t, logits, cache, kv_mask, pos, done, lengths, tokens, logprobs = carry
    scaled = transformer.ban_tokens(logits, banned_ids) / jnp.where(greedy, 1.0, temperature)

    def sample() -> jax.Array:
      filtered = _filter_top_p(scaled, top_p) if use_top_p else scaled
      return draw(filtered, jax.lax.dynamic_index_in_dim(uniforms, t, 1, keepdims=False))

    # Temperature 0: the most likely token, as HF and vLLM do. A branch, not both: each is
    # a pass over the vocabulary per row.
    token = jax.lax.cond(greedy, lambda: jnp.argmax(scaled, axis=-1), sample)
    logprob = jnp.take_along_axis(jax.nn.log_softmax(scaled), token[:, None], 1)[:, 0]
    token = jnp.where(done, pad_id, token)
    tokens = tokens.at[:, t].set(token)
    logprobs = logprobs.at[:, t].set(jnp.where(done, 0.0, logprob))
    slot = prompt_len + t
    kv_mask = jax.lax.dynamic_update_slice_in_dim(kv_mask, (~done)[:, None], slot, 1)
    new_logits, cache = model(token[:, None], pos[:, None], kv_mask, cache, slot,
                              layers=layers)
    lengths = lengths + (~done)
    done = done | jnp.isin(token, jnp.array(stop_ids)) | (lengths >= limits)
    return t + 1, new_logits[:, 0], cache, kv_mask, pos + 1, done, lengths, tokens, logprobs

  def not_finished(carry):
    t, *_, done, _, _, _ = carry
    return (t < max_new_tokens) & ~jnp.all(done)

  init = (0, logits[:, 0], cache, kv_mask, positions[:, -1] + 1, jnp.zeros((batch,), bool),
          jnp.zeros((batch,), jnp.int32), jnp.full((batch, max_new_tokens), pad_id, jnp.int32),
          jnp.zeros((batch, max_new_tokens), jnp.float32))
  *_, lengths, tokens, logprobs = jax.lax.while_loop(not_finished, step, init)
  return tokens, logprobs, lengths


def compile_generate(graphdef: nnx.GraphDef) -> Callable:
  """The jitted sampling loop of one model; instances of the same model share it (and
  so its compilations)."""
  return jax.jit(functools.partial(generate_tokens, graphdef),
                 static_argnames=('max_new_tokens', 'stop_ids', 'pad_id', 'banned_ids',
                                  'use_top_p'))


@dataclasses.dataclass(eq=False)
class _DevicePending:
  """A batch dispatched to the devices: ready once its arrays are."""

  arrays: tuple[jax.Array, jax.Array, jax.Array]
  rows: int

  def done(self) -> bool:
    return all(x.is_ready() for x in self.arrays)

  def result(self) -> SampleBatch:
    tokens, logprobs, lengths = jax.device_get(self.arrays)
    return SampleBatch(tokens[:self.rows], logprobs[:self.rows], lengths[:self.rows])


class EmbeddedSampler:
  """The default backend: one jitted KV-cache sampling loop on the instance's devices.

  Batches are padded to power-of-two sizes and prompts to the longest of the batch,
  rounded up to `prompt_width_multiple` tokens (at most `max_prompt_len`), so a run
  compiles a handful of shapes once and then reuses them, and a batch of short chat
  prompts does not pay prefill for `max_prompt_len`.
  """

  def __init__(self, graphdef: nnx.GraphDef, state: dict, *, max_prompt_len: int,
               eos_id: int | tuple[int, ...], pad_id: int, banned_ids: tuple[int, ...] = (),
               batch_multiple: int = 1, version: int = 0,
               place: Callable[[dict], dict] | None = None,
               generate_fn: Callable | None = None, min_batch: int = 16, adapters: int = 0,
               prompt_width_multiple: int = PROMPT_WIDTH_MULTIPLE):
    """`eos_id`: the id (or ids) that end an answer; `banned_ids`: ids never sampled
    (the tokenizer's other special tokens). `place`: puts published weights on the
    instance's own devices (e.g. a copy of the adapters beside the device group's
    shared base); None serves them where they already are. `generate_fn`: the
    model's `compile_generate`, shared between instances. Batches are padded to at
    least `min_batch` rows: continuous batching makes every size from 1 up, and each
    distinct size costs a compilation. `adapters` > 0: `state` holds that many agents'
    LoRA adapters stacked over one base (`lora.stack`), and every batch says which
    adapter each row uses (`submit`'s `adapter_rows`)."""
    self.graphdef = graphdef
    self.place = place
    self.adapters = adapters
    self.state = self._place(state)
    self.version = version
    self.max_prompt_len, self.prompt_width_multiple = max_prompt_len, prompt_width_multiple
    self.stop_ids = (eos_id,) if isinstance(eos_id, int) else tuple(eos_id)
    self.pad_id, self.banned_ids = pad_id, tuple(banned_ids)
    self.batch_multiple, self.min_batch = batch_multiple, min_batch
    self._generate = generate_fn or compile_generate(graphdef)

  def update_weights(self, state: nnx.State, version: int) -> None:
    """Serve new weights in place. JAX arrays are immutable, so on the trainer's own
    devices no copy is needed; onto other devices it is one asynchronous transfer."""
    self.state = self._place(state)
    self.version = version

  def _place(self, state: nnx.State) -> nnx.State:
    return state if self.place is None else self.place(state)

  def serve(self, model_cfg: transformer.ModelConfig, params: dict, version: int, *,
            eos_id: int | tuple[int, ...], pad_id: int, banned_ids: tuple[int, ...] = ()
            ) -> bool:
    """False: a new sampler is cheap (the model's compiled loop is shared) and places the
    weights as the new agent's trainer does."""
    return False

  def generate(self, prompts: list[list[int]], keys: np.ndarray, params: SamplingParams,
               limits: np.ndarray | None = None,
               adapter_rows: np.ndarray | None = None) -> SampleBatch:
    """`submit` and wait: for callers outside the rollout engine."""
    return self.submit(prompts, keys, params, limits, adapter_rows).result()

  def submit(self, prompts: list[list[int]], keys: np.ndarray, params: SamplingParams,
             limits: np.ndarray | None = None,
             adapter_rows: np.ndarray | None = None) -> PendingSamples:
    """Dispatch the batch to the instance's devices; returns before it is computed.
    `adapter_rows` [B]: each row's adapter among the served ones (`adapters` > 0)."""
    n = len(prompts)
    rows = self._adapter_rows(n, adapter_rows)
    size = bucket(max(n, self.min_batch), self.batch_multiple)
    row_limits = np.full((size,), params.max_new_tokens, np.int32)
    if limits is not None:
      row_limits[:n] = np.minimum(limits, params.max_new_tokens)
    width = padded_width(list(map(len, prompts)), self.max_prompt_len,
                         self.prompt_width_multiple)
    ids, mask = left_pad(prompts + [[]] * (size - n), width, self.pad_id)
    mask[n:, -1] = True  # padding rows attend to one slot, keeping softmax finite
    shared, shared_mask, prompt_of_row = distinct_prompts(ids, mask, n, self.batch_multiple,
                                                          rows)
    prompt_adapters = None
    if rows is not None:  # a prompt's rows share its adapter (`rows` is part of the key)
      prompt_adapters = np.zeros(len(shared), np.int32)
      prompt_adapters[prompt_of_row[:n]] = rows[:n]
    all_keys = np.zeros((size, 2), np.uint32)
    all_keys[:n] = keys
    tokens, logprobs, lengths = self._generate(
        self.state, shared, shared_mask, prompt_of_row, all_keys,
        np.float32(params.temperature), np.float32(params.top_p), row_limits, rows,
        prompt_adapters,
        max_new_tokens=params.max_new_tokens,
        stop_ids=self.stop_ids, pad_id=self.pad_id, banned_ids=self.banned_ids,
        use_top_p=params.top_p < 1.0)
    return _DevicePending((tokens, logprobs, lengths), n)

  def _adapter_rows(self, n: int, given: np.ndarray | None) -> np.ndarray | None:
    """The rows' adapter indices padded to the batch's size (padding rows: adapter 0),
    checked against what this instance serves."""
    if not self.adapters:
      if given is not None:
        raise ValueError('adapter_rows given, but this instance serves one model: build it '
                         'with adapters=K over a `lora.stack` of K adapters.')
      return None
    rows = np.asarray(given if given is not None else [], np.int32)
    if rows.shape != (n,) or rows.min(initial=0) < 0 or rows.max(initial=0) >= self.adapters:
      raise ValueError(f'adapter_rows={rows.tolist()}: give one index in [0, {self.adapters}) '
                       f'per prompt ({n} prompts); this instance serves {self.adapters} '
                       'adapters.')
    size = bucket(max(n, self.min_batch), self.batch_multiple)
    return np.concatenate([rows, np.zeros(size - n, np.int32)])

  def close(self) -> None:
    self.state = None
