"""The records that cross parts: what the rollout serves and what one query's run returns.

The rollout engine produces them, `data/` turns them into batches, the journal turns
them into store rows and back; all of them import these definitions from here, so no
part depends on another just to read its output. Each sampled response in them is
named by its sample id (`flexmarl/data/sample_id.py`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from flexmarl.workflows.base import Episode, Query


@dataclasses.dataclass
class ServedGroup:
  """One served generate call: a GRPO group of `len(tokens)` samples of one prompt,
  all drawn at one policy version."""

  query_id: str
  call: int  # the call's index within its query (the middle field of its sample ids)
  agent: str
  version: int
  prompt_ids: list[int]
  sample_ids: list[str]
  tokens: list[np.ndarray]  # each: response ids incl. EOS, unpadded
  logprobs: list[np.ndarray]


@dataclasses.dataclass
class EpisodeResult:
  """One query's finished, checked run: every group it was served, and its scores."""

  query: Query
  index: int  # position of the query in the run's stream
  served: list[ServedGroup]  # in call order
  episode: Episode
  started: float = 0.0  # clock time the query was admitted
  finished: float = 0.0  # clock time its workflow returned
  skipped: bool = False  # consumed without running: no agent's batch took its rows
