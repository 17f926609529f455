"""The character tokenizer with vectorized encode and decode, for the simulator.

A simulated step moves hundreds of thousands of placeholder tokens through the real
rollout engine, which encodes every prompt and decodes every response; the reference
tokenizer does that a token at a time in Python. This one gives the same ids and text
(tests/test_sim_costs.py checks it) with a table lookup.
"""

from __future__ import annotations

import numpy as np

from flexmarl.models.tokenizer import DEFAULT_CHARS, TextTokenizer, build_char_tokenizer


class FastCharTokenizer(TextTokenizer):

  def __init__(self, chars: str = DEFAULT_CHARS):
    ref = build_char_tokenizer(chars)
    super().__init__(ref.hf, alphabet=chars)
    vocab = ref.hf.get_vocab()
    self._ids = np.full(256, -1, np.int64)  # byte -> id (-1: not in the alphabet)
    for c in chars:
      self._ids[ord(c)] = vocab[c]
    self._chars = np.array([''] * self.vocab_size, dtype=object)
    for token, i in vocab.items():  # special tokens show as themselves, as in the reference
      self._chars[i] = token

  def encode(self, text: str) -> list[int]:
    raw = np.frombuffer(text.encode('ascii', errors='replace'), np.uint8)
    ids = self._ids[raw]
    if (ids < 0).any() or len(raw) != len(text):
      return super().encode(text)  # the reference names the character it refuses
    return [self.bos_id, *ids.tolist()]

  def decode(self, ids) -> str:
    ids = np.asarray(ids, np.int64)
    ends = np.flatnonzero(np.isin(ids, self.stop_ids))
    if len(ends):
      ids = ids[:ends[0]]
    return ''.join(self._chars[ids].tolist())
