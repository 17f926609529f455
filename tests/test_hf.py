"""HF Llama/Qwen2 checkpoints in and out: parity with transformers, exact round trips."""

import dataclasses
import json

import jax
import ml_collections
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

torch = pytest.importorskip('torch', reason='HF parity tests need torch (requirements-vllm.txt)')
transformers = pytest.importorskip('transformers', reason='HF parity tests need transformers')

from flexmarl import config as config_lib  # noqa: E402
from flexmarl import tasks  # noqa: E402
from flexmarl.export import export  # noqa: E402
from flexmarl.models import hf, sharding, transformer  # noqa: E402
from flexmarl.models.tokenizer import build_char_tokenizer, load_tokenizer  # noqa: E402
from flexmarl.models.transformer import Decoder, ModelConfig  # noqa: E402
from flexmarl.train.checkpoint import AgentCheckpointer  # noqa: E402
from flexmarl.train.trainer import AgentTrainer  # noqa: E402

VOCAB = 48
CASES = {
    'llama_untied': ('llama', False, None),
    'llama_tied_llama3_rope': ('llama', True, dict(rope_type='llama3', factor=4.0,
                                                   low_freq_factor=1.0, high_freq_factor=4.0,
                                                   original_max_position_embeddings=8)),
    'qwen2_tied': ('qwen2', True, None),
    'qwen2_untied_linear_rope': ('qwen2', False, dict(rope_type='linear', factor=2.0)),
}


def _make_hf(folder, kind, tied, rope_scaling, seed=0):
  """A random HF model (GQA: 4 query heads over 2 KV heads) with every weight,
  norms and biases included, drawn at a scale that gives O(1) logits."""
  common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                rms_norm_eps=1e-5, rope_theta=500.0, tie_word_embeddings=tied,
                rope_scaling=rope_scaling)
  config = (transformers.LlamaConfig if kind == 'llama' else transformers.Qwen2Config)(**common)
  torch.manual_seed(seed)
  model = (transformers.LlamaForCausalLM if kind == 'llama'
           else transformers.Qwen2ForCausalLM)(config).float().eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(1 + 0.2 * torch.randn_like(p) if 'norm' in name else 0.3 * torch.randn_like(p))
  model.save_pretrained(folder, safe_serialization=True)
  return model


def _batch():
  """Two rows, the second left-padded by three slots."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, VOCAB, size=(2, 9)).astype(np.int32)
  mask = np.ones((2, 9), bool)
  mask[1, :3] = False
  tokens[1, :3] = 0
  return tokens, mask


def _flax_logits(cfg, params, tokens, mask):
  graphdef, _ = transformer.abstract_model(cfg)
  model = nnx.merge(graphdef, params)
  positions = jnp.maximum(jnp.cumsum(mask, 1) - 1, 0)
  return np.asarray(model(jnp.asarray(tokens), positions, jnp.asarray(mask))[0])


def _hf_logits(model, tokens, mask):
  mask_t = torch.tensor(mask, dtype=torch.long)
  positions = torch.clamp(mask_t.cumsum(1) - 1, min=0)
  with torch.no_grad():
    out = model(input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=mask_t,
                position_ids=positions)
  return out.logits.float().numpy()


def _shardings(cfg, mesh_shape=(1, 2)):
  mesh = sharding.make_mesh(jax.devices()[:mesh_shape[0] * mesh_shape[1]], mesh_shape)
  return sharding.param_shardings(transformer.abstract_model(cfg)[1], mesh)


@pytest.mark.quick
@pytest.mark.parametrize('case', sorted(CASES))
def test_logits_match_transformers_and_round_trip(case, tmp_path):
  kind, tied, rope_scaling = CASES[case]
  src = _make_hf(str(tmp_path / 'src'), kind, tied, rope_scaling)
  cfg = hf.model_config_from_hf(str(tmp_path / 'src'))
  assert (cfg.qkv_bias, cfg.tie_embeddings, cfg.kv_heads, cfg.head_dim) == (
      kind == 'qwen2', tied, 2, 8)
  shardings = _shardings(cfg)
  params = hf.load_params(str(tmp_path / 'src'), cfg, shardings)
  assert params['blocks'][0]['mlp']['gate'].sharding == shardings['blocks'][0]['mlp']['gate']
  tokens, mask = _batch()
  ours, theirs = _flax_logits(cfg, params, tokens, mask), _hf_logits(src, tokens, mask)
  assert np.abs(theirs[mask]).max() > 1.0  # the comparison is not between near-zeros
  np.testing.assert_allclose(ours[mask], theirs[mask], atol=1e-4, rtol=0)

  hf.save_hf(cfg, params, str(tmp_path / 'out'), tokenizer=build_char_tokenizer())
  again = hf.load_params(str(tmp_path / 'out'), hf.model_config_from_hf(str(tmp_path / 'out')),
                         shardings)
  jax.tree.map(np.testing.assert_array_equal, params, again)
  assert hf.model_config_from_hf(str(tmp_path / 'out')) == cfg
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path / 'out'), dtype=torch.float32).eval()
  np.testing.assert_allclose(_hf_logits(reloaded, tokens, mask)[mask], ours[mask], atol=1e-4,
                             rtol=0)


def test_exported_folder_holds_tokenizer_with_specials(tmp_path):
  cfg = ModelConfig(vocab_size=48)
  params = nnx.to_pure_dict(nnx.state(Decoder(cfg, nnx.Rngs(params=0))))
  tok = build_char_tokenizer()
  hf.save_hf(cfg, params, str(tmp_path), tokenizer=tok)
  back = load_tokenizer(str(tmp_path))
  assert (back.eos_id, back.bos_id, back.pad_id) == (tok.eos_id, tok.bos_id, tok.pad_id)
  assert back.encode('3+4') == tok.encode('3+4')
  auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  assert (auto.eos_token_id, auto.bos_token_id, auto.pad_token_id) == (
      tok.eos_id, tok.bos_id, tok.pad_id)
  assert [tok.bos_id] + auto.encode('3+4', add_special_tokens=False) == tok.encode('3+4')
  with open(tmp_path / 'config.json') as f:
    assert json.load(f)['eos_token_id'] == tok.eos_id


@pytest.mark.quick
def test_bad_checkpoints_are_refused_with_the_field(tmp_path):
  with pytest.raises(ValueError, match='no config.json'):
    hf.model_config_from_hf(str(tmp_path))
  _make_hf(str(tmp_path), 'llama', False, dict(rope_type='yarn', factor=4.0))
  with pytest.raises(ValueError, match="rope_scaling type 'yarn'"):
    hf.model_config_from_hf(str(tmp_path))
  agent = config_lib.agent_config()
  agent.model.checkpoint = str(tmp_path / 'missing')
  with pytest.raises(config_lib.ConfigError, match='agents.a.model.checkpoint'):
    config_lib.AgentSpec.from_config('a', agent, 40)
  cfg = ModelConfig(vocab_size=48)
  folder = hf.save_hf(cfg, nnx.to_pure_dict(nnx.state(Decoder(cfg, nnx.Rngs(params=0)))),
                      str(tmp_path / 'wrong'))
  wrong = dataclasses.replace(cfg, mlp=96)
  with pytest.raises(ValueError, match='gate_proj.weight has shape \\(128, 64\\)'):
    hf.load_params(folder, wrong, _shardings(wrong, (1, 1)))


def _greedy_answers(cfg, params, tokenizer, prompts, max_new=3):
  """Greedy decoding without a cache: the few steps of a short answer."""
  graphdef, _ = transformer.abstract_model(cfg)

  @jax.jit
  def next_tokens(params, ids, mask):
    logits, _ = nnx.merge(graphdef, params)(ids, jnp.maximum(jnp.cumsum(mask, 1) - 1, 0),
                                            mask, last=1)
    return jnp.argmax(logits[:, 0], -1)

  starts = [tokenizer.encode(p + '=') for p in prompts]
  rows = [list(r) for r in starts]
  for _ in range(max_new):
    width = max(map(len, rows))
    ids = np.array([[tokenizer.pad_id] * (width - len(r)) + r for r in rows], np.int32)
    mask = np.array([[False] * (width - len(r)) + [True] * len(r) for r in rows])
    rows = [r + [int(t)] for r, t in zip(rows, next_tokens(params, ids, mask))]
  return [tokenizer.decode(r[len(s):]) for r, s in zip(rows, starts)]


def test_trained_model_keeps_its_accuracy_through_hf(tmp_path):
  """Teach the tiny model `add` by supervised steps, export it with its tokenizer,
  load it as an agent (config → spec → initial_params): same greedy answers."""
  tok = build_char_tokenizer()
  cfg = ModelConfig(vocab_size=tok.vocab_size, qkv_bias=False, tie_embeddings=False)
  rng = np.random.default_rng(0)
  data = [tasks.add(rng) for _ in range(64)]
  seqs = [tok.encode(t.prompt + '=') + tok.encode(t.answer)[1:] + [tok.eos_id] for t in data]
  width = max(map(len, seqs))
  ids = np.array([s + [tok.pad_id] * (width - len(s)) for s in seqs], np.int32)
  loss_mask = np.array([[i >= len(tok.encode(t.prompt + '=')) - 1 and i < len(s) - 1
                         for i in range(width)] for t, s in zip(data, seqs)])
  graphdef, state = nnx.split(Decoder(cfg, nnx.Rngs(params=0)))
  params = nnx.to_pure_dict(state)
  tx = optax.adam(1e-2)

  @jax.jit
  def step(params, opt_state):
    def loss(p):
      model = nnx.merge(graphdef, p)
      valid = ids != tok.pad_id
      logits, _ = model(ids, jnp.maximum(jnp.cumsum(valid, 1) - 1, 0), valid)
      nll = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:])
      return jnp.sum(nll * loss_mask[:, :-1]) / loss_mask.sum()
    grads = jax.grad(loss)(params)
    updates, opt_state = tx.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state

  opt_state = tx.init(params)
  for _ in range(80):
    params, opt_state = step(params, opt_state)
  prompts = [t.prompt for t in data]
  before = _greedy_answers(cfg, params, tok, prompts)
  accuracy = np.mean([a == t.answer for a, t in zip(before, data)])
  assert accuracy >= 0.5, accuracy  # it learned something worth preserving

  hf.save_hf(cfg, params, str(tmp_path / 'export'), tokenizer=tok)
  agent = config_lib.agent_config()
  agent.model.checkpoint = str(tmp_path / 'export')
  loaded_tok = load_tokenizer(str(tmp_path / 'export'))
  spec = config_lib.AgentSpec.from_config('solver', agent, loaded_tok.vocab_size)
  assert spec.model == cfg and spec.checkpoint == str(tmp_path / 'export')
  loaded = hf.initial_params(spec.model, spec.checkpoint, _shardings(spec.model, (1, 1)), seed=7)
  jax.tree.map(np.testing.assert_array_equal, params, loaded)
  assert _greedy_answers(spec.model, loaded, loaded_tok, prompts) == before
  fresh = hf.initial_params(dataclasses.replace(cfg), '', _shardings(cfg, (1, 1)), seed=7)
  assert not np.array_equal(fresh['embed'], loaded['embed'])


def test_export_cli_writes_the_latest_checkpoint(tmp_path):
  """A run's workdir (config.json, tokenizer/, an Orbax checkpoint) → HF folder."""
  tok = build_char_tokenizer()
  config = ml_collections.ConfigDict(dict(seed=0, agents=dict(
      solver=config_lib.agent_config('tiny'))))
  config.agents.solver.model.tie_embeddings = False
  (tmp_path / 'config.json').write_text(config.to_json_best_effort())
  tok.save(str(tmp_path / 'tokenizer'))
  spec = config_lib.agent_spec(config, 'solver', tok.vocab_size)
  mesh = sharding.make_mesh(jax.devices()[:2], (1, 2))
  trainer = AgentTrainer('solver', spec.model, spec.optimizer, spec.grpo, mesh, seed=3)
  ckpt = AgentCheckpointer(str(tmp_path), 'solver')
  ckpt.save(5, trainer.train_state(), {'step': 5})
  ckpt.wait()
  ckpt.close()
  out = export(str(tmp_path), 'solver', str(tmp_path / 'hf'))
  assert hf.model_config_from_hf(out) == spec.model
  loaded = hf.load_params(out, spec.model, _shardings(spec.model, (1, 1)))
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(trainer.params), loaded)
  assert load_tokenizer(out).encode('1+2') == tok.encode('1+2')
  with pytest.raises(config_lib.ConfigError, match="no agent 'critic'"):
    export(str(tmp_path), 'critic', str(tmp_path / 'hf2'))


def test_example_checkpoint_builds_the_pretrained_experiment(tmp_path):
  from experiments import make_tiny_hf, pretrained_vllm
  folder = make_tiny_hf.make(str(tmp_path / 'tiny_hf'))
  config = pretrained_vllm.get_config(folder)
  tok = load_tokenizer(config.tokenizer)
  spec = config_lib.build_team_spec(config, tok.vocab_size, list(range(8)), ['solver', 'verifier'])
  for agent in spec.agents.values():
    assert agent.checkpoint == folder and agent.model == hf.model_config_from_hf(folder)
  assert config.rollout.backend == 'vllm'
