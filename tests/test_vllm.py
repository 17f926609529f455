"""The vLLM rollout instance: logprob parity after weight syncs, per-row seeds, restarts.

One in-process engine (CPU, fp32) serves the whole module. vLLM on CPU needs head
sizes of 32 or more, so the model is the tiny preset with 2 heads of 32.
"""

import dataclasses
import types

import jax
import numpy as np
import pytest
from flax import nnx

pytest.importorskip('vllm', reason='vLLM is not installed (pip install -r requirements-vllm.txt)')

from flexmarl.build import retarget_in_place  # noqa: E402
from flexmarl.core.interfaces import Weights  # noqa: E402
from flexmarl.models import hf  # noqa: E402
from flexmarl.models.tokenizer import build_char_tokenizer  # noqa: E402
from flexmarl.models.transformer import Decoder, ModelConfig  # noqa: E402
from flexmarl.rollout import vllm_weights  # noqa: E402
from flexmarl.rollout.pool import Instance, InstancePool  # noqa: E402
from flexmarl.rollout.sampler import SamplingParams, sample_key  # noqa: E402
from flexmarl.rollout.spec import engine_config  # noqa: E402
from flexmarl.rollout.vllm_engine import cpu_threads, huge_pages_advice, row_seed  # noqa: E402
from flexmarl.rollout.vllm_sampler import VLLMEngineConfig, VLLMSampler  # noqa: E402
from flexmarl.train.batch import TrainBatch  # noqa: E402
from flexmarl.train.loss import response_logprobs  # noqa: E402

TOK = build_char_tokenizer()
CFG = ModelConfig(vocab_size=TOK.vocab_size, heads=2, kv_heads=1, head_dim=32)
PARAMS = SamplingParams(temperature=0.7, top_p=1.0, max_new_tokens=12)
PROMPTS = [TOK.encode(p) for p in ('1+2=', 'abc>', 'sort 31:', 'x', '4*4=', 'dcba', 'q?', '9')]


def _params(seed):
  """Random weights at a scale that makes the policy far from uniform."""
  graphdef, state = nnx.split(Decoder(CFG, nnx.Rngs(params=seed)))
  return graphdef, jax.tree.map(lambda x: x * 2.0, nnx.to_pure_dict(state))


def _keys(version, n=len(PROMPTS)):
  return np.stack([sample_key(0, 'solver', version, f'q{i}_0_0') for i in range(n)])


def _flax_logprobs(graphdef, params, batch):
  rows = TrainBatch.from_rows(
      PROMPTS, [batch.tokens[i, :batch.lengths[i]] for i in range(len(PROMPTS))],
      [batch.logprobs[i, :batch.lengths[i]] for i in range(len(PROMPTS))],
      np.zeros(len(PROMPTS), np.float32), prompt_len=16, response_len=PARAMS.max_new_tokens,
      pad_id=TOK.pad_id)
  logp, _ = response_logprobs(graphdef, params, dataclasses.asdict(rows), PARAMS.temperature)
  return np.asarray(logp)[:len(PROMPTS)], rows.response_mask[:len(PROMPTS)]


@pytest.fixture(scope='module')
def sampler(tmp_path_factory):
  _, params = _params(0)
  np.random.seed(123)
  s = VLLMSampler(CFG, params, workdir=str(tmp_path_factory.mktemp('vllm')), eos_id=TOK.eos_id,
                  pad_id=TOK.pad_id, engine=VLLMEngineConfig(
                      max_model_len=64, kv_cache_bytes=64 << 20, max_num_seqs=16,
                      max_num_batched_tokens=64))
  assert np.random.randint(1 << 30) == np.random.RandomState(123).randint(1 << 30)
  yield s
  s.close()


def test_logprobs_match_flax_after_each_weight_sync(sampler):
  eos_seen = 0
  previous = None
  for version in range(3):
    graphdef, params = _params(version)
    if version:
      sampler.update_weights(params, version)
      assert sampler.in_place  # the copy into the model, not the full reload
      assert sampler.version == version and 0 < sampler.last_sync_s < 5
    batch = sampler.submit(PROMPTS, _keys(version), PARAMS).result()
    ours, mask = _flax_logprobs(graphdef, params, batch)
    assert mask.sum() == batch.lengths.sum() > 0
    np.testing.assert_allclose(batch.logprobs[mask], ours[mask], atol=1e-4, rtol=0, err_msg=f"v{version}")
    for i, n in enumerate(batch.lengths):
      assert (batch.tokens[i, n:] == TOK.pad_id).all()
      assert TOK.eos_id not in batch.tokens[i, :n - 1]  # EOS ends a response, counted in it
      eos_seen += int(batch.tokens[i, n - 1] == TOK.eos_id)
    if previous is not None:  # the new weights are really served
      old_logp, old_mask = _flax_logprobs(graphdef, params, previous)
      assert np.abs(old_logp[old_mask] - previous.logprobs[old_mask]).max() > 0.1
    previous = batch
  assert eos_seen > 0


def test_a_row_does_not_depend_on_its_batch(sampler):
  keys = _keys(7)
  together = sampler.submit(PROMPTS, keys, PARAMS).result()
  for i in (0, 5):
    alone = sampler.submit([PROMPTS[i]], keys[i:i + 1], PARAMS).result()
    np.testing.assert_array_equal(alone.tokens[0], together.tokens[i])
    np.testing.assert_allclose(alone.logprobs[0], together.logprobs[i], atol=1e-5)
  reversed_batch = sampler.submit(PROMPTS[::-1], keys[::-1], PARAMS).result()
  np.testing.assert_array_equal(reversed_batch.tokens[::-1], together.tokens)
  assert len({row_seed(k) for k in keys}) == len(keys)


def test_a_batch_of_long_prompts_samples_each_row_as_alone(sampler):
  """Prompts whose sum overflows a step's token budget (64): none is split across steps
  (a split seeded request failed on CPU: 'CPU Generator does not use offset')."""
  long = [TOK.encode(f'{i}: ' + 'sort 9 3 1 7 5 2 8 4 6 0, then add them up = ')[:40]
          for i in range(6)]
  keys = _keys(8, len(long))
  together = sampler.submit(long, keys, PARAMS).result()
  for i in (0, 3, 5):
    alone = sampler.submit([long[i]], keys[i:i + 1], PARAMS).result()
    np.testing.assert_array_equal(alone.tokens[0], together.tokens[i])
  assert (together.lengths > 0).all()


def test_two_engines_of_one_process_generate_at_once(sampler, tmp_path):
  """Batches submitted to two engines together each get what they get alone (on CPU
  the engines take turns; generating at once corrupted the heap), and closing one
  leaves the other serving (vLLM's shutdown tore down state both use)."""
  other = VLLMSampler(CFG, _params(1)[1], workdir=str(tmp_path), eos_id=TOK.eos_id,
                      pad_id=TOK.pad_id, engine=VLLMEngineConfig(max_model_len=64,
                                                                 kv_cache_bytes=64 << 20))
  try:
    keys = _keys(9)
    alone = [s.submit(PROMPTS, keys, PARAMS).result() for s in (sampler, other)]
    for _ in range(3):
      futures = [s.submit(PROMPTS, keys, PARAMS) for s in (sampler, other) for _ in range(2)]
      for i, f in enumerate(futures):
        np.testing.assert_array_equal(f.result().tokens, alone[i // 2].tokens)
    assert not np.array_equal(alone[0].tokens, alone[1].tokens)
  finally:
    other.close()
  np.testing.assert_array_equal(sampler.submit(PROMPTS, keys, PARAMS).result().tokens,
                                alone[0].tokens)


def test_an_engine_on_cpu_runs_the_configured_torch_threads(sampler):
  """Its torch threads: all cores, or as configured; set on the thread its ops run on,
  past vLLM's no-op torch.set_num_threads."""
  import torch
  assert [cpu_threads(0, cores) for cores in (1, 2, 8)] == [1, 2, 8]
  assert cpu_threads(3, 2) == 3
  assert sampler._pool.submit(torch.get_num_threads).result() == cpu_threads(0)
  with pytest.raises(ValueError, match='cpu_threads'):
    engine_config(cpu_threads=-1)


def test_a_balancer_move_between_agents_of_one_architecture_is_one_weight_sync(sampler):
  """The module's engine moves from agent a to agent b (same model, other weights and
  stop id): no engine start, one weight sync, and then it serves b's policy; an agent of
  another architecture is refused (its pool would start an engine)."""
  graphdef, params_b = _params(5)
  stop_b = 13  # a token b's policy draws in this batch (the draws are seeded)

  def no_engine(devices, weights):
    raise AssertionError('a move between agents of one architecture started an engine')

  class Idle:  # pool a's second instance, so that a may give one away
    version = 0

  a = InstancePool('a', [Instance('a/0', (0,), sampler), Instance('a/1', (1,), Idle())],
                   no_engine, Weights(_params(0)[1], 0))
  tok_b = types.SimpleNamespace(stop_ids=(stop_b,), pad_id=TOK.pad_id, banned_ids=())
  b = InstancePool('b', [], no_engine, Weights(params_b, 4),
                   retarget=retarget_in_place(CFG, tok_b))
  starts, syncs = sampler.starts, sampler.syncs
  moved = a.release()
  assert moved.sampler is sampler
  b.adopt(moved)
  assert (sampler.starts, sampler.syncs, sampler.version) == (starts, syncs + 1, 4)
  batch = sampler.submit(PROMPTS, _keys(4), PARAMS).result()
  ours, mask = _flax_logprobs(graphdef, params_b, batch)
  np.testing.assert_allclose(batch.logprobs[mask], ours[mask], atol=1e-4, rtol=0)
  for i, n in enumerate(batch.lengths):  # b's stop id ends an answer, a's no longer does
    assert stop_b not in batch.tokens[i, :n - 1]
    assert n == PARAMS.max_new_tokens or batch.tokens[i, n - 1] == stop_b
  assert (batch.lengths < PARAMS.max_new_tokens).any()
  assert any(TOK.eos_id in batch.tokens[i, :n - 1] for i, n in enumerate(batch.lengths))
  other = dataclasses.replace(CFG, mlp=2 * CFG.mlp)
  assert not sampler.serve(other, {}, 5, eos_id=TOK.eos_id, pad_id=TOK.pad_id)
  assert (sampler.starts, sampler.syncs, sampler.version) == (starts, syncs + 1, 4)


def test_killed_engine_restarts_with_current_weights_and_serves_pending(sampler):
  keys = _keys(9)
  reference = sampler.submit(PROMPTS, keys, PARAMS).result()
  assert sampler.healthy()
  restarts = sampler.restarts
  sampler.kill()
  assert not sampler.healthy()
  pending = [sampler.submit(PROMPTS, keys, PARAMS), sampler.submit(PROMPTS[:3], keys[:3], PARAMS)]
  first, second = (f.result(timeout=120) for f in pending)
  assert sampler.restarts == restarts + 1 and sampler.healthy()
  np.testing.assert_array_equal(first.tokens, reference.tokens)
  np.testing.assert_array_equal(second.tokens, reference.tokens[:3])
  np.testing.assert_allclose(first.logprobs, reference.logprobs, atol=1e-5)


def test_bad_requests_are_refused_before_the_engine(sampler):
  with pytest.raises(ValueError, match='top_p'):
    sampler.submit(PROMPTS, _keys(0), dataclasses.replace(PARAMS, top_p=0.9))
  with pytest.raises(ValueError, match='max_model_len=64'):
    sampler.submit([[1] * 60], _keys(0, 1), PARAMS)
  with pytest.raises(ValueError, match='model.head_dim=16'):
    VLLMSampler(dataclasses.replace(CFG, heads=4, kv_heads=2, head_dim=16), {}, workdir='unused',
                eos_id=TOK.eos_id, pad_id=TOK.pad_id)


@pytest.mark.parametrize('mode,tunables,advised', [
    ('always madvise [never]', '', False), ('always [madvise] never', '', True),
    ('always [madvise] never', 'glibc.malloc.hugetlb=1', False),
    ('[always] madvise never', '', False)])
def test_a_cpu_host_without_huge_pages_for_malloc_is_told_how_to_get_them(
    tmp_path, monkeypatch, mode, tunables, advised):
  """Only where the kernel gives huge pages on request and glibc was not told to ask."""
  (tmp_path / 'enabled').write_text(mode + '\n')
  monkeypatch.setenv('GLIBC_TUNABLES', tunables)
  advice = huge_pages_advice(str(tmp_path / 'enabled'))
  assert (advice is not None) == advised
  assert advice is None or 'GLIBC_TUNABLES=glibc.malloc.hugetlb=1' in advice
  assert huge_pages_advice(str(tmp_path / 'absent')) is None


def test_training_with_vllm_rollout_survives_a_killed_engine(tmp_path):
  """`rollout.backend=vllm` end to end: agents from an HF checkpoint, rewards in the
  metrics, weights synced after every update; an engine killed mid-run is replaced and
  the store holds every served row exactly once."""
  import importlib
  import os

  from flexmarl.metrics.writer import read_metrics
  from flexmarl.run import build
  from flexmarl.store.experience_store import ExperienceStore
  checkpoint = importlib.import_module('experiments.make_tiny_hf').make(str(tmp_path / 'hf'))
  config = importlib.import_module('experiments.pretrained_vllm').get_config(checkpoint)
  config.steps = config.checkpoint_every = 3
  workdir = str(tmp_path / 'run')
  orch = build(config, workdir, log=lambda *_: None)
  solver = orch.agents['solver'].pool.instances[0].sampler
  orch.run_step()
  solver.kill()
  summary = orch.run(log=lambda *_: None)
  assert solver.restarts == 1
  assert solver.version == orch.agents['solver'].version >= 1
  lines = read_metrics(os.path.join(workdir, 'metrics.jsonl'))
  assert {l['step'] for l in lines} == {2, 3} and summary['agents']['solver']['updates'] >= 1
  assert all(np.isfinite(l['reward_mean']) for l in lines if l['agent'] != 'team')
  with ExperienceStore.open(os.path.join(workdir, 'store'), ['solver', 'verifier']) as store:
    # every consumed query: 8 solver answers, each checked twice by the verifier
    for agent, per_query in (('solver', 8), ('verifier', 16)):
      ids = [r.sample_id for r in store.read(agent)]
      assert len(ids) == len(set(ids)) == per_query * orch.next_query, agent


@pytest.mark.quick
@pytest.mark.parametrize('tied', [True, False])
def test_the_in_place_layout_is_vllms_fusion_of_the_hf_export(tied):
  """What `install` copies into vLLM equals what vLLM's loader builds from our HF export:
  q|k|v and gate|up stacked along the output axis, every other tensor as exported."""
  cfg = dataclasses.replace(CFG, tie_embeddings=tied)
  params = nnx.to_pure_dict(nnx.state(Decoder(cfg, nnx.Rngs(params=3))))
  exported = dict(hf.hf_weights(cfg, params))
  fused = {'qkv_proj': ('q_proj', 'k_proj', 'v_proj'), 'gate_up_proj': ('gate_proj', 'up_proj')}
  ours = {name: np.concatenate(parts) for name, parts in vllm_weights.host_weights(cfg, params)}
  assert {n: a.shape for n, a in ours.items()} == vllm_weights.kernel_shapes(cfg)
  for name, value in ours.items():
    layer, _, kind = name.rpartition('.')  # kind: weight or bias
    parent, _, module = layer.rpartition('.')
    sources = [f'{parent}.{s}.{kind}' for s in fused[module]] if module in fused else [name]
    np.testing.assert_array_equal(value, np.concatenate([exported.pop(s) for s in sources]))
  assert not exported  # every exported tensor is copied
  shapes = vllm_weights.kernel_shapes(cfg)
  assert vllm_weights.mismatch(shapes, shapes) is None
  assert 'shapes differ' in vllm_weights.mismatch(
      shapes, {**shapes, 'model.norm.weight': (cfg.hidden + 1,)})
  assert 'names differ' in vllm_weights.mismatch(shapes, {**shapes, 'model.extra.weight': (1,)})
  assert vllm_weights.mismatch(shapes, shapes, ['quantized']) == 'quantized'
