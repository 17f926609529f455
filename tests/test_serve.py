"""What you train is what you serve: a trained agent, exported, answers in transformers
and vLLM exactly as FlexMARL's sampler does, with the exported tokenizer's own call."""

import asyncio
import dataclasses
import json
import os

import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx

from flexmarl import tasks
from flexmarl.agent import check_served_logprobs
from flexmarl.config import agent_config, rollout_config
from flexmarl.data.sample_id import parse_sample_id
from flexmarl.export import export
from flexmarl.models import hf, transformer
from flexmarl.models.tokenizer import BOS, build_char_tokenizer, load_tokenizer
from flexmarl.rollout.answers import Answer, finish
from flexmarl.rollout.engine import RolloutEngine
from flexmarl.rollout.pool import Instance, InstancePool
from flexmarl.rollout.sampler import EmbeddedSampler, SamplingParams
from flexmarl.run import train
from flexmarl.train.batch import TrainBatch
from flexmarl.train.loss import response_logprobs
from flexmarl.workflows.base import Episode, Query

torch = pytest.importorskip('torch', reason='serving tests need torch (requirements-vllm.txt)')
transformers = pytest.importorskip('transformers', reason='serving tests need transformers')

TOK = build_char_tokenizer()
MAX_NEW = 4


def _config(checkpoint: str, steps: int) -> ml_collections.ConfigDict:
  """A solver of `a+b` started from an HF checkpoint, with the checkpoint's tokenizer."""
  c = ml_collections.ConfigDict()
  c.seed, c.steps, c.schedule, c.tokenizer = 0, steps, 'sync', checkpoint
  c.max_prompt_len, c.checkpoint_every = 8, steps
  c.workflow = dict(name='single_task', agent='solver', family='add',
                    task_args={'max_operand': 2})
  c.rollout = rollout_config(query_concurrency=8, max_step_queries=8)
  c.agents = dict(solver=agent_config(
      'tiny', group_size=8, global_batch=64, micro_batch=64,
      model=dict(checkpoint=checkpoint),
      sampling=dict(temperature=1.0, top_p=1.0, max_new_tokens=MAX_NEW)))
  return c


@pytest.fixture(scope='module')
def exported(tmp_path_factory):
  """A solver trained until it ends its answers with EOS, exported as an HF folder."""
  from experiments import make_tiny_hf  # vLLM's CPU attention needs its 32-wide heads
  base = make_tiny_hf.make(str(tmp_path_factory.mktemp('base')))
  workdir = str(tmp_path_factory.mktemp('serve'))
  train(_config(base, steps=120), workdir, log=lambda *_: None)
  return export(workdir, 'solver', os.path.join(workdir, 'hf'))


def _prompts():
  rng = np.random.default_rng(1)
  return sorted({tasks.add(rng, max_operand=2).prompt + '=' for _ in range(60)})


def _flexmarl_greedy(folder, prompts):
  """Greedy answers of FlexMARL's own sampler on the exported weights."""
  tok = load_tokenizer(folder)
  cfg = hf.model_config_from_hf(folder)
  graphdef, abstract = transformer.abstract_model(cfg)
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  params = hf.load_params(folder, cfg,
                          jax.tree.map(lambda _: one, nnx.to_pure_dict(abstract)))
  sampler = EmbeddedSampler(graphdef, params, max_prompt_len=8, eos_id=tok.stop_ids,
                            pad_id=tok.pad_id, banned_ids=tok.banned_ids)
  out = sampler.generate([tok.encode(p) for p in prompts],
                         np.zeros((len(prompts), 2), np.uint32),
                         SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW))
  return [out.tokens[i, :out.lengths[i]].tolist() for i in range(len(prompts))]


def test_exported_folder_encodes_and_stops_as_training(exported):
  served = transformers.AutoTokenizer.from_pretrained(exported)
  for prompt in _prompts():
    assert served(prompt)['input_ids'] == TOK.encode(prompt)
    assert served(prompt)['input_ids'][0] == TOK.bos_id
  generation = json.loads(open(os.path.join(exported, 'generation_config.json')).read())
  assert generation['eos_token_id'] == [TOK.eos_id]
  assert sorted(generation['suppress_tokens']) == sorted([TOK.bos_id, TOK.pad_id])


def test_transformers_answers_as_the_sampler_did(exported):
  prompts = _prompts()
  ours = _flexmarl_greedy(exported, prompts)
  tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
  model = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
  for prompt, expected in zip(prompts, ours):
    enc = tokenizer(prompt, return_tensors='pt')  # the folder's own call, BOS and all
    out = model.generate(**enc, max_new_tokens=MAX_NEW, do_sample=False)
    answer = out[0, enc['input_ids'].shape[1]:].tolist()
    assert answer == expected, prompt
    assert answer[-1] == TOK.eos_id, (prompt, answer)  # the policy learned to stop


@pytest.mark.extra('vllm')
def test_vllm_answers_as_the_sampler_did(exported, tmp_path):
  for key, value in {'VLLM_ENABLE_V1_MULTIPROCESSING': '0', 'TMPDIR': str(tmp_path),
                     'VLLM_CACHE_ROOT': str(tmp_path / 'vllm'),
                     'TORCHINDUCTOR_CACHE_DIR': str(tmp_path / 'inductor')}.items():
    os.environ[key] = value  # restored by the process exiting; pytest runs one module at a time
  from vllm import LLM, SamplingParams as VParams
  prompts = _prompts()
  ours = _flexmarl_greedy(exported, prompts)
  llm = LLM(model=exported, dtype='float32', max_model_len=64, enforce_eager=True,
            kv_cache_memory_bytes=1 << 26, seed=0)
  try:
    outs = llm.generate(prompts, VParams(temperature=0.0, max_tokens=MAX_NEW), use_tqdm=False)
  finally:
    llm.llm_engine.engine_core.shutdown()
  for prompt, expected, out in zip(prompts, ours, outs):
    assert out.prompt_token_ids == TOK.encode(prompt)
    assert list(out.outputs[0].token_ids) == expected, prompt
    assert out.outputs[0].finish_reason == 'stop'


def _bos_loving_model():
  """A model whose most likely next token is BOS everywhere (untied head, BOS column
  raised): a sampler that could draw BOS would."""
  cfg = transformer.ModelConfig(**transformer.PRESETS['tiny'], vocab_size=TOK.vocab_size,
                                tie_embeddings=False)
  graphdef, state = nnx.split(transformer.Decoder(cfg, nnx.Rngs(params=0)))
  params = nnx.to_pure_dict(state)
  params['lm_head'] = params['lm_head'].at[:, TOK.bos_id].add(50.0)
  return graphdef, params


def test_banned_tokens_are_never_sampled_and_logprobs_match_the_trainer():
  graphdef, params = _bos_loving_model()
  prompts = [TOK.encode(p) for p in ('1+2=', '2+2=', 'ab>')] * 8
  keys = np.stack([np.array([i, 7], np.uint32) for i in range(len(prompts))])
  sp = SamplingParams(temperature=0.8, max_new_tokens=6)
  free = EmbeddedSampler(graphdef, params, max_prompt_len=8, eos_id=TOK.eos_id,
                         pad_id=TOK.pad_id).generate(prompts, keys, sp)
  assert (free.tokens == TOK.bos_id).any()  # the model left alone says BOS
  out = EmbeddedSampler(graphdef, params, max_prompt_len=8, eos_id=TOK.eos_id, pad_id=TOK.pad_id,
                        banned_ids=TOK.banned_ids).generate(prompts, keys, sp)
  drawn = np.concatenate([out.tokens[i, :out.lengths[i]] for i in range(len(prompts))])
  assert not np.isin(drawn, TOK.banned_ids).any()
  kept = range(len(prompts))
  rows = TrainBatch.from_rows(prompts, [out.tokens[i, :out.lengths[i]] for i in kept],
                              [out.logprobs[i, :out.lengths[i]] for i in kept],
                              np.zeros(len(prompts)), prompt_len=8, response_len=6,
                              pad_id=TOK.pad_id)
  logp, _ = response_logprobs(graphdef, params, dataclasses.asdict(rows), sp.temperature,
                              TOK.banned_ids)
  np.testing.assert_allclose(np.where(rows.response_mask, logp, 0), rows.behaviour_logprobs,
                             atol=2e-5)
  # Without the ban the trainer would train another distribution: the check says so.
  unbanned, _ = response_logprobs(graphdef, params, dataclasses.asdict(rows), sp.temperature)
  dev = float(np.abs(np.exp(unbanned - rows.behaviour_logprobs) - 1)[rows.response_mask].mean())
  with pytest.raises(RuntimeError, match="agent 'a'.*differ from the sampler"):
    check_served_logprobs('a', 0, dev)


def test_decode_never_drops_a_token_mid_answer():
  ids = TOK.encode('1')[1:] + [TOK.bos_id] + TOK.encode('2')[1:] + [TOK.eos_id, TOK.pad_id]
  assert TOK.decode(ids) == f'1{BOS}2'


@pytest.mark.quick
def test_finish_marks_truncation_and_cuts_at_stop_strings():
  ids = lambda text: np.array(TOK.encode(text)[1:], np.int32)
  ended = np.append(ids('12'), TOK.eos_id)
  assert finish(ended, TOK) == Answer(3, '12', False)
  assert finish(ids('1234'), TOK) == Answer(4, '1234', True)
  # Stop at the first stop string: the token that completes it is kept (it was sampled),
  # the string is left out of the text, and nothing after it is trained on.
  assert finish(ids('12:34'), TOK, (':', '4')) == Answer(3, '12', False)
  assert finish(ids('1234'), TOK, ('34',)) == Answer(4, '12', False)


class _Asks:
  """One query asks the agent three ways: the default cap, a shorter cap, a stop string."""

  def agent_names(self):
    return ['a']

  async def run(self, query, agents):
    ep = Episode()
    calls = await asyncio.gather(agents['a'].generate('1+2='),
                                 agents['a'].generate('1+2=', max_new_tokens=2),
                                 agents['a'].generate('1+2=', stop=['1']))
    self.calls = calls
    for group in calls:
      for c in group:
        ep.score(c, 0.0)
    return ep


def test_generate_takes_a_cap_and_stop_strings_per_call():
  cfg = transformer.ModelConfig(**transformer.PRESETS['tiny'], vocab_size=TOK.vocab_size)
  graphdef, state = nnx.split(transformer.Decoder(cfg, nnx.Rngs(params=0)))
  sampler = EmbeddedSampler(graphdef, nnx.to_pure_dict(state), max_prompt_len=8,
                            eos_id=TOK.eos_id, pad_id=TOK.pad_id, banned_ids=TOK.banned_ids)
  pool = InstancePool('a', [Instance('a/0', (0,), sampler)], None)
  engine = RolloutEngine({'a': pool}, {'a': SamplingParams(max_new_tokens=6)}, {'a': 16},
                         TOK, seed=0)
  workflow = _Asks()
  [result] = engine.run(workflow, [Query('q0', '')])
  full, short, stopped = workflow.calls
  served = {g.call: g for g in result.served}
  assert all(len(t) <= 6 for t in served[0].tokens)
  assert all(len(t) <= 2 for t in served[1].tokens)
  assert any(c.truncated for c in full) and any(c.truncated for c in short)
  for c, t in zip(short, served[1].tokens):  # truncated exactly when no EOS was drawn
    assert c.truncated == (t[-1] != TOK.eos_id)
  assert all('1' not in c.text for c in stopped)
  cut = [c for c in stopped if not c.truncated and TOK.eos_id not in served[2].tokens[
      parse_sample_id(c.sample_id).j]]
  assert cut, 'no answer of the stop-string call reached its stop string'
  for c in cut:  # its tokens end with the one that completed the stop string
    tokens = served[2].tokens[parse_sample_id(c.sample_id).j]
    assert TOK.decode(tokens).endswith('1') and TOK.decode(tokens)[:-1] == c.text
  with pytest.raises(ValueError, match=r'max_new_tokens=7.*\[1, 6\]'):
    engine.run(type('Long', (_Asks,), {'run': lambda self, q, agents: agents['a'].generate(
        '1+2=', max_new_tokens=7)})(), [Query('q1', '')])


def test_each_agent_speaks_through_its_own_tokenizer(tmp_path):
  """A verifier with a tokenizer of its own (other ids for every character): its prompts
  are encoded and its answers decoded by it, the solver's by the team's, and the export
  carries the agent's own."""
  from flexmarl.store.experience_store import ExperienceStore
  from test_team import two_agent_config
  own = build_char_tokenizer(''.join(reversed(TOK.alphabet)))
  own.save(str(tmp_path / 'own'))
  config = two_agent_config(steps=2)
  config.agents.verifier.tokenizer = str(tmp_path / 'own')
  workdir = str(tmp_path / 'run')
  train(config, workdir, log=lambda *_: None)
  store = ExperienceStore.open(os.path.join(workdir, 'store'), agents=['solver', 'verifier'])
  for agent, tokenizer, other in (('solver', TOK, own), ('verifier', own, TOK)):
    rows = store.read(agent)
    assert rows
    for row in rows:
      prompt = tokenizer.decode(row.prompt_ids)
      assert list(row.prompt_ids) == tokenizer.encode(prompt.replace(BOS, ''))
      assert list(row.prompt_ids) != other.encode(prompt.replace(BOS, ''))
  store.close()
  assert load_tokenizer(os.path.join(workdir, 'tokenizers', 'verifier')).encode('1') == \
      own.encode('1')
  assert not os.path.exists(os.path.join(workdir, 'tokenizers', 'solver'))
