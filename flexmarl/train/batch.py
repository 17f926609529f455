"""A micro-batch as the trainer takes it: rows padded to the shapes the steps compile
for, exactly as the sampler laid them out."""

from __future__ import annotations

import dataclasses

import numpy as np

from flexmarl.models.layout import (PROMPT_WIDTH_MULTIPLE, bucket, distinct_prompts, left_pad,
                                    padded_width, response_width)


@dataclasses.dataclass
class TrainBatch:
  """Rows of one micro-batch, host-side. Prompts left-padded to P, responses
  right-padded to T, exactly as the sampler laid them out."""

  prompts: np.ndarray  # [B, P] int32
  prompt_mask: np.ndarray  # [B, P] bool
  responses: np.ndarray  # [B, T] int32
  response_mask: np.ndarray  # [B, T] bool
  behaviour_logprobs: np.ndarray  # [B, T] float32
  advantages: np.ndarray  # [B] float32
  # [B] bool: rows sampled by the very parameters this batch updates. Their behaviour
  # logprobs are taken from the trainer (ratio exactly 1): the sampler's agree only to
  # float rounding, which varies with the shape of the batch it served them in.
  on_policy: np.ndarray
  # [B] float32: the row's share of the entropy bonus (`grpo.entropy_weights`).
  entropy_weight: np.ndarray
  # Each distinct prompt once (`layout.distinct_prompts`): the loss runs a prompt's
  # forward pass once for all its rows. [U, P] int32, [U, P] bool, [B] int32.
  shared_prompts: np.ndarray
  shared_prompt_mask: np.ndarray
  prompt_of_row: np.ndarray

  @classmethod
  def from_rows(cls, prompts: list[list[int]], responses: list[np.ndarray],
                logprobs: list[np.ndarray], advantages: np.ndarray, *, prompt_len: int,
                response_len: int, pad_id: int, batch_multiple: int = 1,
                prompt_width_multiple: int = PROMPT_WIDTH_MULTIPLE,
                on_policy: np.ndarray | None = None,
                entropy_weight: np.ndarray | None = None, min_rows: int = 1) -> 'TrainBatch':
    """Pad `len(prompts)` rows (at least `min_rows`) to a power-of-two batch (padding
    rows are masked out).
    `on_policy`, `entropy_weight` [rows]: see the fields (defaults: every row's behaviour
    logprobs are the sampler's `logprobs`; every row gets the entropy bonus).

    Prompt widths shrink to the longest prompt rounded up to `prompt_width_multiple`
    (capped at `prompt_len`), response widths to the longest response rounded up to 4
    where that saves a good share of the step (`layout.response_width`, else the full
    `response_len`): short answers cost short steps, and the few distinct widths compile
    once each.
    """
    n = len(prompts)
    size = bucket(max(n, min_rows), batch_multiple)
    prompt_len = padded_width(list(map(len, prompts)), prompt_len, prompt_width_multiple)
    ids, pmask = left_pad(list(prompts) + [[]] * (size - n), prompt_len, pad_id)
    shared = distinct_prompts(ids, pmask, n, batch_multiple)
    response_len = response_width(list(map(len, responses)), response_len, size,
                                  shared[0].size)
    resp = np.full((size, response_len), pad_id, np.int32)
    rmask = np.zeros((size, response_len), bool)
    blp = np.zeros((size, response_len), np.float32)
    for i, (r, lp) in enumerate(zip(responses, logprobs)):
      resp[i, :len(r)], rmask[i, :len(r)], blp[i, :len(r)] = r, True, lp
    adv = np.zeros((size,), np.float32)
    adv[:n] = advantages
    same = np.zeros((size,), bool)
    if on_policy is not None:
      same[:n] = on_policy
    weight = np.ones((size,), np.float32)
    if entropy_weight is not None:
      weight[:n] = entropy_weight
    return cls(ids, pmask, resp, rmask, blp, adv, same, weight, *shared)

  def device_arrays(self) -> dict[str, np.ndarray]:
    """The arrays the loss reads (the rows' prompts through `shared_prompts`)."""
    return {k: v for k, v in dataclasses.asdict(self).items() if k != 'prompts'}

  @property
  def tokens(self) -> int:
    return int(self.response_mask.sum())

  @property
  def rows(self) -> int:
    """Real rows (padding rows have no response token)."""
    return int(self.response_mask.any(axis=1).sum())
