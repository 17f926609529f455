"""How rows of different lengths become the fixed shapes a jitted model runs on.

Prompts are right-aligned (padded on the left) so that every row's next token sits in
the same column; batch sizes are rounded up to a few buckets so that a run compiles a
handful of shapes once. The sampler and the trainer lay out their batches with these
same functions.
"""

from __future__ import annotations

import numpy as np


def left_pad(seqs: list[list[int]], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Right-align `seqs` in a [B, length] array; returns (ids, mask)."""
  ids = np.full((len(seqs), length), pad_id, np.int32)
  mask = np.zeros((len(seqs), length), bool)
  for i, s in enumerate(seqs):
    if len(s) > length:
      raise ValueError(f'prompt of {len(s)} tokens exceeds max_prompt_len={length}: '
                       'raise config.max_prompt_len or shorten the prompt.')
    if s:
      ids[i, length - len(s):] = s
      mask[i, length - len(s):] = True
  return ids, mask


def bucket(n: int, multiple: int = 1) -> int:
  """Round a batch size up to a power of two (few distinct shapes → few compiles)."""
  size = 1
  while size < n:
    size *= 2
  return -(-size // multiple) * multiple
