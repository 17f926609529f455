"""Rows that share a prompt share its forward pass, in the sampler's prefill and in the
loss, and get the same numbers as rows that each run their whole prompt."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
import pytest

from flexmarl.models import transformer
from flexmarl.models.layout import FULL_WIDTH_SLACK, distinct_prompts, left_pad, response_width
from flexmarl.rollout.sampler import EmbeddedSampler, SamplingParams, sample_key
from flexmarl.train import grpo
from flexmarl.train.batch import TrainBatch
from flexmarl.train.loss import loss_sum, response_logprobs

VOCAB, PAD, EOS, P = 24, 0, 2, 6
PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 3, 4, 5, 6, 8]]


@pytest.mark.quick
def test_distinct_prompts_maps_rows_to_each_prompt_once():
  ids, mask = left_pad([[1, 2], [3], [1, 2], [1, 2], [4, 5, 6], []], 4, PAD)
  prompts, prompt_mask, of_row = distinct_prompts(ids, mask, rows=5)
  assert prompts.shape == (3, 4)  # 3 distinct: rows/2 slots (rows/8 is too few)
  for i in range(5):
    np.testing.assert_array_equal(prompts[of_row[i]], ids[i])
    np.testing.assert_array_equal(prompt_mask[of_row[i]], mask[i])
  assert of_row[0] == of_row[2] == of_row[3] and len(set(of_row[:5].tolist())) == 3
  assert of_row[5] == 0  # a padding row
  # A batch of 16 rows holds 2 (16/8), 4 (16/4), 8 (16/2) or 16 prompts: 3 distinct take
  # 4 slots, 5 take 8.
  big_ids, big_mask = left_pad([[1, 2], [3], [4, 5, 6]] * 5 + [[]], 4, PAD)
  shared, shared_mask, _ = distinct_prompts(big_ids, big_mask, rows=15)
  assert shared.shape == (4, 4) and not shared_mask[3:].any()  # padding prompts
  five_ids, five_mask = left_pad([[1, 2], [3], [4, 5, 6], [7], [8]] * 3 + [[]], 4, PAD)
  assert distinct_prompts(five_ids, five_mask, rows=15)[0].shape == (8, 4)
  # Different tags (adapters) never share: rows 0, 3 and 6 have one prompt, row 3 a tag.
  _, _, tagged = distinct_prompts(big_ids, big_mask, rows=15, tags=np.eye(16)[3])
  assert tagged[0] == tagged[6] != tagged[3]
  # Nothing left to share gives the rows.
  same_ids, _, identity = distinct_prompts(ids[:4], mask[:4], rows=4, tags=np.arange(4))
  np.testing.assert_array_equal(identity, np.arange(4))
  np.testing.assert_array_equal(same_ids, ids[:4])


@pytest.mark.quick
def test_responses_take_the_full_width_unless_a_narrower_one_saves_a_good_share():
  """The real team's shapes: answers of up to 8 of 10 tokens in 8 rows over two 64-token
  prompts run at 10 (16 padded tokens of 192: no second program to compile); 3 of 10
  run at 4 (48 of 160 saved); the rule is the slack, exactly at its edge."""
  assert response_width([3, 8, 5], 10, rows=8, prompt_tokens=128) == 10
  assert response_width([3, 2, 1], 10, rows=8, prompt_tokens=128) == 4
  # Without prompts to weigh, 8 rows at 8 of 9 tokens: 8 padded of 64 is exactly the slack.
  assert FULL_WIDTH_SLACK == 0.125
  assert response_width([8], 9, rows=8, prompt_tokens=0) == 9
  assert response_width([8], 10, rows=8, prompt_tokens=0) == 8
  # TrainBatch lays its responses out so.
  batch = TrainBatch.from_rows([[1] * 60] * 8, [np.arange(3, 11)] * 8,
                               [np.zeros(8, np.float32)] * 8, np.zeros(8, np.float32),
                               prompt_len=64, response_len=10, pad_id=PAD)
  assert batch.responses.shape == (8, 10) and batch.shared_prompts.shape == (1, 64)


def _model():
  graphdef, state = nnx.split(
      transformer.Decoder(transformer.ModelConfig(vocab_size=VOCAB), nnx.Rngs(params=1)))
  return graphdef, nnx.to_pure_dict(state)


def _grouped_batch(seed=0, group=4):
  rng = np.random.default_rng(seed)
  prompts = [p for p in PROMPTS for _ in range(group)]
  responses = [rng.integers(3, VOCAB, size=rng.integers(1, 6)) for _ in prompts]
  logprobs = [rng.normal(size=len(r)).astype(np.float32) - 3 for r in responses]
  return TrainBatch.from_rows(prompts, responses, logprobs,
                              rng.normal(size=len(prompts)).astype(np.float32),
                              prompt_len=P, response_len=5, pad_id=PAD)


def _unshared(batch: TrainBatch) -> TrainBatch:
  """The same rows, each running its own whole prompt."""
  return dataclasses.replace(batch, shared_prompts=batch.prompts,
                             shared_prompt_mask=batch.prompt_mask,
                             prompt_of_row=np.arange(len(batch.prompts), dtype=np.int32))


def test_shared_prompt_loss_and_gradient_equal_whole_rows():
  graphdef, params = _model()
  shared = _grouped_batch()
  # 3 prompts, 16 rows: 16/8 = 2 slots are too few, so 16/4 = 4 (`layout.prompt_bucket`).
  assert shared.shared_prompts.shape[0] == 4 < len(shared.prompts)
  cfg = grpo.GRPOConfig(max_new_tokens=5)
  value_and_grad = jax.jit(jax.value_and_grad(
      lambda p, b: loss_sum(p, None, b, 0.01, graphdef=graphdef, cfg=cfg), has_aux=True))
  (loss_a, stats_a), grads_a = value_and_grad(params, shared.device_arrays())
  (loss_b, stats_b), grads_b = value_and_grad(params, _unshared(shared).device_arrays())
  np.testing.assert_allclose(loss_a, loss_b, rtol=1e-5)
  np.testing.assert_allclose(stats_a['entropy'], stats_b['entropy'], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
    np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.abs(b).max()) + 1e-7)


def test_grouped_samples_score_the_same_in_the_trainer():
  graphdef, params = _model()
  sampler = EmbeddedSampler(graphdef, params, max_prompt_len=P, eos_id=EOS, pad_id=PAD)
  prompts = [p for p in PROMPTS for _ in range(4)]
  keys = np.stack([sample_key(0, 'a', 0, str(i)) for i in range(len(prompts))])
  out = sampler.generate(prompts, keys, SamplingParams(temperature=0.7, max_new_tokens=5))
  # A row drawn in a group draws what it draws alone (its prompt prefilled for it only).
  alone = sampler.generate(prompts[5:6], keys[5:6], SamplingParams(0.7, 1.0, 5))
  np.testing.assert_array_equal(out.tokens[5], alone.tokens[0])
  rows = range(len(prompts))
  batch = TrainBatch.from_rows(prompts, [out.tokens[i, :out.lengths[i]] for i in rows],
                               [out.logprobs[i, :out.lengths[i]] for i in rows],
                               np.zeros(len(prompts)), prompt_len=P, response_len=5,
                               pad_id=PAD)
  assert batch.shared_prompts.shape[0] < len(prompts)
  logp, _ = response_logprobs(graphdef, params, dataclasses.asdict(batch), 0.7)
  np.testing.assert_allclose(np.where(batch.response_mask, logp, 0), batch.behaviour_logprobs,
                             atol=1e-5)
