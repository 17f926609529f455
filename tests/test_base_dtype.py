"""`model.base_dtype`: a LoRA agent's frozen base held in bfloat16 under float32 adapters
and compute. The model computes what the float32 model computes on the base rounded to
bfloat16; only the adapters train; the base stays bfloat16 and bit-identical; export
writes the merged float32 weights; a full agent is refused the option."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flexmarl.config import ConfigError, agent_config, build_team_spec
from flexmarl.models import hf, lora, sharding, transformer
from flexmarl.models.lora import LoRAConfig
from flexmarl.models.transformer import Decoder, ModelConfig
from flexmarl.train import grpo
from flexmarl.train.trainer import AgentTrainer, OptimizerConfig
from test_team import two_agent_config
from test_train_state import _batch

BASE = ModelConfig(vocab_size=20, layers=2)
CFG = dataclasses.replace(BASE, lora=LoRAConfig(rank=4, alpha=8.0), base_dtype='bfloat16')
TOKENS = np.array([[1, 5, 7, 2, 9], [0, 0, 3, 4, 6]], np.int32)


def _logits(cfg: ModelConfig, params: dict) -> np.ndarray:
  graphdef, _ = transformer.abstract_model(cfg)
  mask = TOKENS > 0
  positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
  return np.asarray(nnx.merge(graphdef, params)(TOKENS, positions, mask)[0])


def _loaded(tmp_path, cfg: ModelConfig) -> tuple[dict, dict]:
  """(the float32 base as saved, `cfg`'s params loaded from it)."""
  base = nnx.to_pure_dict(nnx.state(Decoder(BASE, nnx.Rngs(params=5))))
  folder = hf.save_hf(BASE, base, str(tmp_path / 'base'))
  shardings = sharding.param_shardings(transformer.abstract_model(cfg)[1],
                                       sharding.make_mesh(jax.devices()[:1], (1, 1)))
  return base, hf.load_params(folder, cfg, shardings)


def test_a_bf16_base_computes_the_rounded_base_in_fp32(tmp_path):
  _, frozen = _loaded(tmp_path, CFG)  # a checkpoint holds the base; adapters start fresh
  adapters = lora.partition(nnx.to_pure_dict(nnx.state(Decoder(CFG, nnx.Rngs(params=3)))),
                            CFG.lora)[0]
  assert {x.dtype for x in jax.tree.leaves(frozen)} == {jnp.dtype(jnp.bfloat16)}
  assert {x.dtype for x in jax.tree.leaves(adapters)} == {jnp.dtype(jnp.float32)}
  rng = np.random.default_rng(0)  # adapters trained a little
  adapters = jax.tree_util.tree_map_with_path(
      lambda path, x: rng.normal(size=x.shape).astype(np.float32) * 0.1
      if path[-1].key == 'lora_b' else x, adapters)
  logits = _logits(CFG, lora.combine(adapters, frozen))
  assert logits.dtype == np.float32
  # The same adapters on the float32 model whose base weights are the rounded ones.
  fp32 = dataclasses.replace(CFG, base_dtype='')
  rounded = jax.tree.map(lambda x: np.asarray(x.astype(jnp.float32)), frozen)
  np.testing.assert_allclose(logits, _logits(fp32, lora.combine(adapters, rounded)),
                             atol=1e-5, rtol=1e-5)
  # ... and the rounding is what it costs against the float32 base.
  exact = _logits(fp32, lora.combine(adapters, _loaded(tmp_path / 'again', fp32)[1]))
  assert 0 < np.abs(logits - exact).max() < 0.05


def test_only_the_adapters_train_and_the_bf16_base_stays(tmp_path):
  mesh = sharding.make_mesh(jax.devices()[:1], (1, 1))
  t = AgentTrainer('a', CFG, OptimizerConfig(learning_rate=1e-2), grpo.GRPOConfig(), mesh,
                   seed=3)
  adapters0, base0 = jax.device_get(lora.partition(t.params, CFG.lora))
  assert {x.dtype for x in jax.tree.leaves(base0)} == {jnp.dtype(jnp.bfloat16)}
  for i in range(2):
    t.accumulate(_batch(i, multiple=t.batch_multiple))
    t.apply()
  adapters, base = jax.device_get(lora.partition(t.params, CFG.lora))
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(base), jax.tree.leaves(base0)))
  assert {x.dtype for x in jax.tree.leaves(adapters)} == {jnp.dtype(jnp.float32)}
  moved = [float(np.abs(x - y).max())
           for x, y in zip(jax.tree.leaves(adapters), jax.tree.leaves(adapters0))]
  assert max(moved) > 0 and all(np.isfinite(moved))
  # Export: float32 weights, base + adapters merged.
  out = dict(hf.hf_weights(CFG, jax.device_get(t.params)))
  assert {v.dtype for v in out.values()} == {np.dtype(np.float32)}
  q = jax.device_get(t.params)['blocks'][0]['attn']
  want = (np.asarray(q['q'].astype(jnp.float32)) + CFG.lora.scale * np.einsum(
      'dr,rhk->dhk', q['q_lora']['lora_a'], q['q_lora']['lora_b']))
  np.testing.assert_allclose(out['model.layers.0.self_attn.q_proj.weight'],
                             want.reshape(want.shape[0], -1).T, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize('model, needle', [
    (dict(base_dtype='bfloat16'), "base_dtype='bfloat16'.*no adapters"),
    (dict(base_dtype='bf16', lora=dict(rank=4)), "base_dtype='bf16' is not a dtype"),
    (dict(dtype='fp32'), "dtype='fp32' is not a dtype"),
])
def test_bad_dtypes_are_refused(model, needle):
  config = two_agent_config(1)
  lora_section = model.pop('lora', None)
  config.agents.solver.model.update(model)
  if lora_section:
    config.agents.solver.model.lora.update(lora_section)
  with pytest.raises(ConfigError, match=needle):
    build_team_spec(config, 20, list(range(8)), ['solver', 'verifier'])


def test_a_team_of_agents_over_one_bf16_base(tmp_path):
  """Built as a run builds it: two LoRA agents over one random base held in bf16, served
  by one rollout instance (an adapter group), share one copy of the base per device
  group; a step trains their float32 adapters and leaves the base as it was."""
  from flexmarl.run import build
  config = two_agent_config(1)
  for a in config.agents.values():
    a.model.lora = dict(rank=4, alpha=8.0)
    a.model.base_seed, a.model.base_dtype = 7, 'bfloat16'
  config.rollout.adapter_groups = [['solver', 'verifier']]
  config.rollout.devices = 'shared'
  team = build(config, str(tmp_path / 'run'), log=lambda *_: None)
  solver, verifier = (team.agents[n].trainer for n in ('solver', 'verifier'))
  assert solver.base is verifier.base
  base0 = jax.device_get(solver.base.host())
  assert {x.dtype for x in jax.tree.leaves(base0)} == {jnp.dtype(jnp.bfloat16)}
  adapters0 = jax.device_get(verifier.state.params)  # it trains every step
  team.run(lambda *_: None)
  for x, y in zip(jax.tree.leaves(jax.device_get(solver.base.host())), jax.tree.leaves(base0)):
    np.testing.assert_array_equal(x, y)
  adapters = jax.device_get(verifier.state.params)
  assert {x.dtype for x in jax.tree.leaves(adapters)} == {jnp.dtype(jnp.float32)}
  assert max(float(np.abs(x - y).max()) for x, y in zip(jax.tree.leaves(adapters),
                                                         jax.tree.leaves(adapters0))) > 0
