"""Hugging Face Llama / Qwen2 checkpoints in and out of the Flax decoder.

One table (`param_map`) names every parameter on both sides with the pair of pure
functions that convert its layout; import (`load_params`), export (`save_hf`) and
the vLLM weight sync (`hf_weights`) all read it, so the mapping lives in one place.

Import reads safetensors one tensor at a time and puts each onto its own sharding
at once: host memory holds one tensor, never a second copy of the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import importlib.metadata
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from flax import nnx

from flexmarl.core.errors import CheckpointFileError
from flexmarl.models import gguf, lora, source, transformer
from flexmarl.models.transformer import ModelConfig

ARCHITECTURES = {'LlamaForCausalLM': False, 'Qwen2ForCausalLM': True}  # → qkv bias
# Tensors some checkpoints carry that the model recomputes (RoPE tables).
_IGNORED_SUFFIXES = ('rotary_emb.inv_freq',)
_SHARD_BYTES = 2 << 30

Convert = Callable[[Any], Any]


def _fail(hf_dir: str, what: str, fix: str) -> None:
  raise CheckpointFileError(hf_dir, f'{what}; {fix}')


def _read_config(hf_dir: str) -> dict:
  path = os.path.join(hf_dir, 'config.json')
  if not os.path.exists(path):
    _fail(hf_dir, 'no config.json there', 'give a Hugging Face model folder '
          '(config.json + *.safetensors + tokenizer files).')
  with open(path, encoding='utf-8') as f:
    return json.load(f)


def model_config_from_hf(hf_dir: str, dtype: str = 'float32') -> ModelConfig:
  """The decoder's architecture from an HF folder's config.json (Llama or Qwen2), or from
  a GGUF checkpoint's metadata (`models.gguf`)."""
  if source.kind(hf_dir) == source.GGUF:
    return gguf.model_config(hf_dir, dtype)
  c = _read_config(source.local(hf_dir))
  arch = (c.get('architectures') or ['?'])[0]
  if arch not in ARCHITECTURES:
    _fail(hf_dir, f'architecture {arch!r} is not supported',
          f'supported: {sorted(ARCHITECTURES)}.')
  for key, unsupported in (('attention_bias', True), ('mlp_bias', True),
                           ('use_sliding_window', True)):
    if c.get(key) == unsupported:
      _fail(hf_dir, f'config.json sets {key}={unsupported}', 'this model layout is not supported.')
  if c.get('hidden_act', 'silu') != 'silu':
    _fail(hf_dir, f'hidden_act={c["hidden_act"]!r}', 'only SwiGLU (silu) MLPs are supported.')
  # transformers >= 5 moves rope_theta / rope_scaling into `rope_parameters`.
  rope = dict(c.get('rope_parameters') or {})
  theta = rope.pop('rope_theta', c.get('rope_theta', 10000.0))
  scaling = c.get('rope_scaling') or rope
  if scaling.get('rope_type', scaling.get('type', 'default')) == 'default':
    scaling = {}
  try:
    heads = c['num_attention_heads']
    return ModelConfig(
        vocab_size=c['vocab_size'], hidden=c['hidden_size'], layers=c['num_hidden_layers'],
        heads=heads, kv_heads=c.get('num_key_value_heads') or heads,
        head_dim=c.get('head_dim') or c['hidden_size'] // heads, mlp=c['intermediate_size'],
        rope_theta=float(theta), rope_scaling=tuple(sorted(scaling.items())),
        norm_eps=c.get('rms_norm_eps', 1e-6),
        qkv_bias=ARCHITECTURES[arch] or bool(c.get('attention_bias')),
        tie_embeddings=bool(c.get('tie_word_embeddings', False)), dtype=dtype)
  except KeyError as e:
    raise CheckpointFileError(hf_dir, f'config.json lacks {e}; the folder is incomplete: save '
                              'the model again (transformers: save_pretrained).') from None
  except ValueError as e:
    raise CheckpointFileError(hf_dir, str(e)) from None


def hf_config(cfg: ModelConfig, tokenizer=None, max_position_embeddings: int = 32768) -> dict:
  """config.json for `cfg`: Qwen2 when it has q/k/v biases, Llama otherwise."""
  arch = 'Qwen2ForCausalLM' if cfg.qkv_bias else 'LlamaForCausalLM'
  out = dict(
      architectures=[arch], model_type='qwen2' if cfg.qkv_bias else 'llama',
      vocab_size=cfg.vocab_size, hidden_size=cfg.hidden, intermediate_size=cfg.mlp,
      num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
      num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim, hidden_act='silu',
      max_position_embeddings=max_position_embeddings, rms_norm_eps=cfg.norm_eps,
      rope_theta=cfg.rope_theta, rope_scaling=dict(cfg.rope_scaling) or None,
      tie_word_embeddings=cfg.tie_embeddings, torch_dtype=cfg.dtype, attention_bias=False,
      use_sliding_window=False, use_cache=True)
  if tokenizer is not None:
    out.update(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
               pad_token_id=tokenizer.pad_id)
  try:  # as transformers' own save does: without it, transformers >= 5 suspects every
    # local folder of holding an old Mistral tokenizer and warns at load.
    out['transformers_version'] = importlib.metadata.version('transformers')
  except importlib.metadata.PackageNotFoundError:
    pass
  return out


def _heads_in(n: int, d: int) -> Convert:
  """HF [n*d, hidden] → ours [hidden, n, d]."""
  return lambda w: w.T.reshape(w.shape[1], n, d)


def _heads_out(w):
  return w.reshape(w.shape[0], -1).T


def param_map(cfg: ModelConfig) -> list[tuple[tuple, str, Convert, Convert]]:
  """(our pure-dict path, HF name, HF→ours, ours→HF) for every parameter."""
  same = lambda w: w
  transpose = lambda w: w.T
  d = cfg.head_dim
  out = [(('embed',), 'model.embed_tokens.weight', same, same),
         (('norm', 'scale'), 'model.norm.weight', same, same)]
  if not cfg.tie_embeddings:
    out.append((('lm_head',), 'lm_head.weight', transpose, transpose))
  for i in range(cfg.layers):
    b, hf = ('blocks', i), f'model.layers.{i}.'
    out += [
        (b + ('attn_norm', 'scale'), hf + 'input_layernorm.weight', same, same),
        (b + ('mlp_norm', 'scale'), hf + 'post_attention_layernorm.weight', same, same),
        (b + ('attn', 'o'), hf + 'self_attn.o_proj.weight',
         lambda w: w.T.reshape(cfg.heads, d, w.shape[0]), lambda w: w.reshape(-1, w.shape[-1]).T),
        (b + ('mlp', 'gate'), hf + 'mlp.gate_proj.weight', transpose, transpose),
        (b + ('mlp', 'up'), hf + 'mlp.up_proj.weight', transpose, transpose),
        (b + ('mlp', 'down'), hf + 'mlp.down_proj.weight', transpose, transpose),
    ]
    for name, n in (('q', cfg.heads), ('k', cfg.kv_heads), ('v', cfg.kv_heads)):
      out.append((b + ('attn', name), hf + f'self_attn.{name}_proj.weight',
                  _heads_in(n, d), _heads_out))
      if cfg.qkv_bias:
        out.append((b + ('attn', f'{name}_bias'), hf + f'self_attn.{name}_proj.bias',
                    lambda w, n=n: w.reshape(n, d), lambda w: w.reshape(-1)))
  return out


def _get(tree: dict, path: tuple):
  for key in path:
    tree = tree[key]
  return tree


def set_leaf(tree: dict, path: tuple, value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _tensor_files(hf_dir: str) -> dict[str, str]:
  """HF tensor name → the safetensors file holding it."""
  index = os.path.join(hf_dir, 'model.safetensors.index.json')
  if os.path.exists(index):
    with open(index, encoding='utf-8') as f:
      return {k: os.path.join(hf_dir, v) for k, v in json.load(f)['weight_map'].items()}
  from safetensors import safe_open
  files = {}
  for path in sorted(glob.glob(os.path.join(hf_dir, '*.safetensors'))):
    with safe_open(path, framework='numpy') as f:
      files.update({k: path for k in f.keys()})
  if not files:
    _fail(hf_dir, 'no *.safetensors files there', 'export the model with safetensors '
          '(transformers: save_pretrained(..., safe_serialization=True)).')
  return files


def _tensor_reader(checkpoint: str, cfg: ModelConfig, stack: contextlib.ExitStack
                   ) -> dict[str, Callable[[], np.ndarray]]:
  """HF tensor name → a function reading that tensor (HF layout) from the checkpoint: a
  safetensors folder, or a GGUF file dequantized on the way (`models.gguf`)."""
  if source.kind(checkpoint) == source.GGUF:
    return gguf.tensor_reader(checkpoint, cfg)
  from safetensors import safe_open
  handles: dict[str, Any] = {}

  def reader(name: str, path: str) -> Callable[[], np.ndarray]:
    def read():
      if path not in handles:
        handles[path] = stack.enter_context(safe_open(path, framework='numpy'))
      return handles[path].get_tensor(name)
    return read
  return {name: reader(name, path)
          for name, path in _tensor_files(source.local(checkpoint)).items()}


def load_params(hf_dir: str, cfg: ModelConfig, shardings: dict) -> dict:
  """Params (pure dict, `nnx.to_pure_dict` layout) from an HF folder or a GGUF file, each
  tensor read lazily, converted, cast to its leaf's dtype (`cfg.dtype`; the base's
  weights `cfg.weights_dtype`) and put onto its sharding in turn."""
  wanted = param_map(cfg)
  _, abstract = transformer.abstract_model(cfg)
  shapes = nnx.to_pure_dict(abstract)
  params: dict = {}
  with contextlib.ExitStack() as stack:
    files = _tensor_reader(hf_dir, cfg, stack)
    missing = [name for _, name, _, _ in wanted if name not in files]
    if missing:
      _fail(hf_dir, f'tensors missing: {missing[:4]}{" ..." if len(missing) > 4 else ""}',
            'the checkpoint does not hold the model its config describes.')
    used = {name for _, name, _, _ in wanted}
    extra = [k for k in files if k not in used and not k.endswith(_IGNORED_SUFFIXES)
             and not (cfg.tie_embeddings and k == 'lm_head.weight')]
    if extra:
      _fail(hf_dir, f'unexpected tensors {extra[:4]}', 'this model layout is not supported.')
    for path, name, from_hf, _ in wanted:
      raw = files[name]()
      expected = _get(shapes, path).shape
      try:
        value = from_hf(raw).astype(_get(shapes, path).dtype)
      except ValueError:
        value = raw
      if value.shape != expected:
        _fail(hf_dir, f'{name} has shape {raw.shape}, which does not convert to {expected}',
              'config.json and the weights disagree.')
      set_leaf(params, path, jax.device_put(value, _get(shardings, path)))
  return params


def initial_params(cfg: ModelConfig, checkpoint: str, shardings: dict, seed: int) -> dict:
  """An agent's starting params on `shardings`: from its HF checkpoint when it has
  one, else the random initialisation of `Decoder(cfg, Rngs(params=seed))`."""
  if checkpoint:
    return load_params(checkpoint, cfg, shardings)
  state = nnx.state(transformer.Decoder(cfg, nnx.Rngs(params=seed)))
  return jax.device_put(nnx.to_pure_dict(state), shardings)


def hf_weights(cfg: ModelConfig, params: dict, dtype: str | None = None
               ) -> Iterator[tuple[str, np.ndarray]]:
  """(HF name, C-contiguous host array) for every parameter, one at a time (export,
  vLLM weight sync); a LoRA model's adapters merged into its weights. Layouts change
  on the device (XLA transposes far faster than numpy); on a single CPU device the
  host array shares the result's buffer. Default dtype: `cfg.dtype`, what the model
  computes in (a bf16 base under fp32 adapters exports fp32, merged exactly)."""
  params = lora.merged(params, cfg.lora)
  for path, name, _, to_hf in param_map(cfg):
    value = to_hf(_get(params, path))
    yield name, np.asarray(value.astype(dtype or cfg.dtype))


def save_hf(cfg: ModelConfig, params: dict, out_dir: str, tokenizer=None,
            dtype: str | None = None, shard_bytes: int = _SHARD_BYTES) -> str:
  """Write an HF folder (safetensors, config.json, tokenizer) that transformers and
  vLLM load; `dtype` casts the weights (default: as trained). Each file holds at most
  `shard_bytes` (the host holds one file's worth), with an index when there are several."""
  from safetensors.numpy import save_file
  os.makedirs(out_dir, exist_ok=True)
  files: list[list[str]] = []
  shard: dict[str, np.ndarray] = {}

  def flush():
    save_file(shard, os.path.join(out_dir, f'part-{len(files)}.tmp'), metadata={'format': 'pt'})
    files.append(list(shard))
    shard.clear()

  for name, value in hf_weights(cfg, params, dtype):
    if shard and sum(v.nbytes for v in shard.values()) + value.nbytes > shard_bytes:
      flush()
    shard[name] = value
  flush()
  weight_map = {}
  for i, names in enumerate(files):
    file = ('model.safetensors' if len(files) == 1
            else f'model-{i + 1:05d}-of-{len(files):05d}.safetensors')
    os.replace(os.path.join(out_dir, f'part-{i}.tmp'), os.path.join(out_dir, file))
    weight_map.update(dict.fromkeys(names, file))
  if len(files) > 1:
    with open(os.path.join(out_dir, 'model.safetensors.index.json'), 'w', encoding='utf-8') as f:
      json.dump({'metadata': {}, 'weight_map': weight_map}, f, indent=2)
  out_cfg = cfg if dtype is None else dataclasses.replace(cfg, dtype=dtype)
  with open(os.path.join(out_dir, 'config.json'), 'w', encoding='utf-8') as f:
    json.dump(hf_config(out_cfg, tokenizer), f, indent=2)
  if tokenizer is not None:
    tokenizer.save(out_dir)
    with open(os.path.join(out_dir, 'generation_config.json'), 'w', encoding='utf-8') as f:
      json.dump(generation_config(tokenizer), f, indent=2)
  return out_dir


def generation_config(tokenizer) -> dict:
  """generation_config.json: transformers and vLLM stop at every id that ended an answer
  in training, and transformers' `generate` never draws a token the sampler banned
  (`suppress_tokens`; in vLLM, pass them as `SamplingParams(allowed_token_ids=...)`'s
  complement if a served policy might)."""
  out = dict(eos_token_id=list(tokenizer.stop_ids), pad_token_id=tokenizer.pad_id)
  if tokenizer.bos_id is not None:
    out['bos_token_id'] = tokenizer.bos_id
  if tokenizer.banned_ids:
    out['suppress_tokens'] = list(tokenizer.banned_ids)
  return out
