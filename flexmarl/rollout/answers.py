"""How a sampled row ends: at its stop token or stop string, and nothing after it is kept,
so that what is trained is exactly what was answered."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from flexmarl.models.tokenizer import TextTokenizer


@dataclasses.dataclass(frozen=True)
class Answer:
  """How a sampled row ends: the tokens kept (what is trained), its text, and whether it
  was cut by the token limit rather than ended by a stop token or stop string."""

  length: int
  text: str
  truncated: bool


def finish(tokens: np.ndarray, tokenizer: TextTokenizer, stop: Sequence[str] = ()) -> Answer:
  """End a sampled row where its answer ends: at its stop token (kept, as sampled) or at
  the token that completes the first stop string (kept; the string is left out of the
  text). Tokens after that are dropped: what is trained is exactly what was answered."""
  n = len(tokens)
  ended = n > 0 and int(tokens[-1]) in tokenizer.stop_ids
  if stop:
    for k in range(1, n + 1):
      text = tokenizer.decode(tokens[:k])
      cut = min((text.find(s) for s in stop if s in text), default=-1)
      if cut >= 0:
        return Answer(k, text[:cut], False)
  return Answer(n, tokenizer.decode(tokens), not ended)
