"""Embedded sampler: cached decoding equals a full forward pass; exact logprobs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
import pytest

from flexmarl.models import transformer
from flexmarl.models.layout import left_pad
from flexmarl.rollout.sampler import (CDF_BLOCK, EmbeddedSampler, SamplingParams, draw,
                                      sample_key)
from flexmarl.train.batch import TrainBatch
from flexmarl.train.loss import response_logprobs

VOCAB, PAD, EOS = 24, 0, 2
P = 6


def _setup():
  model = transformer.Decoder(transformer.ModelConfig(vocab_size=VOCAB), nnx.Rngs(params=1))
  graphdef, state = nnx.split(model)
  params = nnx.to_pure_dict(state)
  sampler = EmbeddedSampler(graphdef, params, max_prompt_len=P, eos_id=EOS, pad_id=PAD)
  return model, graphdef, params, sampler


PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 3, 4, 5, 6, 8]]


def _keys(n, salt=''):
  return np.stack([sample_key(0, 'a', 0, f'{salt}{i}') for i in range(n)])


def test_cached_decode_logits_equal_full_forward():
  model, *_ = _setup()
  cfg = model.cfg
  ids, mask = left_pad(PROMPTS, P, PAD)
  total = P + 3
  cache = transformer.init_cache(cfg, len(PROMPTS), total)
  kv_mask = np.concatenate([mask, np.zeros((len(PROMPTS), 3), bool)], 1)
  pos = np.maximum(np.cumsum(mask, 1) - 1, 0)
  logits, cache = model(jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(kv_mask), cache, 0)
  seq, seq_mask = ids, mask
  for t, tok in enumerate([11, 12, 13]):
    step_tokens = np.full((len(PROMPTS), 1), tok, np.int32)
    kv_mask[:, P + t] = True
    step_pos = pos[:, -1:] + 1 + t
    step_logits, cache = model(jnp.asarray(step_tokens), jnp.asarray(step_pos),
                               jnp.asarray(kv_mask), cache, P + t)
    seq = np.concatenate([seq, step_tokens], 1)
    seq_mask = np.concatenate([seq_mask, np.ones((len(PROMPTS), 1), bool)], 1)
    full_pos = np.maximum(np.cumsum(seq_mask, 1) - 1, 0)
    full, _ = model(jnp.asarray(seq), jnp.asarray(full_pos), jnp.asarray(seq_mask))
    np.testing.assert_allclose(step_logits[:, 0], full[:, -1], atol=1e-4, rtol=1e-4)


@pytest.mark.quick
def test_sampler_logprobs_equal_model_log_softmax():
  _, graphdef, params, sampler = _setup()
  sp = SamplingParams(temperature=0.7, top_p=1.0, max_new_tokens=5)
  out = sampler.generate(PROMPTS, _keys(3), sp)
  batch = TrainBatch.from_rows(PROMPTS, [out.tokens[i, :out.lengths[i]] for i in range(3)],
                               [out.logprobs[i, :out.lengths[i]] for i in range(3)],
                               np.zeros(3), prompt_len=P, response_len=5, pad_id=PAD)
  logp, _ = response_logprobs(graphdef, params, dataclasses.asdict(batch), 0.7)
  for i in range(3):
    n = out.lengths[i]
    np.testing.assert_allclose(out.logprobs[i, :n], np.asarray(logp)[i, :n], atol=1e-5)


def test_eos_stops_and_pads():
  _, _, _, sampler = _setup()
  out = sampler.generate(PROMPTS * 20, _keys(60), SamplingParams(1.0, 1.0, 6))
  for tokens, n in zip(out.tokens, out.lengths):
    eos = np.flatnonzero(tokens == EOS)
    if eos.size:
      assert n == eos[0] + 1
      assert (tokens[n:] == PAD).all()
    else:
      assert n == 6
  assert (out.tokens == EOS).any(), 'with 60 samples of 6 tokens some should end'


def test_samples_do_not_depend_on_batch_companions():
  _, _, _, sampler = _setup()
  sp = SamplingParams(1.0, 1.0, 5)
  alone = sampler.generate(PROMPTS[:1], _keys(1), sp)
  crowd = sampler.generate(PROMPTS + PROMPTS[:1] * 5, np.concatenate([_keys(1), _keys(7, 'x')]), sp)
  np.testing.assert_array_equal(alone.tokens[0], crowd.tokens[0])
  np.testing.assert_allclose(alone.logprobs[0], crowd.logprobs[0], atol=1e-6)


def _spread(probs: np.ndarray, at: list[int], vocab: int) -> np.ndarray:
  """`probs` placed at token ids `at` of a vocabulary of `vocab`, 0 elsewhere."""
  out = np.zeros(vocab, np.float32)
  out[at] = probs
  return out


@pytest.mark.parametrize('probs', [
    np.array([0.1, 0.0, 0.6, 0.0, 0.3, 0.0], np.float32),  # the last one: banned
    # over several of draw's CDF blocks: at a block's last and next block's first token,
    # in the last, partial block, and none in a block between
    _spread(np.array([0.1, 0.2, 0.3, 0.4], np.float32),
            [CDF_BLOCK - 1, CDF_BLOCK, 3 * CDF_BLOCK + 5, 3 * CDF_BLOCK + 20],
            3 * CDF_BLOCK + 40)])
def test_draws_follow_the_distribution_and_never_an_impossible_token(probs):
  logits = np.where(probs > 0, np.log(np.maximum(probs, 1e-30)), transformer.BANNED_LOGIT)
  n = 200_000
  uniform = jax.random.uniform(jax.random.key(0), (n,))
  # The edges of [0, 1) too, where a rounded cumulative sum could pick a token of mass 0.
  uniform = uniform.at[:2].set(jnp.array([0.0, np.nextafter(np.float32(1), 0)]))
  tokens = np.asarray(draw(jnp.tile(jnp.asarray(logits, jnp.float32), (n, 1)), uniform))
  counts = np.bincount(tokens, minlength=len(probs)) / n
  assert not counts[probs == 0].any(), counts
  np.testing.assert_allclose(counts, probs, atol=0.005)  # 5 sigma of 200k draws: 0.0055
  possible = np.flatnonzero(probs)
  assert tokens[0] == possible[0] and tokens[1] == possible[-1], tokens[:2]


def test_tiny_top_p_is_greedy():
  model, _, _, sampler = _setup()
  out = sampler.generate(PROMPTS, _keys(3), SamplingParams(1.0, 1e-6, 1))
  ids, mask = left_pad(PROMPTS, P, PAD)
  pos = np.maximum(np.cumsum(mask, 1) - 1, 0)
  logits, _ = model(jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(mask))
  np.testing.assert_array_equal(out.tokens[:, 0], np.asarray(logits[:, -1].argmax(-1)))


def test_greedy_is_the_argmax_and_shares_the_sampling_program():
  """Temperature 0 answers the most likely token at every step (a full forward of each
  prefix, checked), and runs the program sampling compiled: held-out evaluation costs no
  compile of its own."""
  model, _, _, sampler = _setup()
  sampler.generate(PROMPTS, _keys(3), SamplingParams(0.7, 1.0, 3))
  out = sampler.generate(PROMPTS, _keys(3), SamplingParams(0.0, 1.0, 3))
  assert sampler._generate._cache_size() == 1
  for i, prompt in enumerate(PROMPTS):
    seq = list(prompt)
    for t in range(out.lengths[i]):
      ids, mask = left_pad([seq], P + 3, PAD)
      logits, _ = model(jnp.asarray(ids), jnp.asarray(np.maximum(np.cumsum(mask, 1) - 1, 0)),
                        jnp.asarray(mask))
      assert out.tokens[i, t] == int(logits[0, -1].argmax()), (i, t)
      seq.append(int(out.tokens[i, t]))


def test_prompt_width_multiple_sets_the_padded_width():
  """Prompts pad to the batch's longest rounded up to the multiple (the sampler's and the
  trainer's batches alike), never past max_prompt_len."""
  prompts = [[1] * 53, [1] * 20]
  rows = dict(responses=[np.array([3]), np.array([4])], logprobs=[np.zeros(1)] * 2,
              advantages=np.zeros(2), response_len=4, pad_id=PAD)
  width = lambda multiple, cap=128: TrainBatch.from_rows(
      prompts, prompt_len=cap, prompt_width_multiple=multiple, **rows).prompts.shape[1]
  assert (width(16), width(80), width(1), width(80, cap=60)) == (64, 80, 53, 60)
  _, graphdef, params, _ = _setup()
  for multiple, programs in ((16, 2), (40, 1)):  # widths 16 and 32, or both 40
    sampler = EmbeddedSampler(graphdef, params, max_prompt_len=40, eos_id=EOS, pad_id=PAD,
                              prompt_width_multiple=multiple)
    sampler.generate([[1, 5]], _keys(1), SamplingParams(1.0, 1.0, 2))
    sampler.generate([[1, 5] * 10], _keys(1), SamplingParams(1.0, 1.0, 2))
    assert sampler._generate._cache_size() == programs, multiple


def test_weights_update_in_place():
  _, graphdef, params, sampler = _setup()
  sp = SamplingParams(1.0, 1e-6, 3)
  before = sampler.generate(PROMPTS, _keys(3), sp)
  shifted = jax.tree.map(lambda x: x * 3.0, params)
  sampler.update_weights(shifted, 7)
  after = sampler.generate(PROMPTS, _keys(3), sp)
  assert sampler.version == 7
  assert not np.allclose(before.logprobs, after.logprobs)
