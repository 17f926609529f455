"""`model.scan_layers` (the layers run as one scan over their stacked weights) and
`model.remat` (each scanned layer's insides recomputed for the backward): the numbers are the plain unrolled model's — the forward pass, the sampler (shared
prompts, one adapter per row) and the trainer's gradient — and remat holds less."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
import pytest

from flexmarl.models import lora
from flexmarl.models.lora import LoRAConfig
from flexmarl.models.transformer import Decoder, ModelConfig
from flexmarl.rollout.sampler import EmbeddedSampler, SamplingParams, sample_key
from flexmarl.train.batch import TrainBatch
from flexmarl.train.loss import response_logprobs
from flexmarl.train.sizing import train_step_scratch
from flexmarl.train.spec import GRPOConfig

CFG = ModelConfig(vocab_size=24, layers=3, lora=LoRAConfig(rank=4, alpha=8.0))
PROMPTS = [[1, 5, 6, 7], [1, 5, 6, 7], [1, 9], [1, 9], [1, 3, 4, 5, 6, 8], [1, 4]]


# Each form against the plain unrolled model (False).
FORMS = {False: {}, True: dict(scan_layers=True), 'remat': dict(scan_layers=True, remat=True)}
OTHERS = [True, 'remat']


def _both() -> tuple[dict, dict]:
  """The graphdefs of every form of the model, and their one params tree (the weights
  are stored alike: a scan stacks them per call), adapters trained a little."""
  graphdefs, params = {}, None
  for form, fields in FORMS.items():
    graphdef, state = nnx.split(Decoder(dataclasses.replace(CFG, **fields),
                                        nnx.Rngs(params=0)))
    graphdefs[form], pure = graphdef, nnx.to_pure_dict(state)
    if params is not None:
      assert jax.tree.all(jax.tree.map(np.array_equal, params, pure))
    params = pure
  rng = np.random.default_rng(1)
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: rng.normal(size=x.shape).astype(x.dtype) * 0.1
      if path[-1].key == 'lora_b' else x, params)
  return graphdefs, params


@pytest.mark.parametrize('form', OTHERS)
def test_the_scanned_forward_is_the_unrolled_one(form):
  graphdefs, params = _both()
  tokens = np.array([[1, 5, 6, 7, 9], [0, 0, 1, 3, 4]], np.int32)
  mask = tokens > 0
  positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
  unrolled, scanned = (np.asarray(nnx.merge(graphdefs[s], params)(tokens, positions, mask)[0])
                       for s in (False, form))
  assert np.abs(unrolled).max() > 0.1
  np.testing.assert_allclose(scanned, unrolled, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize('form', OTHERS)
@pytest.mark.parametrize('temperature', [1.0, 0.0])
def test_the_scanned_sampler_draws_what_the_unrolled_one_does(temperature, form):
  graphdefs, params = _both()
  adapters, base = lora.partition(params, CFG.lora)
  agents = lora.stack([adapters, jax.tree.map(lambda x: x * 2, adapters)])
  keys = np.stack([sample_key(0, 'x', 0, str(i)) for i in range(len(PROMPTS))])
  rows = np.array([0, 0, 1, 1, 0, 1])
  sampling = SamplingParams(temperature=temperature, top_p=1.0, max_new_tokens=5)
  out = {s: EmbeddedSampler(graphdefs[s], lora.combine(agents, base), max_prompt_len=6,
                            eos_id=2, pad_id=0, adapters=2).generate(
                                PROMPTS, keys, sampling, adapter_rows=rows)
         for s in (False, form)}
  np.testing.assert_array_equal(out[form].tokens, out[False].tokens)
  np.testing.assert_array_equal(out[form].lengths, out[False].lengths)
  np.testing.assert_allclose(out[form].logprobs, out[False].logprobs, atol=2e-5)


def _batch() -> dict:
  responses = [np.array([3, 4, 2]), np.array([5, 2]), np.array([7]), np.array([8, 9, 10, 2]),
               np.array([3]), np.array([11, 2])]
  return dataclasses.asdict(TrainBatch.from_rows(
      PROMPTS, responses, [np.zeros(len(r), np.float32) for r in responses],
      np.linspace(-1, 1, len(PROMPTS)), prompt_len=8, response_len=4, pad_id=0))


def _loss(graphdef, p, batch):
  logp, _ = response_logprobs(graphdef, p, batch, 1.0)
  return jnp.sum(logp * batch['response_mask'] * batch['advantages'][:, None])


@pytest.mark.parametrize('form', OTHERS)
def test_the_scanned_gradient_is_the_unrolled_one(form):
  """Shared prompts (each GRPO group's prompt runs once) and both passes of the loss."""
  graphdefs, params = _both()
  batch = _batch()
  assert len(batch['shared_prompts']) < len(batch['responses'])  # the prompts are shared
  grads = {s: jax.grad(_loss, argnums=1)(graphdefs[s], params, batch) for s in (False, form)}
  pairs = list(zip(jax.tree.leaves(grads[False]), jax.tree.leaves(grads[form]), strict=True))
  assert max(float(np.abs(g).max()) for g, _ in pairs) > 1e-3
  for unrolled, scanned in pairs:
    np.testing.assert_allclose(scanned, unrolled, atol=1e-5, rtol=1e-4)


def test_remat_holds_less_for_the_backward_and_needs_the_scan():
  """The compiled gradient's scratch memory, a deeper model on longer rows: with remat it
  keeps each layer's input, not every layer's insides (measured here at 6 layers: 164 →
  48 MiB; unrolled, a checkpoint per block gave 169 → 154, so remat asks for the scan)."""
  with pytest.raises(ValueError, match='model.remat=True needs model.scan_layers=True'):
    dataclasses.replace(CFG, remat=True)
  cfg = dataclasses.replace(CFG, layers=6, mlp=512, scan_layers=True)
  scratch = {remat: train_step_scratch(dataclasses.replace(cfg, remat=remat), GRPOConfig(),
                                       rows=16, prompt_len=64, response_len=20)
             for remat in (False, True)}
  assert scratch[True] < 0.5 * scratch[False], scratch
