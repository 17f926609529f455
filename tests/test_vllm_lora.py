"""LoRA agents served by vLLM: logprob parity with the JAX model (base + adapter), adapters
reloaded in place after a publish, and one engine serving several agents' adapters.

Two in-process engines (CPU, fp32): one agent's, and one of three agents' adapters over
their shared base. The model is the tiny preset with 2 heads of 32 (vLLM on CPU needs
head sizes of 32 or more); the adapters leave out k and gate, so vLLM's fused q|k|v and
gate|up layers hold a part without an adapter.
"""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

pytest.importorskip('vllm', reason='vLLM is not installed (pip install -r requirements-vllm.txt)')

from flexmarl.config import ConfigError, build_team_spec  # noqa: E402
from flexmarl.models import lora  # noqa: E402
from flexmarl.models.transformer import Decoder, ModelConfig  # noqa: E402
from flexmarl.rollout import vllm_check  # noqa: E402
from flexmarl.rollout.pool import Instance  # noqa: E402
from flexmarl.rollout.sampler import SamplingParams, sample_key  # noqa: E402
from flexmarl.rollout.vllm_sampler import (VLLMEngineConfig, VLLMSampler,  # noqa: E402
                                           VLLMSharedAdapters)
from flexmarl.models.tokenizer import build_char_tokenizer  # noqa: E402
from flexmarl.train.batch import TrainBatch  # noqa: E402
from flexmarl.train.loss import response_logprobs  # noqa: E402
from test_team import two_agent_config  # noqa: E402

TOK = build_char_tokenizer()
CFG = ModelConfig(vocab_size=TOK.vocab_size, heads=2, kv_heads=1, head_dim=32,
                  lora=lora.LoRAConfig(rank=4, alpha=8.0, targets=('q', 'v', 'o', 'up', 'down')))
PARAMS = SamplingParams(temperature=0.7, top_p=1.0, max_new_tokens=12)
PROMPTS = [TOK.encode(p) for p in ('1+2=', 'abc>', 'sort 31:', 'x', '4*4=', 'dcba', 'q?', '9')]
ENGINE = VLLMEngineConfig(max_model_len=64, kv_cache_bytes=64 << 20)
AGENTS = ('a', 'b', 'c')
ROWS = [AGENTS[i % 3] for i in range(len(PROMPTS))]  # a mixed batch: each agent's rows


def _params(adapter_seed: int, base_seed: int = 0):
  """A LoRA model: a random base (far from uniform) and random adapters (B nonzero)."""
  graphdef, state = nnx.split(Decoder(CFG, nnx.Rngs(params=base_seed)))
  adapters, base = lora.partition(jax.tree.map(lambda x: x * 2.0, nnx.to_pure_dict(state)),
                                  CFG.lora)
  leaves, tree = jax.tree.flatten(adapters)
  keys = jax.random.split(jax.random.key(adapter_seed), len(leaves))
  drawn = [0.2 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
  return graphdef, lora.combine(jax.tree.unflatten(tree, drawn), base)


def _keys(version, n=len(PROMPTS)):
  return np.stack([sample_key(0, 'solver', version, f'q{i}_0_0') for i in range(n)])


def _flax_logprobs(graphdef, params, batch):
  """The JAX model's logprobs of the sampled tokens, and where they are real."""
  n = len(PROMPTS)
  rows = TrainBatch.from_rows(
      PROMPTS, [batch.tokens[i, :batch.lengths[i]] for i in range(n)],
      [batch.logprobs[i, :batch.lengths[i]] for i in range(n)], np.zeros(n, np.float32),
      prompt_len=16, response_len=PARAMS.max_new_tokens, pad_id=TOK.pad_id)
  logp, _ = response_logprobs(graphdef, params, dataclasses.asdict(rows), PARAMS.temperature)
  return np.asarray(logp)[:n], rows.response_mask[:n]


def _assert_served(graphdef, params, batch, rows=slice(None)):
  """`batch`'s logprobs (its `rows`) are those of the JAX model of `params`."""
  ours, mask = _flax_logprobs(graphdef, params, batch)
  mask = mask.copy()
  keep = np.zeros(len(PROMPTS), bool)
  keep[rows] = True
  mask[~keep] = False
  assert mask.sum() > 0
  np.testing.assert_allclose(batch.logprobs[mask], ours[mask], atol=1e-4, rtol=0)


@pytest.fixture(scope='module')
def dedicated(tmp_path_factory):
  s = VLLMSampler(CFG, _params(1)[1], workdir=str(tmp_path_factory.mktemp('vllm_lora')),
                  eos_id=TOK.eos_id, pad_id=TOK.pad_id, engine=ENGINE)
  yield s
  s.close()


@pytest.fixture(scope='module')
def shared(tmp_path_factory):
  from flexmarl.core.interfaces import Weights
  s = VLLMSharedAdapters(CFG, {a: Weights(_params(10 + i)[1], 0) for i, a in enumerate(AGENTS)},
                         workdir=str(tmp_path_factory.mktemp('vllm_shared')), eos_id=TOK.eos_id,
                         pad_id=TOK.pad_id, engine=ENGINE)
  yield s
  s.close()


def test_a_lora_agent_samples_with_its_adapter_and_each_published_one(dedicated):
  graphdef, params = _params(1)
  first = dedicated.submit(PROMPTS, _keys(0), PARAMS).result()
  _assert_served(graphdef, params, first)
  base_only = lora.combine(jax.tree.map(np.zeros_like, lora.partition(params, CFG.lora)[0]),
                           lora.partition(params, CFG.lora)[1])
  base_logp, mask = _flax_logprobs(graphdef, base_only, first)
  assert np.abs(base_logp[mask] - first.logprobs[mask]).max() > 0.1  # the adapter counts

  _, new = _params(2)
  dedicated.update_weights(new, 1)
  assert (dedicated.version, dedicated.syncs, dedicated.starts) == (1, 1, 1)
  assert 0 < dedicated.last_sync_s < 2
  print(f'adapter reload (rank {CFG.lora.rank}): {dedicated.last_sync_s * 1e3:.1f} ms')
  second = dedicated.submit(PROMPTS, _keys(0), PARAMS).result()
  _assert_served(graphdef, new, second)
  old_logp, old_mask = _flax_logprobs(graphdef, params, second)
  assert np.abs(old_logp[old_mask] - second.logprobs[old_mask]).max() > 0.1


def test_a_lora_engine_moves_only_to_an_agent_of_its_base(dedicated):
  """A balancer move to a LoRA agent of the same base is one adapter reload; one of
  another base is refused (the pool then starts an engine for it)."""
  graphdef, same_base = _params(3)
  assert not dedicated.serve(CFG, _params(3, base_seed=1)[1], 5, eos_id=TOK.eos_id,
                             pad_id=TOK.pad_id)
  assert dedicated.version == 1
  assert dedicated.serve(CFG, same_base, 6, eos_id=TOK.eos_id, pad_id=TOK.pad_id)
  assert dedicated.version == 6
  _assert_served(graphdef, same_base, dedicated.submit(PROMPTS, _keys(6), PARAMS).result())


def test_a_killed_lora_engine_restarts_with_the_current_adapter(dedicated):
  reference = dedicated.submit(PROMPTS, _keys(9), PARAMS).result()
  dedicated.kill()
  again = dedicated.submit(PROMPTS, _keys(9), PARAMS).result(timeout=120)
  assert dedicated.restarts == 1
  np.testing.assert_array_equal(again.tokens, reference.tokens)
  np.testing.assert_allclose(again.logprobs, reference.logprobs, atol=1e-5)


def test_one_engine_gives_each_agent_the_rows_of_its_own_adapter(shared):
  assert Instance('a+b+c/0', (0,), shared).shared
  mixed = shared.submit(PROMPTS, _keys(0), PARAMS, ROWS).result()
  for i, agent in enumerate(AGENTS):
    graphdef, params = _params(10 + i)
    _assert_served(graphdef, params, mixed, [r == agent for r in ROWS])
  # a row's sample does not depend on the agents that share its batch
  only_b = [i for i, r in enumerate(ROWS) if r == 'b']
  alone = shared.submit([PROMPTS[i] for i in only_b], _keys(0)[only_b], PARAMS,
                        ['b'] * len(only_b)).result()
  np.testing.assert_array_equal(alone.tokens, mixed.tokens[only_b])
  np.testing.assert_allclose(alone.logprobs, mixed.logprobs[only_b], atol=1e-5)


def test_a_publish_reloads_one_agents_adapter_only(shared):
  before = shared.submit(PROMPTS, _keys(0), PARAMS, ROWS).result()
  graphdef, new_b = _params(20)
  shared.update_adapter('b', new_b, 1)
  assert [shared.version_of(a) for a in AGENTS] == [0, 1, 0]
  after = shared.submit(PROMPTS, _keys(0), PARAMS, ROWS).result()
  is_b = np.array([r == 'b' for r in ROWS])
  _assert_served(graphdef, new_b, after, is_b)
  np.testing.assert_array_equal(after.tokens[~is_b], before.tokens[~is_b])
  assert not np.array_equal(after.tokens[is_b], before.tokens[is_b])
  with pytest.raises(ValueError, match=r"agents: give one of \['a', 'b', 'c'\]"):
    shared.submit(PROMPTS, _keys(0), PARAMS, ['a'] * (len(PROMPTS) - 1) + ['z'])


TOP_RANK = max(vllm_check.lora_ranks())


@pytest.mark.quick
@pytest.mark.parametrize('change, needles', [
    (dict(lora=dict(rank=8), head_dim=32, heads=2), None),  # served: accepted
    (dict(lora=dict(rank=TOP_RANK + 1), head_dim=32, heads=2),
     [f'agents.solver.model.lora.rank={TOP_RANK + 1}', f'rank up to {TOP_RANK}',
      'rollout.backend=embedded']),
])
def test_config_refuses_only_what_vllm_cannot_serve(change, needles):
  c = two_agent_config(steps=2)
  c.rollout.backend = 'vllm'
  for name in ('solver', 'verifier'):
    for key, value in change.items():
      setattr(c.agents[name].model, key, value)
  if needles is None:
    spec = build_team_spec(c, 20, list(range(8)), ['solver', 'verifier'])
    assert spec.agents['solver'].model.lora.rank == 8
    return
  with pytest.raises(ConfigError) as err:
    build_team_spec(c, 20, list(range(8)), ['solver', 'verifier'])
  for needle in needles:
    assert needle in str(err.value), str(err.value)
