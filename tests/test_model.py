"""Decoder shapes, causal masking and padding."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
import pytest

from flexmarl.models import sharding
from flexmarl.models.transformer import Decoder, ModelConfig, count_params


def _model(**kw):
  return Decoder(ModelConfig(vocab_size=32, **kw), nnx.Rngs(params=0))


def _forward(model, tokens, mask=None):
  tokens = jnp.asarray(tokens)
  mask = jnp.ones(tokens.shape, bool) if mask is None else jnp.asarray(mask)
  positions = jnp.maximum(jnp.cumsum(mask, 1) - 1, 0)
  return model(tokens, positions, mask)[0]


def test_shapes_and_param_count():
  model = _model()
  logits = _forward(model, np.zeros((3, 7), np.int32))
  assert logits.shape == (3, 7, 32) and logits.dtype == jnp.float32
  # tiny preset: embed 32x64 (tied) + 2 blocks + final norm
  block = 64 * 4 * 16 + 2 * 64 * 2 * 16 + 4 * 16 * 64 + (4 + 2 + 2) * 16 + 3 * 64 * 128 + 2 * 64
  assert count_params(nnx.state(model)) == 32 * 64 + 2 * block + 64


def test_untied_and_biasless_variants_run():
  model = _model(tie_embeddings=False, qkv_bias=False)
  assert _forward(model, np.ones((1, 4), np.int32)).shape == (1, 4, 32)
  assert not hasattr(model.blocks[0].attn, 'q_bias')


@pytest.mark.quick
def test_causal_future_tokens_do_not_change_the_past():
  model = _model()
  a = np.array([[1, 5, 9, 3, 7, 2]], np.int32)
  b = a.copy()
  b[0, 4:] = [11, 12]
  la, lb = _forward(model, a), _forward(model, b)
  np.testing.assert_allclose(la[0, :4], lb[0, :4], atol=1e-6)
  assert np.abs(la[0, 4:] - lb[0, 4:]).max() > 1e-3


def test_left_padding_does_not_change_real_tokens():
  model = _model()
  seq = np.array([[4, 8, 15, 16]], np.int32)
  padded = np.array([[0, 0, 4, 8, 15, 16]], np.int32)
  mask = np.array([[False, False, True, True, True, True]])
  np.testing.assert_allclose(_forward(model, seq)[0], _forward(model, padded, mask)[0, 2:],
                             atol=1e-5)


def test_params_shard_over_a_mesh_by_logical_axes():
  model = _model()
  state = nnx.state(model)
  mesh = sharding.make_mesh(jax.devices()[:4], (2, 2))
  shardings = sharding.param_shardings(state, mesh)
  mlp = shardings['blocks'][0]['mlp']['gate']
  assert mlp.spec == jax.sharding.PartitionSpec(None, 'model')
  params = jax.device_put(nnx.to_pure_dict(state), shardings)
  assert len(params['blocks'][0]['mlp']['gate'].addressable_shards) == 4
  merged = nnx.merge(nnx.graphdef(model), params)
  tokens = np.array([[1, 2, 3]], np.int32)
  np.testing.assert_allclose(_forward(merged, tokens), _forward(model, tokens), atol=1e-5)
