"""How rows of different lengths become the fixed shapes a jitted model runs on.

Prompts are right-aligned (padded on the left) so that every row's next token sits in
the same column; batch sizes are rounded up to a few buckets so that a run compiles a
handful of shapes once. The sampler and the trainer lay out their batches with these
same functions.
"""

from __future__ import annotations

import numpy as np

# Prompts are padded to a multiple of this many tokens (`config.prompt_width_multiple`'s
# default), by the sampler and the trainer alike: the few widths a workflow's prompts
# take compile once each, and a batch of short prompts does not pay for
# `max_prompt_len` (SmolLM2's chat prompts of 53-72 tokens run at 64 and 80, not 128:
# prefill is most of a short answer's cost).
PROMPT_WIDTH_MULTIPLE = 16


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


def padded_width(lengths: list[int], cap: int, multiple: int) -> int:
  """The width rows of these lengths are padded to: the longest, rounded up to a
  `multiple`, at most `cap` (a longer row is `left_pad`'s error). A step pays for the
  rows it has, not for `cap`; each width is one more program to compile, so `multiple`
  keeps them few."""
  longest = max([1, *lengths])
  return min(cap, -(-longest // multiple) * multiple)


# A micro-batch's responses run at the sampler's full width unless a narrower one saves
# more than this share of the batch's tokens (its prompts' and responses'): every other
# width is one more program to compile, about 10 s for a 135M model's LoRA step on CPU,
# per device it trains on, and short answers' widths (8 or 10 of 10) met one by one
# late in a run cost more in compiles than the few padded tokens did.
FULL_WIDTH_SLACK = 0.125


def response_width(lengths: list[int], cap: int, rows: int, prompt_tokens: int,
                   multiple: int = 4) -> int:
  """The width `rows` responses of these lengths are padded to: `cap` where that adds at
  most `FULL_WIDTH_SLACK` of the batch's tokens (`prompt_tokens` + rows · width), else
  the longest rounded up to `multiple` (`padded_width`)."""
  width = padded_width(lengths, cap, multiple)
  extra = rows * (cap - width)
  return cap if extra <= FULL_WIDTH_SLACK * (prompt_tokens + rows * width) else width


def bucket(n: int, multiple: int = 1) -> int:
  """Round a batch size up to a power of two (few distinct shapes → few compiles)."""
  size = 1
  while size < n:
    size *= 2
  return -(-size // multiple) * multiple


def prompt_bucket(distinct: int, rows: int, multiple: int = 1) -> int:
  """The number of prompt slots for `distinct` prompts in a batch of `rows`: rows/8 (a
  GRPO group of 8 or more per prompt), rows/4 (groups of 4), rows/2, or rows (nothing
  shared), each a multiple of `multiple`. A few shapes a batch size, not one per count:
  every (rows, prompts) pair is a program to compile and keep, and rare pairs met late in
  a long run kept adding compiled programs (about 20 MB of memory each, on CPU). Without
  rows/4, groups of 4 took rows/2 slots: twice the prompt compute of a real model's step,
  where a chat prompt is most of a row."""
  for slots in (rows // 8, rows // 4, rows // 2):
    slots = -(-slots // multiple) * multiple
    if slots >= max(distinct, 1):
      return slots
  return rows


def distinct_prompts(ids: np.ndarray, mask: np.ndarray, rows: int, multiple: int = 1,
                     tags: np.ndarray | None = None
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Each distinct prompt of a laid-out batch once, so that its forward pass runs once
  for all the rows that share it (a GRPO group's rows share their prompt).

  `ids`, `mask` [B, P] as `left_pad` gives them, of which the first `rows` are real.
  Returns (prompts [U, P], their mask [U, P], prompt_of_row [B]): row i's prompt is
  prompts[prompt_of_row[i]]; padding rows point at prompt 0. U is rounded up to B/8, B/4
  or B/2 (`prompt_bucket`); padding prompts are empty. When that leaves nothing to share
  (U would be B), the rows themselves with prompt_of_row = 0..B-1. `tags` [B]: rows with
  different tags never share (e.g. each row's LoRA adapter, which changes the pass).
  """
  size = len(ids)
  keys = np.concatenate([ids[:rows], mask[:rows]], 1)
  if tags is not None:
    keys = np.concatenate([keys, np.asarray(tags)[:rows, None].astype(keys.dtype)], 1)
  distinct, first, of_row = np.unique(keys, axis=0, return_index=True, return_inverse=True)
  count = prompt_bucket(len(distinct), size, multiple)
  if count >= size:
    return ids, mask, np.arange(size, dtype=np.int32)
  prompts = np.zeros((count, ids.shape[1]), ids.dtype)
  prompt_mask = np.zeros((count, ids.shape[1]), bool)
  prompts[:len(first)], prompt_mask[:len(first)] = ids[first], mask[first]
  prompt_of_row = np.zeros((size,), np.int32)
  prompt_of_row[:rows] = of_row.reshape(-1)
  return prompts, prompt_mask, prompt_of_row
