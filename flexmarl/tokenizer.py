"""Tokenizers in the HF `tokenizers` format.

The built-in tasks use a character-level tokenizer that the package builds itself
(no download); any HF tokenizer folder or `tokenizer.json` works for real models.
"""

from __future__ import annotations

import os
import string

from tokenizers import Tokenizer, models, pre_tokenizers, decoders

PAD, BOS, EOS = '<pad>', '<bos>', '<eos>'
# Characters the built-in tasks use; kept in a fixed order so ids never move.
DEFAULT_CHARS = string.digits + string.ascii_lowercase + ' +-*=?:>|<,.'


class CharTokenizer:
  """Thin wrapper over an HF `Tokenizer` with the ids the sampler and trainer need."""

  def __init__(self, tokenizer: Tokenizer):
    self.hf = tokenizer
    vocab = tokenizer.get_vocab()
    for special in (PAD, BOS, EOS):
      if special not in vocab:
        raise ValueError(f'tokenizer has no {special!r} token; FlexMARL needs '
                         f'{PAD!r}, {BOS!r} and {EOS!r} in its vocabulary.')
    self.pad_id, self.bos_id, self.eos_id = vocab[PAD], vocab[BOS], vocab[EOS]
    self.vocab_size = tokenizer.get_vocab_size()

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`, with BOS in front (prompts start with it)."""
    return [self.bos_id] + self.hf.encode(text, add_special_tokens=False).ids

  def decode(self, ids) -> str:
    """Text of response ids, stopping at EOS and skipping padding."""
    out = []
    for i in ids:
      i = int(i)
      if i == self.eos_id:
        break
      if i not in (self.pad_id, self.bos_id):
        out.append(i)
    return self.hf.decode(out, skip_special_tokens=True)

  def save(self, folder: str) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, 'tokenizer.json')
    self.hf.save(path)
    return path


def build_char_tokenizer(chars: str = DEFAULT_CHARS) -> CharTokenizer:
  """A character-level tokenizer: one token per character, specials first."""
  vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, *chars])}
  tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
  tok.pre_tokenizer = pre_tokenizers.Split(pattern='', behavior='isolated')
  tok.decoder = decoders.Fuse()
  tok.add_special_tokens([PAD, BOS, EOS])
  return CharTokenizer(tok)


def load_tokenizer(path: str) -> CharTokenizer:
  """`path`: 'char' for the built-in one, a tokenizer.json, or a folder holding one."""
  if path == 'char':
    return build_char_tokenizer()
  if os.path.isdir(path):
    path = os.path.join(path, 'tokenizer.json')
  if not os.path.exists(path):
    raise FileNotFoundError(
        f'tokenizer={path!r} does not exist: give "char" for the built-in '
        'character tokenizer, or a folder / tokenizer.json in the HF format.')
  return CharTokenizer(Tokenizer.from_file(path))
