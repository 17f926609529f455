"""LoRA agents: rank 0 is today's model; adapters start as the base model; only
adapters train, the base stays bit-identical through steps, moves, checkpoints and a
whole run; sync ≡ flexmarl; export merges exactly; bad lora configs are refused."""

import dataclasses
import json
import os

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from safetensors.numpy import load_file

from flexmarl.agent_spec import AgentSpec
from flexmarl.config import ConfigError, agent_config, build_team_spec
from flexmarl.export import export
from flexmarl.metrics.writer import read_metrics
from flexmarl.models import hf, lora, sharding
from flexmarl.models.lora import LoRAConfig
from flexmarl.models.transformer import PRESETS, Decoder, ModelConfig
from flexmarl.run import train
from flexmarl.train import grpo, sizing
from flexmarl.train import state as state_lib
from flexmarl.train.checkpoint import AgentCheckpointer
from flexmarl.train.state import InStorage, OnHost
from flexmarl.train.trainer import AgentTrainer, OptimizerConfig
from test_schedules import _config as schedule_config
from test_team import two_agent_config
from test_train_state import _batch

ADAPTERS = LoRAConfig(rank=4, alpha=8.0)
TOKENS = np.array([[1, 5, 7, 2, 9], [0, 0, 3, 4, 6]], np.int32)
MASK = TOKENS > 0


def _params(cfg: ModelConfig, seed: int = 0) -> tuple[nnx.GraphDef, dict]:
  graphdef, state = nnx.split(Decoder(cfg, nnx.Rngs(params=seed)))
  return graphdef, nnx.to_pure_dict(state)


def _logits(graphdef, params) -> np.ndarray:
  positions = np.maximum(np.cumsum(MASK, 1) - 1, 0)
  return np.asarray(nnx.merge(graphdef, params)(TOKENS, positions, MASK)[0])


def _equal(a, b) -> bool:
  if jax.tree.structure(a) != jax.tree.structure(b):
    return False
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _with_random_b(params: dict, seed: int = 1) -> dict:
  """The adapters trained a little: every B nonzero."""
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_map_with_path(
      lambda path, x: (rng.normal(size=x.shape).astype(x.dtype) * 0.1
                       if path[-1].key == 'lora_b' else x), params)


def test_rank_zero_or_no_lora_is_todays_model():
  base = ModelConfig(vocab_size=20)
  graphdef, params = _params(dataclasses.replace(base, lora=LoRAConfig(rank=0, targets=('q',))))
  assert _equal(params, _params(base)[1])
  np.testing.assert_array_equal(_logits(graphdef, params), _logits(*_params(base)))
  # A config without `lora` gives today's model config.
  assert _spec_model(agent_config('tiny')) == ModelConfig(**PRESETS['tiny'], vocab_size=20)


def _spec_model(config, vocab_size: int = 20) -> ModelConfig:
  return AgentSpec.from_config('a', config, vocab_size).model


def test_first_forward_equals_base_and_merge_is_exact():
  base = ModelConfig(vocab_size=20)
  cfg = dataclasses.replace(base, lora=ADAPTERS)
  graphdef, params = _params(cfg)
  trainable, frozen = lora.partition(params, ADAPTERS)
  # The base is the full model of the same seed: adapters draw their keys after it.
  assert _equal(frozen, _params(base)[1])
  assert {k for k in trainable['blocks'][0]['attn']} == {'q_lora', 'k_lora', 'v_lora', 'o_lora'}
  np.testing.assert_array_equal(_logits(graphdef, params), _logits(*_params(base)))
  trained = _with_random_b(params)
  adapted = _logits(graphdef, trained)
  assert np.abs(adapted - _logits(graphdef, params)).max() > 1e-3
  # base + scale·A·B as plain weights computes what base + adapter computes.
  merged = lora.merged(trained, ADAPTERS)
  np.testing.assert_allclose(_logits(nnx.split(Decoder(base, nnx.Rngs(0)))[0], merged),
                             adapted, atol=1e-5)
  q = trained['blocks'][1]['attn']
  np.testing.assert_allclose(
      merged['blocks'][1]['attn']['q'],
      q['q'] + ADAPTERS.scale * np.einsum('dr,rhk->dhk', q['q_lora']['lora_a'],
                                          q['q_lora']['lora_b']), rtol=1e-6, atol=1e-7)


def test_only_adapters_train_and_the_base_survives_moves_and_checkpoints(tmp_path):
  cfg = ModelConfig(vocab_size=20, layers=1, lora=LoRAConfig(rank=4, alpha=8.0,
                                                             targets=('q', 'v', 'down')))
  mesh = sharding.make_mesh(jax.devices()[:2], (2, 1))
  t = AgentTrainer('a', cfg, OptimizerConfig(learning_rate=1e-2), grpo.GRPOConfig(), mesh,
                   seed=3)
  adapters0, base0 = jax.device_get(lora.partition(t.params, cfg.lora))
  n_adapter = sum(x.size for x in jax.tree.leaves(adapters0))
  # Adam's two moments of the adapters (plus scalar counts): nothing of the base.
  opt_sizes = [x.size for x in jax.tree.leaves(t.opt_state)]
  assert sum(s for s in opt_sizes if s > 1) == 2 * n_adapter
  for i in range(2):
    t.accumulate(_batch(i, multiple=t.batch_multiple))
    assert sum(x.size for x in jax.tree.leaves(t.state.grads)) == n_adapter
    t.apply()
  adapters, base = jax.device_get(lora.partition(t.params, cfg.lora))
  assert _equal(base, base0)
  assert not _equal(adapters, adapters0)
  # The sizing of a state from shapes (host budgets, the pool's checks) agrees.
  assert sizing.state_nbytes(cfg, OptimizerConfig(), grpo.GRPOConfig()) == t.state.nbytes
  full = dataclasses.replace(cfg, lora=LoRAConfig())
  assert t.state.nbytes < sizing.state_nbytes(full, OptimizerConfig(), grpo.GRPOConfig())
  # host, storage and back onto another mesh; a checkpoint and a fresh trainer's restore
  t.release(InStorage(str(tmp_path / 'swap')))
  t.bind(sharding.make_mesh(jax.devices()[2:4], (2, 1)))
  assert _equal(jax.device_get(lora.partition(t.params, cfg.lora)[1]), base0)
  ckpt = AgentCheckpointer(str(tmp_path), 'a')
  assert _equal(jax.device_get(t.train_state()['params']), jax.device_get(adapters))
  ckpt.save(2, t.train_state(), {'step': 2})
  ckpt.wait()
  # The checkpoint holds adapters only: a resume rebuilds the same base (here, shares it).
  fresh = AgentTrainer('a', cfg, OptimizerConfig(learning_rate=1e-2), grpo.GRPOConfig(),
                       sharding.layout((2, 1)), seed=99, base=t.base)
  state, _ = ckpt.restore(2, fresh.train_state())
  ckpt.close()
  fresh.load_train_state(state)
  assert _equal(jax.device_get(fresh.params), jax.device_get(t.params))
  assert _equal(jax.device_get(fresh.opt_state), jax.device_get(t.opt_state))
  moved, _ = state_lib.move(fresh.state, OnHost())
  assert lora.partition(moved.params, cfg.lora)[1] == {}  # a move carries adapters only
  assert _equal(jax.device_get(lora.partition(fresh.params, cfg.lora)[1]), base0)


def test_adapters_start_fresh_on_a_checkpoint_base(tmp_path):
  """A base from an HF folder (no adapters in it) gets the seed's adapters, B zero."""
  base = ModelConfig(vocab_size=20, layers=1)
  _, params = _params(base, seed=5)
  folder = hf.save_hf(base, params, str(tmp_path / 'base'))
  cfg = dataclasses.replace(base, lora=ADAPTERS)
  shardings = sharding.param_shardings(hf.abstract_params(cfg)[1],
                                       sharding.make_mesh(jax.devices()[:1], (1, 1)))
  loaded = hf.load_params(folder, cfg, shardings)
  t = AgentTrainer('a', cfg, OptimizerConfig(), grpo.GRPOConfig(), sharding.layout((1, 1)),
                   seed=3, init_params=loaded)
  adapters, frozen = lora.partition(t.params, ADAPTERS)
  assert _equal(jax.device_get(frozen), params)
  seeded = lora.partition(_params(cfg, seed=3)[1], ADAPTERS)[0]
  assert jax.tree.structure(adapters) == jax.tree.structure(seeded)
  for x, y in zip(jax.tree.leaves(adapters), jax.tree.leaves(seeded)):  # jit vs eager: 1 ulp
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
  assert not np.any(adapters['blocks'][0]['attn']['q_lora']['lora_b'])


def _lora_team(steps: int) -> ml_collections.ConfigDict:
  c = two_agent_config(steps)
  for name in ('solver', 'verifier'):
    c.agents[name].model.lora = dict(rank=16, alpha=32.0)
    c.agents[name].optimizer.learning_rate = 3e-2
  return c


def _checkpoint(workdir: str, agent: str, step: int) -> dict:
  """A saved train state, layer keys as the model's (Orbax gives them back as strings)."""
  path = os.path.abspath(os.path.join(workdir, 'checkpoints', agent, str(step), 'state'))
  return _int_keys(ocp.StandardCheckpointer().restore(path))


def _int_keys(tree):
  if not isinstance(tree, dict):
    return tree
  return {int(k) if isinstance(k, str) and k.isdigit() else k: _int_keys(v)
          for k, v in tree.items()}


@pytest.fixture(scope='module')
def lora_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('lora_team'))
  config = _lora_team(steps=15)
  train(config, workdir, log=lambda *_: None)
  return workdir, config


def test_a_lora_team_learns_with_its_base_frozen(lora_run):
  workdir, config = lora_run
  metrics = read_metrics(os.path.join(workdir, 'metrics.jsonl'))
  accuracy = [m['accuracy'] for m in metrics if m.get('agent') == 'verifier' and 'accuracy' in m]
  assert np.mean(accuracy[:3]) < 0.3 and np.mean(accuracy[-3:]) > 0.6, accuracy
  # The sampler serves base + adapters: on-policy rows have the trainer's logprobs.
  on_policy = [m['ratio_dev'] for m in metrics if m.get('staleness_max') == 0 and 'ratio_dev' in m]
  assert on_policy and max(on_policy) < 1e-4, on_policy
  for index, name in enumerate(config.agents):  # trainer seeds: seed * 1000 + index
    cfg = _spec_model(config.agents[name])
    cfg = dataclasses.replace(cfg, vocab_size=_checkpoint(workdir, name, 15)['params'][
        'embed'].shape[0])
    start = _params(cfg, seed=config.seed * 1000 + index)[1]
    trained = _checkpoint(workdir, name, 15)['params']
    assert _equal(lora.partition(trained, cfg.lora)[1], lora.partition(start, cfg.lora)[1])
    assert not _equal(lora.partition(trained, cfg.lora)[0], lora.partition(start, cfg.lora)[0])


def test_export_writes_merged_weights_and_a_peft_adapter(lora_run, tmp_path):
  workdir, _ = lora_run
  out = export(workdir, 'verifier', str(tmp_path / 'hf'))
  params = _checkpoint(workdir, 'verifier', 15)['params']
  with open(os.path.join(workdir, 'config.json'), encoding='utf-8') as f:
    saved = ml_collections.ConfigDict(json.load(f))
  cfg = _spec_model(saved.agents.verifier)
  cfg = dataclasses.replace(cfg, vocab_size=params['embed'].shape[0])
  weights = load_file(os.path.join(out, 'model.safetensors'))
  base = dict(hf.hf_weights(dataclasses.replace(cfg, lora=LoRAConfig()), params))
  adapter = load_file(os.path.join(out, 'adapter', 'adapter_model.safetensors'))
  with open(os.path.join(out, 'adapter', 'adapter_config.json'), encoding='utf-8') as f:
    peft_cfg = json.load(f)
  assert peft_cfg['r'] == 16 and set(peft_cfg['target_modules']) == {
      'q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj'}
  scale = peft_cfg['lora_alpha'] / peft_cfg['r']
  changed = 0
  for name, value in weights.items():
    prefix = f'base_model.model.{name.removesuffix(".weight")}'
    expected = base[name]
    if f'{prefix}.lora_A.weight' in adapter:  # PEFT: W + scale · B @ A in HF's layout
      expected = expected + scale * adapter[f'{prefix}.lora_B.weight'] @ adapter[
          f'{prefix}.lora_A.weight']
      changed += not np.allclose(value, base[name], atol=1e-6)
    np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6, err_msg=name)
  assert changed > 0 and len(adapter) == 2 * 7 * cfg.layers


def test_peft_loads_the_adapter(lora_run, tmp_path):
  pytest.importorskip('peft', reason='peft is not installed in this environment')
  import torch
  import transformers
  from peft import PeftModel
  workdir, _ = lora_run
  out = export(workdir, 'verifier', str(tmp_path / 'hf'))
  params = _checkpoint(workdir, 'verifier', 15)['params']
  with open(os.path.join(workdir, 'config.json'), encoding='utf-8') as f:
    cfg = _spec_model(ml_collections.ConfigDict(json.load(f)).agents.verifier)
  cfg = dataclasses.replace(cfg, vocab_size=params['embed'].shape[0])
  base_dir = hf.save_hf(dataclasses.replace(cfg, lora=LoRAConfig()),
                        lora.partition(params, cfg.lora)[1], str(tmp_path / 'base'))
  model = PeftModel.from_pretrained(
      transformers.AutoModelForCausalLM.from_pretrained(base_dir), os.path.join(out, 'adapter'))
  with torch.no_grad():
    ours = _logits(nnx.split(Decoder(cfg, nnx.Rngs(0)))[0], params)
    theirs = model(input_ids=torch.tensor(TOKENS), attention_mask=torch.tensor(MASK)).logits
  np.testing.assert_allclose(theirs.numpy()[MASK], ours[MASK], atol=1e-4)


def test_sync_and_flexmarl_train_a_mixed_team_alike(tmp_path):
  """A LoRA solver beside a full verifier: both schedules reach the same parameters."""
  leaves = {}
  for schedule in ('sync', 'flexmarl'):
    c = schedule_config(schedule)
    c.agents.solver.model.lora = dict(rank=8, alpha=16.0, targets=('q', 'v', 'up'))
    workdir = str(tmp_path / schedule)
    train(c, workdir, log=lambda *_: None)
    leaves[schedule] = {a: jax.tree.leaves(_checkpoint(workdir, a, c.steps)['params'])
                        for a in ('solver', 'verifier')}
  for agent in ('solver', 'verifier'):
    for x, y in zip(leaves['sync'][agent], leaves['flexmarl'][agent], strict=True):
      assert np.abs(x - y).max() <= 1e-5, (agent, np.abs(x - y).max())


@pytest.mark.parametrize('lora_section, needles', [
    (dict(rank=-1), ['agents.solver.model.lora.rank=-1', '>= 0']),
    (dict(rank=8, alpha=0), ['agents.solver.model.lora.alpha=0', '> 0']),
    (dict(rank=8, targets=('q', 'query')), ['agents.solver.model.lora.targets', "'query'",
                                            "'gate'"]),
    (dict(rank=8, dropout=0.1), ['agents.solver.model.lora', "['dropout']", 'alpha']),
])
def test_bad_lora_configs_are_refused(lora_section, needles):
  c = two_agent_config(steps=2)
  c.agents.solver.model.lora = lora_section
  with pytest.raises(ConfigError) as err:
    build_team_spec(c, 20, list(range(8)), ['solver', 'verifier'])
  for needle in needles:
    assert needle in str(err.value), str(err.value)


def test_vllm_refuses_a_lora_agent():
  c = two_agent_config(steps=2)
  c.agents.solver.model.lora = dict(rank=8)
  c.rollout.backend = 'vllm'
  with pytest.raises(ConfigError, match=r'agents.solver.model.lora.rank=8.*not supported '
                     r'with the vLLM backend yet.*rollout.backend=embedded'):
    build_team_spec(c, 20, list(range(8)), ['solver', 'verifier'])
