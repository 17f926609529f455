"""Tests aimed at one-line bugs that a noisy "reward rises" test lets through.

Each names the bug it catches. Every random choice is seeded.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flexmarl.models import sharding, transformer
from flexmarl.rollout.sampler import EmbeddedSampler, SamplingParams, sample_key
from flexmarl.store.experience_store import ExperienceStore
from flexmarl.train import credit, grpo
from flexmarl.train.loss import loss_sum, response_logprobs
from flexmarl.train.trainer import AgentTrainer, OptimizerConfig, TrainBatch

VOCAB = 20
KW = dict(prompt_len=5, response_len=4, pad_id=0)
# Compiled once each: eager forward passes cost seconds per call on a busy CPU.
_logprobs = jax.jit(response_logprobs, static_argnums=(0, 3))
_loss_sum = jax.jit(loss_sum, static_argnames=('graphdef', 'cfg'))


def _rows(seed, rows):
  rng = np.random.default_rng(seed)
  prompts = [list(rng.integers(3, VOCAB, size=rng.integers(2, 6))) for _ in range(rows)]
  lengths = rng.integers(1, 5, size=rows)
  responses = [rng.integers(3, VOCAB, size=n) for n in lengths]
  return prompts, responses, rng.normal(size=rows).astype(np.float32)


def _trainer(cfg: grpo.GRPOConfig, lr=1e-2):
  mesh = sharding.make_mesh(jax.devices()[:1], (1, 1))
  return AgentTrainer('a', transformer.ModelConfig(vocab_size=VOCAB),
                      OptimizerConfig(learning_rate=lr, max_grad_norm=1e9), cfg, mesh, seed=3)


def _on_policy(trainer, prompts, responses, adv, temperature=1.0):
  """A batch whose behaviour logprobs are the trainer's own (ratio 1)."""
  b = TrainBatch.from_rows(prompts, responses, [np.zeros(len(r), np.float32) for r in responses],
                           adv, **KW)
  logp, _ = _logprobs(trainer.graphdef, trainer.params, vars(b), temperature)
  b.behaviour_logprobs = np.where(b.response_mask, np.asarray(logp), 0.0).astype(np.float32)
  return b


@pytest.mark.parametrize('loss_norm', ['token', 'constant'])
def test_one_step_loss_and_gradient_match_a_reference(loss_norm):
  """Bugs: the accumulated gradient not divided by the global batch's token count, or
  Dr. GRPO's constant normaliser (rows × max_new_tokens) not applied."""
  cfg = grpo.GRPOConfig(loss_norm=loss_norm, max_new_tokens=4, entropy_coef=0.0)  # no bonus
  t = _trainer(cfg)
  prompts, responses, adv = _rows(0, 6)
  halves = [_on_policy(t, prompts[s], responses[s], adv[s]) for s in (slice(0, 2), slice(2, 6))]
  params0 = t.params
  for b in halves:
    t.accumulate(b)
  stats = t.apply()
  lengths = np.array([len(r) for r in responses])
  divisor = lengths.sum() if loss_norm == 'token' else 6 * 4
  # At ratio 1 the token loss is -A: the batch loss is -sum_i A_i |o_i| / divisor.
  np.testing.assert_allclose(stats['loss'] * lengths.sum() / divisor,
                             -(adv * lengths).sum() / divisor, rtol=1e-5)

  def reference(params):  # the same objective, written from scratch over the whole batch
    total = 0.0
    for b in halves:
      logp, _ = _logprobs(t.graphdef, params, vars(b), 1.0)
      ratio = jnp.exp(logp - b.behaviour_logprobs)
      total += jnp.sum(jnp.where(b.response_mask, -ratio * b.advantages[:, None], 0.0))
    return total / divisor

  ref_norm = float(optax_norm(jax.jit(jax.grad(reference))(params0)))
  np.testing.assert_allclose(stats['grad_norm'], ref_norm, rtol=1e-4)


def optax_norm(tree):
  return jnp.sqrt(sum(jnp.sum(x ** 2) for x in jax.tree.leaves(tree)))


def test_kl_reference_stays_frozen_after_two_updates():
  """Bug: the KL term's reference taken from the live parameters (equal at step 1 only)."""
  cfg = grpo.GRPOConfig(kl_coef=0.5, entropy_coef=0.0)  # the KL term alone
  t = _trainer(cfg, lr=3e-2)
  initial = jax.tree.map(jnp.copy, t.params)
  for seed in (1, 2):
    prompts, responses, adv = _rows(seed, 4)
    t.accumulate(_on_policy(t, prompts, responses, adv))
    t.apply()
  prompts, responses, adv = _rows(3, 4)
  b = _on_policy(t, prompts, responses, np.zeros(4, np.float32))  # loss = the KL term alone
  params2 = t.params
  t.accumulate(b)
  kl = t.apply()['loss']
  batch = vars(b)
  frozen, _ = _loss_sum(params2, initial, batch, 0.0, graphdef=t.graphdef, cfg=cfg)
  live, _ = _loss_sum(params2, params2, batch, 0.0, graphdef=t.graphdef, cfg=cfg)
  assert float(live) == pytest.approx(0.0, abs=1e-6) and kl > 1e-4
  assert kl == pytest.approx(float(frozen) / b.tokens, rel=1e-4)
  for x, y in zip(jax.tree.leaves(t.ref_params), jax.tree.leaves(initial)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_first_step_ratio_is_one_at_temperature_07():
  """Bug: the sampling temperature not reaching the loss (every run used temperature 1)."""
  from flexmarl.config import agent_config, build_team_spec
  import ml_collections
  c = ml_collections.ConfigDict(dict(
      seed=0, steps=1, schedule='sync', tokenizer='char', max_prompt_len=6, checkpoint_every=1,
      rollout=dict(query_concurrency=1, max_step_queries=1),
      agents=dict(solver=agent_config(sampling=dict(temperature=0.7, top_p=1.0,
                                                    max_new_tokens=4)))))
  spec = build_team_spec(c, VOCAB, list(range(8)), ['solver'])
  assert spec.agents['solver'].grpo.temperature == 0.7
  t = _trainer(spec.agents['solver'].grpo)
  sampler = EmbeddedSampler(t.graphdef, t.params, max_prompt_len=6, eos_id=2, pad_id=0)
  prompts = [[1, 5, 6, 7]] * 8
  out = sampler.generate(prompts, np.stack([sample_key(0, 'a', 0, f'q0_0_{i}') for i in range(8)]),
                         SamplingParams(temperature=0.7, max_new_tokens=4))
  rows = range(8)
  t.accumulate(TrainBatch.from_rows(prompts, [out.tokens[i, :out.lengths[i]] for i in rows],
                                    [out.logprobs[i, :out.lengths[i]] for i in rows],
                                    np.ones(8, np.float32), **KW))
  stats = t.apply()
  assert stats['ratio_dev'] < 1e-5 and stats['clipped'] == 0.0


def test_different_keys_draw_different_samples():
  """Bug: one PRNG key used for every row of a batch."""
  model = transformer.Decoder(transformer.ModelConfig(vocab_size=VOCAB), nnx.Rngs(params=1))
  graphdef, state = nnx.split(model)
  sampler = EmbeddedSampler(graphdef, nnx.to_pure_dict(state), max_prompt_len=6, eos_id=2,
                            pad_id=0)
  keys = np.stack([sample_key(0, 'a', 0, f'q0_0_{i}') for i in range(8)])
  keys[5] = keys[0]  # the same key in another row draws the same sample
  out = sampler.generate([[1, 5, 6]] * 8, keys, SamplingParams(max_new_tokens=4))
  seqs = [tuple(out.tokens[i, :out.lengths[i]]) for i in range(8)]
  assert seqs[5] == seqs[0]
  assert len(set(seqs[:5] + seqs[6:])) >= 6  # a group's samples differ


@pytest.mark.quick
def test_untied_head_is_used():
  """Bug: an untied output head ignored in favour of the embedding."""
  model = transformer.Decoder(transformer.ModelConfig(vocab_size=VOCAB, tie_embeddings=False),
                              nnx.Rngs(params=0))
  tokens = jnp.array([[1, 5, 6]])
  pos, mask = jnp.arange(3)[None], jnp.ones((1, 3), bool)
  before, _ = model(tokens, pos, mask)
  model.lm_head[...] = model.lm_head[...] * 2.0
  after, _ = model(tokens, pos, mask)
  np.testing.assert_allclose(np.asarray(after), 2 * np.asarray(before), rtol=1e-5, atol=1e-6)


def test_advantages_trained_and_stored_are_group_advantages(tmp_path, monkeypatch):
  """Bug: advantages normalised over a micro-batch instead of per group."""
  from test_bad_input import Sums, small_config
  from flexmarl.run import train

  class Spread(Sums):
    def reward(self, c, query):  # varies within a group, so advantages are not all 0
      return float(sum(map(ord, c.text)) % 5)

  received = []
  original = AgentTrainer.accumulate

  def recording(self, batch, update=0):
    received.append(batch.advantages[batch.response_mask.any(1)])
    return original(self, batch, update)

  monkeypatch.setattr(AgentTrainer, 'accumulate', recording)
  c = small_config(steps=2)
  # Four groups of 4 a step, in two micro-batches of two groups: normalising over a
  # micro-batch would differ from normalising over each group.
  c.rollout.query_concurrency = c.rollout.max_step_queries = 4
  c.agents.solver.global_batch, c.agents.solver.micro_batch = 16, 8
  c.agents.solver.grpo.normalize_std = True
  train(c, str(tmp_path), Spread(), log=lambda *_: None)
  with ExperienceStore.open(tmp_path / 'store', ['solver']) as store:
    rows = store.read('solver', ready=('reward', 'advantage'))
  groups = {}
  for r in rows:
    groups.setdefault(r.sample_id.rsplit('_', 1)[0], []).append(r)
  expected = []
  for members in groups.values():
    rewards = np.array([r.reward for r in members])
    adv = credit.group_advantages(rewards, len(rewards), True)
    np.testing.assert_allclose([r.advantage for r in members], adv, rtol=1e-5, atol=1e-6)
    expected.append(adv)
  assert any(np.ptp(g) > 0 for g in expected), 'no group had a reward spread'
  assert len(received) == 4 and all(len(r) == 8 for r in received)  # 2 steps x 2, in order
  np.testing.assert_allclose(np.concatenate(received), np.concatenate(expected), rtol=1e-5,
                             atol=1e-6)
