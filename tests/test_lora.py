"""LoRA agents: rank 0 is today's model; adapters start as the base model; only
adapters train, the base stays bit-identical through steps, moves, checkpoints and a
whole run; sync ≡ flexmarl; export merges exactly; bad lora configs are refused."""

import dataclasses
import json
import os

import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from flexmarl.config import ConfigError, agent_config, build_team_spec
from flexmarl.export import export
from flexmarl.metrics.writer import read_metrics
from flexmarl.models import hf, lora, peft, sharding, transformer
from flexmarl.models.lora import LoRAConfig
from flexmarl.models.tokenizer import load_tokenizer
from flexmarl.models.transformer import PRESETS, Decoder, ModelConfig
from flexmarl.rollout.sampler import EmbeddedSampler, SamplingParams, sample_key
from flexmarl.run import build, train
from flexmarl.runtime import memory
from flexmarl.spec.agent import AgentSpec
from flexmarl.train import grpo, shared_base, sizing
from flexmarl.train import state as state_lib
from flexmarl.train.checkpoint import AgentCheckpointer
from flexmarl.train.state import InStorage, OnHost
from flexmarl.train.trainer import AgentTrainer, OptimizerConfig
from test_resume import assert_same_run
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


@pytest.mark.quick
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
  shardings = sharding.param_shardings(transformer.abstract_model(cfg)[1],
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
  """Both agents adapters on one shared base: the random init of base seed 7."""
  c = two_agent_config(steps)
  for name in ('solver', 'verifier'):
    c.agents[name].model.lora = dict(rank=16, alpha=32.0)
    c.agents[name].model.base_seed = 7
    # Seeds 0-3 at 25 steps: 1e-2 takes the verifier from 0 to 0.83-0.90 in every one;
    # 3e-2 reached 0.6-0.8 and fell back to 0 in two of them, 3e-3 rose too late in three.
    c.agents[name].optimizer.learning_rate = 1e-2
    # The plain bonus on every row (the error-weighted one puts it all on the few wrong
    # rows of a verifier that starts at 0 accuracy).
    c.agents[name].grpo.entropy_by_error = False
  return c


LORA_STEPS = 25  # of the run the tests below read


def _run_model(workdir: str, name: str, step: int) -> tuple[ModelConfig, dict, dict]:
  """(model config, checkpoint adapters, base) of a LoRA agent of a `_lora_team` run."""
  with open(os.path.join(workdir, 'config.json'), encoding='utf-8') as f:
    saved = ml_collections.ConfigDict(json.load(f))
  cfg = _spec_model(saved.agents[name], load_tokenizer(os.path.join(workdir, 'tokenizer'))
                    .vocab_size)
  base = _params(dataclasses.replace(cfg, lora=LoRAConfig()), seed=7)[1]
  return cfg, _checkpoint(workdir, name, step)['params'], base


def _checkpoint(workdir: str, agent: str, step: int) -> dict:
  """A saved train state, its layers as the model's."""
  return AgentCheckpointer(workdir, agent).read(step)[0]


@pytest.fixture(scope='module')
def lora_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('lora_team'))
  config = _lora_team(steps=LORA_STEPS)
  train(config, workdir, log=lambda *_: None)
  return workdir, config


def test_a_lora_team_learns_with_its_base_frozen(lora_run):
  workdir, config = lora_run
  metrics = read_metrics(os.path.join(workdir, 'metrics.jsonl'))
  accuracy = [m['accuracy'] for m in metrics if m.get('agent') == 'verifier' and 'accuracy' in m]
  # From near 0 to 0.8-0.9 in 25 steps: it rises by far more than the noise of a 64-row
  # batch.
  first, last = np.mean(accuracy[:3]), np.mean(accuracy[-3:])
  assert first < 0.1 and last > first + 0.4, accuracy
  # The sampler serves base + adapters: on-policy rows have the trainer's logprobs.
  on_policy = [m['ratio_dev'] for m in metrics if m.get('staleness_max') == 0 and 'ratio_dev' in m]
  assert on_policy and max(on_policy) < 1e-4, on_policy
  for index, name in enumerate(config.agents):  # trainer seeds: seed * 1000 + index
    cfg, trained, _ = _run_model(workdir, name, LORA_STEPS)
    start = _params(cfg, seed=config.seed * 1000 + index)[1]
    # The checkpoint holds the adapters only (the base is shared, never saved), trained.
    assert lora.partition(trained, cfg.lora)[1] == {}
    assert not _equal(trained, lora.partition(start, cfg.lora)[0])


def test_export_writes_merged_weights_and_a_peft_adapter(lora_run, tmp_path):
  workdir, _ = lora_run
  out = export(workdir, 'verifier', str(tmp_path / 'hf'))
  cfg, _, base_params = _run_model(workdir, 'verifier', LORA_STEPS)
  weights = load_file(os.path.join(out, 'model.safetensors'))
  base = dict(hf.hf_weights(dataclasses.replace(cfg, lora=LoRAConfig()), base_params))
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


@pytest.mark.extra('vllm')  # peft, torch, transformers
def test_peft_loads_the_adapter(lora_run, tmp_path):
  import torch
  import transformers
  from peft import PeftModel
  workdir, _ = lora_run
  out = export(workdir, 'verifier', str(tmp_path / 'hf'))
  cfg, adapters, base = _run_model(workdir, 'verifier', LORA_STEPS)
  params = lora.combine(adapters, base)
  base_dir = hf.save_hf(dataclasses.replace(cfg, lora=LoRAConfig()), base,
                        str(tmp_path / 'base'))
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


def test_agents_of_one_base_share_one_copy_per_device_group(tmp_path):
  """Three LoRA agents on one base: one copy per mesh, referenced by each; states hold
  adapters; training and swaps leave the base bit-identical; a full agent beside them
  trains as ever."""
  cfg = ModelConfig(vocab_size=20, layers=1, lora=LoRAConfig(rank=4, alpha=8.0))
  base = shared_base.SharedBase(shared_base.load_base(cfg, '', seed=7))
  mesh_a = sharding.make_mesh(jax.devices()[:2], (2, 1))
  mesh_b = sharding.make_mesh(jax.devices()[2:4], (2, 1))
  opt = OptimizerConfig(learning_rate=1e-2)
  make = lambda name, mesh, seed, model=cfg, shared=base: AgentTrainer(
      name, model, opt, grpo.GRPOConfig(), mesh, seed=seed, base=shared)
  a, b, c = make('a', mesh_a, 1), make('b', mesh_a, 2), make('c', mesh_b, 3)
  full = make('full', sharding.make_mesh(jax.devices()[4:6], (2, 1)), 4,
              dataclasses.replace(cfg, lora=LoRAConfig()), None)
  base0 = _params(dataclasses.replace(cfg, lora=LoRAConfig()), seed=7)[1]
  frozen = lambda t: lora.partition(t.params, cfg.lora)[1]
  assert all(x is y for x, y in zip(jax.tree.leaves(frozen(a)), jax.tree.leaves(frozen(b))))
  assert base.nbytes == sum(x.nbytes for x in jax.tree.leaves(base0))
  assert a.state.nbytes == sizing.state_nbytes(cfg, opt, grpo.GRPOConfig()) < base.nbytes
  full0 = jax.device_get(full.params)
  for t in (a, b, c, full):
    t.accumulate(_batch(0, multiple=t.batch_multiple))
    t.apply()
  assert not _equal(jax.device_get(full.params), full0)
  assert len(base.groups) == 2  # one copy per mesh, made when an agent there first used it
  # a swap to storage and onto the other mesh moves adapters only, onto that mesh's copy
  adapters = jax.device_get(a.state.params)
  assert a.release(InStorage(str(tmp_path / 'swap'))).bytes == a.state.nbytes
  a.bind(mesh_b)
  assert _equal(jax.device_get(a.state.params), adapters) and len(base.groups) == 2
  assert all(x is y for x, y in zip(jax.tree.leaves(frozen(a)), jax.tree.leaves(frozen(c))))
  for t in (a, b, c):
    assert _equal(jax.device_get(frozen(t)), base0)
  assert not _equal(jax.device_get(a.state.params), jax.device_get(b.state.params))


def test_a_built_team_shares_its_base_and_says_what_it_holds(tmp_path):
  c = _lora_team(steps=2)
  c.agents.critic = agent_config('tiny', group_size=2, global_batch=8, micro_batch=8)
  spec = build_team_spec(c, 20, list(range(8)), ['solver', 'verifier'])
  text = memory.describe_memory(spec.agents, spec.placement)
  assert 'shared by solver, verifier' in text and 'critic' in text and '(full model)' in text
  orchestrator = build(_lora_team(steps=2), str(tmp_path / 'run'), log=lambda *_: None)
  solver, verifier = (orchestrator.agents[n].trainer for n in ('solver', 'verifier'))
  assert solver.base is verifier.base
  assert lora.partition(solver.state.params, spec.agents['solver'].model.lora)[1] == {}


@pytest.mark.parametrize('rows', [[0, 1, 2, 2, 1, 0, 1], [2, 2, 2]])
def test_one_instance_serves_three_agents_adapters_as_dedicated_ones(rows):
  cfg = ModelConfig(vocab_size=24, layers=2, lora=LoRAConfig(rank=4, alpha=8.0))
  graphdef, params = _params(cfg)
  adapters, base = lora.partition(params, cfg.lora)
  agents = [_with_random_b(adapters, seed=s) for s in (1, 2, 3)]
  # each agent's own A too (else all three start from the seed's)
  agents = [jax.tree.map(lambda x, s=s: x * (1 + s) if x.ndim > 1 else x, ad)
            for s, ad in enumerate(agents)]
  shared = EmbeddedSampler(graphdef, lora.combine(lora.stack(agents), base), max_prompt_len=6,
                           eos_id=2, pad_id=0, adapters=3)
  prompts = [[1, 5, 6, 7], [1, 9], [1, 3, 4, 5, 6, 8], [1, 4], [1, 7, 7], [1, 3], [1, 9, 9]]
  prompts = prompts[:len(rows)]
  keys = np.stack([sample_key(0, 'x', 0, str(i)) for i in range(len(rows))])
  sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=5)
  out = shared.generate(prompts, keys, sampling, adapter_rows=np.array(rows))
  for k, ad in enumerate(agents):
    own = [i for i, r in enumerate(rows) if r == k]
    if not own:
      continue
    dedicated = EmbeddedSampler(graphdef, lora.combine(ad, base), max_prompt_len=6, eos_id=2,
                                pad_id=0).generate([prompts[i] for i in own], keys[own], sampling)
    np.testing.assert_array_equal(out.tokens[own], dedicated.tokens)
    np.testing.assert_array_equal(out.lengths[own], dedicated.lengths)
    np.testing.assert_allclose(out.logprobs[own], dedicated.logprobs, atol=1e-5)
  with pytest.raises(ValueError, match=r'adapter_rows=\[3\].*\[0, 3\)'):
    shared.generate(prompts[:1], keys[:1], sampling, adapter_rows=np.array([3]))


def test_agents_adapters_differ_per_row():
  """Same prompt and key, three adapters: the logprobs differ (the rows' adapters are used)."""
  cfg = ModelConfig(vocab_size=24, layers=1, lora=LoRAConfig(rank=4, alpha=8.0))
  graphdef, params = _params(cfg)
  adapters, base = lora.partition(params, cfg.lora)
  agents = [_with_random_b(adapters, seed=s) for s in (1, 2, 3)]
  shared = EmbeddedSampler(graphdef, lora.combine(lora.stack(agents), base), max_prompt_len=6,
                           eos_id=2, pad_id=0, adapters=3)
  key = sample_key(0, 'x', 0, '0')
  out = shared.generate([[1, 5, 6]] * 3, np.stack([key] * 3),
                        SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=1),
                        adapter_rows=np.array([0, 1, 2]))
  assert len({float(x) for x in out.logprobs[:, 0]}) == 3, out.logprobs


def test_peft_import_round_trips_exactly(tmp_path):
  cfg = ModelConfig(vocab_size=20, layers=2, lora=LoRAConfig(rank=4, alpha=8.0,
                                                             targets=('q', 'o', 'down')))
  trained = _with_random_b(_params(cfg)[1])
  folder = peft.save_peft(cfg, trained, str(tmp_path / 'adapter'))
  assert peft.peft_lora_config(folder) == cfg.lora
  adapters = lora.partition(trained, cfg.lora)[0]
  assert _equal(peft.load_peft(folder, cfg), jax.device_get(adapters))
  # an agent started from the folder trains from those adapters, over its base
  base = shared_base.SharedBase(shared_base.load_base(cfg, '', seed=0))
  t = AgentTrainer('a', cfg, OptimizerConfig(), grpo.GRPOConfig(), sharding.layout((1, 1)),
                   seed=5, init_params=peft.load_peft(folder, cfg), base=base)
  assert _equal(jax.device_get(t.params), jax.device_get(trained))
  # the config names the folder; a rank or target set that is not the folder's is refused
  c = two_agent_config(steps=2)
  c.agents.solver.model.lora = dict(rank=4, alpha=8.0, targets=('down', 'q', 'o'))
  c.agents.solver.model.adapter = folder
  assert build_team_spec(c, 20, list(range(8)), ['solver', 'verifier']).agents[
      'solver'].adapter == folder
  c.agents.solver.model.lora = dict(rank=8, alpha=8.0, targets=('down', 'q', 'o'))
  with pytest.raises(ConfigError, match=r"agents.solver.model.lora=.*'rank': 8.*'rank': 4"):
    build_team_spec(c, 20, list(range(8)), ['solver', 'verifier'])


@pytest.mark.parametrize('model, needles', [
    (dict(base_seed=-2), ['agents.solver.model.base_seed=-2', '>= -1']),
    (dict(adapter='/nowhere'), ['agents.solver.model.adapter', 'lora (rank > 0)']),
    (dict(adapter='/nowhere', lora=dict(rank=4)), ['adapter=\'/nowhere\'',
                                                    'adapter_config.json']),
])
def test_bad_base_and_adapter_configs_are_refused(model, needles):
  c = two_agent_config(steps=2)
  c.agents.solver.model.update(model)
  with pytest.raises(ConfigError) as err:
    build_team_spec(c, 20, list(range(8)), ['solver', 'verifier'])
  for needle in needles:
    assert needle in str(err.value), str(err.value)


def test_a_resumed_lora_team_is_the_uninterrupted_one(tmp_path):
  """A LoRA solver beside a full verifier, stopped at its step-2 checkpoint and resumed, ends
  where the uninterrupted run ends: metrics lines and parameters (the checkpoints hold the
  adapters only, and the resumed run rebuilds the same frozen base from its seed)."""
  config = two_agent_config(steps=4)
  config.schedule, config.checkpoint_every = 'flexmarl', 2
  config.agents.solver.model.lora = dict(rank=8, alpha=16.0, targets=('q', 'v', 'up'))
  straight, resumed = str(tmp_path / 'straight'), str(tmp_path / 'resumed')
  train(config, straight, log=lambda *_: None)
  config.steps = 2
  train(config, resumed, log=lambda *_: None)
  config.steps = 4
  logs = []
  train(config, resumed, log=logs.append)
  assert any('resumed from step 2' in str(l) for l in logs)
  assert_same_run(straight, resumed, 4)
