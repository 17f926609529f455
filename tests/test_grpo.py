"""GRPO math on hand-computed values, and micro-batch accumulation = full batch."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flexmarl.models import sharding
from flexmarl.models.transformer import ModelConfig
from flexmarl.train import credit, grpo
from flexmarl.train.trainer import AgentTrainer, OptimizerConfig, TrainBatch


@pytest.mark.quick
def test_group_advantages_by_hand():
  adv = credit.group_advantages(np.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0]), 3)
  # group 1: mean 1/3, std sqrt(2)/3; group 2: mean 5/3, std sqrt(2)/3
  s = np.sqrt(2) / 3
  np.testing.assert_allclose(adv, [(2 / 3) / s, (-1 / 3) / s, (-1 / 3) / s,
                                   (-2 / 3) / s, (1 / 3) / s, (1 / 3) / s], rtol=1e-5)
  np.testing.assert_allclose(credit.group_advantages(np.array([3.0, 1.0]), 2, False), [1, -1])
  np.testing.assert_allclose(credit.group_advantages(np.ones(4), 4), 0.0)


def test_clipped_token_loss_by_hand():
  cfg = grpo.GRPOConfig(clip_eps=0.2)
  behaviour = jnp.log(jnp.array([[0.5, 0.5]]))
  new = jnp.log(jnp.array([[0.8, 0.4]]))  # ratios 1.6 and 0.8
  ent = jnp.zeros((1, 2))
  pos = grpo.grpo_token_loss(new, behaviour, jnp.array([2.0]), ent, None, cfg, 0.0)
  # A>0: min(1.6*2, 1.2*2) = 2.4 ; min(0.8*2, 0.8*2) = 1.6
  np.testing.assert_allclose(pos, [[-2.4, -1.6]], rtol=1e-6)
  neg = grpo.grpo_token_loss(new, behaviour, jnp.array([-1.0]), ent, None, cfg, 0.0)
  # A<0: min(-1.6, -1.2) = -1.6 ; min(-0.8, -0.8) = -0.8
  np.testing.assert_allclose(neg, [[1.6, 0.8]], rtol=1e-6)


def test_kl_k3_and_entropy_terms_by_hand():
  cfg = grpo.GRPOConfig(kl_coef=0.5)
  logp = jnp.log(jnp.array([[0.5]]))
  ref = jnp.log(jnp.array([[0.25]]))
  loss = grpo.grpo_token_loss(logp, logp, jnp.array([0.0]), jnp.array([[2.0]]), ref, cfg, 0.1)
  k3 = 0.5 - np.log(0.5) - 1.0  # r = ref/p = 0.5
  np.testing.assert_allclose(loss, [[-0.1 * 2.0 + 0.5 * k3]], rtol=1e-6)


def test_entropy_bonus_anneals_linearly():
  cfg = grpo.GRPOConfig(entropy_coef=0.1, entropy_decay_steps=100)
  assert [grpo.entropy_coef_at(cfg, v) for v in (0, 50, 100, 400)] == [0.1, 0.05, 0.0, 0.0]
  assert grpo.entropy_coef_at(grpo.GRPOConfig(entropy_coef=0.1), 10**6) == 0.1


def test_token_logprobs_and_entropy():
  logits = jnp.array([[[0.0, np.log(3.0)]]])  # p = [0.25, 0.75]
  logp, ent = grpo.token_logprobs(logits, jnp.array([[1]]))
  np.testing.assert_allclose(logp, [[np.log(0.75)]], rtol=1e-6)
  np.testing.assert_allclose(ent, [[-(0.25 * np.log(0.25) + 0.75 * np.log(0.75))]], rtol=1e-6)


def _batch(rng, rows, prompt_len=5, resp_len=4, vocab=20):
  prompts = [list(rng.integers(3, vocab, size=rng.integers(2, prompt_len + 1))) for _ in range(rows)]
  lengths = rng.integers(1, resp_len + 1, size=rows)
  responses = [rng.integers(3, vocab, size=n) for n in lengths]
  logprobs = [np.log(rng.uniform(0.05, 0.9, size=n)).astype(np.float32) for n in lengths]
  adv = rng.normal(size=rows).astype(np.float32)
  return prompts, responses, logprobs, adv


def _trainer(mesh_devices, mesh_shape):
  mesh = sharding.make_mesh(mesh_devices, mesh_shape)
  return AgentTrainer('a', ModelConfig(vocab_size=20), OptimizerConfig(learning_rate=1e-2),
                      grpo.GRPOConfig(entropy_coef=0.1, kl_coef=0.05), mesh, seed=3)


def test_micro_batches_give_the_full_batch_update():
  rng = np.random.default_rng(0)
  prompts, responses, logprobs, adv = _batch(rng, 8)
  kw = dict(prompt_len=5, response_len=4, pad_id=0)
  full, micro = _trainer(jax.devices()[:1], (1, 1)), _trainer(jax.devices()[1:2], (1, 1))
  full.accumulate(TrainBatch.from_rows(prompts, responses, logprobs, adv, **kw))
  for s in (slice(0, 2), slice(2, 5), slice(5, 8)):  # uneven micro-batches
    micro.accumulate(TrainBatch.from_rows(prompts[s], responses[s], logprobs[s], adv[s], **kw))
  # The accumulated gradients agree up to float reduction order ...
  for x, y in zip(jax.tree.leaves(full.state.grads), jax.tree.leaves(micro.state.grads)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-6)
  a, b = full.apply(), micro.apply()
  assert a['trained_tokens'] == b['trained_tokens'] == sum(map(len, responses))
  np.testing.assert_allclose(a['loss'], b['loss'], rtol=1e-5)
  np.testing.assert_allclose(a['grad_norm'], b['grad_norm'], rtol=1e-5)
  # ... and so do the parameters after Adam's first step (which moves each one by
  # about ±lr, sign-like, so near-zero gradients may round differently).
  for x, y in zip(jax.tree.leaves(full.params), jax.tree.leaves(micro.params)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-4)


def test_sharded_trainer_matches_single_device():
  rng = np.random.default_rng(1)
  prompts, responses, logprobs, adv = _batch(rng, 8)
  kw = dict(prompt_len=5, response_len=4, pad_id=0)
  one, mesh = _trainer(jax.devices()[:1], (1, 1)), _trainer(jax.devices()[4:8], (2, 2))
  for t in (one, mesh):
    t.accumulate(TrainBatch.from_rows(prompts, responses, logprobs, adv, **kw,
                                      batch_multiple=t.batch_multiple))
    t.apply()
  for x, y in zip(jax.tree.leaves(one.params), jax.tree.leaves(mesh.params)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-4)  # 1% of an lr step
  gate = mesh.params['blocks'][0]['mlp']['gate']
  assert gate.sharding.spec == jax.sharding.PartitionSpec(None, 'model')
  assert {d.id for d in gate.sharding.device_set} == {4, 5, 6, 7}


def test_clip_higher_by_hand():
  """DAPO: the ratio is clipped to [1 - 0.2, 1 + 0.28]."""
  cfg = grpo.GRPOConfig(clip_eps=0.2, clip_eps_high=0.28)
  assert cfg.clip_range == (0.2, 0.28)
  behaviour = jnp.log(jnp.array([[0.5, 0.5]]))
  new = jnp.log(jnp.array([[0.8, 0.25]]))  # ratios 1.6 and 0.5
  ent = jnp.zeros((1, 2))
  pos = grpo.grpo_token_loss(new, behaviour, jnp.array([2.0]), ent, None, cfg, 0.0)
  # A>0: min(1.6*2, 1.28*2) = 2.56 ; min(0.5*2, 0.8*2) = 1.0
  np.testing.assert_allclose(pos, [[-2.56, -1.0]], rtol=1e-6)
  neg = grpo.grpo_token_loss(new, behaviour, jnp.array([-1.0]), ent, None, cfg, 0.0)
  # A<0: min(-1.6, -1.28) = -1.6 ; min(-0.5, -0.8) = -0.8
  np.testing.assert_allclose(neg, [[1.6, 0.8]], rtol=1e-6)
  low = grpo.GRPOConfig(clip_eps=0.2, clip_eps_low=0.1)
  np.testing.assert_allclose(  # A<0, ratio 0.5: min(-0.5, -0.9) = -0.9
      grpo.grpo_token_loss(new, behaviour, jnp.array([-1.0]), ent, None, low, 0.0), [[1.6, 0.9]],
      rtol=1e-6)
  np.testing.assert_array_equal(
      grpo.clipped_fraction_terms(jnp.array([0.75, 0.85, 1.25, 1.3]), cfg), [1, 0, 0, 1])


def test_dr_grpo_constant_normaliser_by_hand():
  """Dr. GRPO: the summed loss is divided by rows x max_new_tokens, not by the tokens."""
  cfg = grpo.GRPOConfig(loss_norm='constant', normalize_std=False, max_new_tokens=4)
  assert grpo.loss_divisor(cfg, tokens=7, rows=3) == 12.0
  assert grpo.loss_divisor(grpo.GRPOConfig(max_new_tokens=4), tokens=7, rows=3) == 7.0
  np.testing.assert_allclose(credit.group_advantages(np.array([1.0, 0.0, 0.0, 1.0]), 4, False),
                             [0.5, -0.5, -0.5, 0.5])
  rows = TrainBatch.from_rows([[1, 2], [3]], [np.array([4]), np.array([5, 6, 7])],
                              [np.zeros(1), np.zeros(3)], np.zeros(2), prompt_len=4,
                              response_len=4, pad_id=0)
  assert (rows.rows, rows.tokens, len(rows.advantages)) == (2, 4, 2)


def test_zero_spread_on_a_hand_built_batch():
  groups = [[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.5, 0.5], [2.0], [0.25, 0.75]]
  assert [grpo.zero_spread(g) for g in groups] == [True, False, True, True, False]
  assert grpo.zero_spread_fraction(groups) == 0.6
  assert np.isnan(grpo.zero_spread_fraction([]))


def test_truncated_importance_sampling_by_hand():
  cfg = grpo.GRPOConfig(tis_cap=1.5)
  trainer = jnp.log(jnp.array([[0.5, 0.3]]))
  sampler = jnp.log(jnp.array([[0.25, 0.6]]))  # pi_trainer / pi_sampler = 2.0 and 0.5
  w = grpo.tis_weights(trainer, sampler, cfg.tis_cap)
  np.testing.assert_allclose(w, [[1.5, 0.5]], rtol=1e-6)  # 2.0 capped at 1.5
  adv, ent = jnp.array([2.0]), jnp.zeros((1, 2))

  def loss(logp):  # on-policy: the ratio is against the trainer's own logprobs (1.0)
    return grpo.grpo_token_loss(logp, jax.lax.stop_gradient(logp), adv, ent, None, cfg, 0.0,
                                grpo.tis_weights(logp, sampler, cfg.tis_cap))
  np.testing.assert_allclose(loss(trainer), [[-3.0, -1.0]], rtol=1e-6)  # -w * A * 1
  # The weight carries no gradient: d loss / d logp = -w * A.
  np.testing.assert_allclose(jax.grad(lambda l: loss(l).sum())(trainer), [[-3.0, -1.0]],
                             rtol=1e-6)
  # Off (None): the plain clipped term.
  np.testing.assert_allclose(grpo.grpo_token_loss(trainer, trainer, adv, ent, None, cfg, 0.0),
                             [[-2.0, -2.0]], rtol=1e-6)


def test_mismatch_terms_by_hand():
  logp = jnp.log(jnp.array([[0.5, 0.2]]))
  delta, kl = grpo.mismatch_terms(logp, logp)
  np.testing.assert_array_equal(delta, 0.0)
  np.testing.assert_array_equal(kl, 0.0)
  delta, kl = grpo.mismatch_terms(logp, logp - np.log(2.0))  # the trainer's twice the sampler's
  np.testing.assert_allclose(delta, np.log(2.0), rtol=1e-6)
  np.testing.assert_allclose(kl, 2.0 - 1.0 - np.log(2.0), rtol=1e-5)


def test_trainer_reports_sampler_mismatch():
  """Zero when the sampler's logprobs are the trainer's own; the constructed shift when
  they are off by a constant."""
  from flexmarl.train.loss import response_logprobs
  rng = np.random.default_rng(1)
  prompts, responses, _, adv = _batch(rng, 4)
  kw = dict(prompt_len=5, response_len=4, pad_id=0)
  probe = _trainer(jax.devices()[:1], (1, 1))
  zeros = [np.zeros(len(r), np.float32) for r in responses]
  arrays = TrainBatch.from_rows(prompts, responses, zeros, adv, **kw).device_arrays()
  own, _ = response_logprobs(probe.graphdef, probe.params, arrays, 1.0)
  own = [np.asarray(own[i, :len(r)]) for i, r in enumerate(responses)]
  for shift, want_delta in ((0.0, 0.0), (0.25, 0.25)):
    trainer = _trainer(jax.devices()[:1], (1, 1))
    trainer.accumulate(TrainBatch.from_rows(prompts, responses, [l - shift for l in own],
                                            adv, **kw))
    stats = trainer.apply()
    np.testing.assert_allclose(stats['logprob_mismatch'], want_delta, atol=2e-6)
    np.testing.assert_allclose(stats['mismatch_kl'], np.exp(shift) - 1 - shift, atol=2e-6)

