"""The records that cross parts: what the rollout serves, what one query's run returns,
and the id of one sampled response.

The rollout engine produces them, `data/` turns them into batches, the journal turns
them into store rows and back; all of them import these definitions from here, so no
part depends on another just to read its output.

A sample id names one sampled response: `{query_id}_{call}_{j}`, where `call` is the
index of the `generate` call within its query and `j` the sample's index within that
call's group. Build it with `sample_id` and read it with `parse_sample_id`; nothing else
writes or splits the format. The id is the store's row key and the seed of the sample's
PRNG key, so it must never change for a given (query, call, sample).
"""

from __future__ import annotations

import dataclasses
import re
from typing import NamedTuple

import numpy as np

from flexmarl.workflows.base import Episode, Query

# The query id may itself hold underscores: the last two fields are the call and sample.
_SAMPLE_ID = re.compile(r'(?P<query_id>.+)_(?P<call>\d+)_(?P<j>\d+)')


class SampleIdParts(NamedTuple):
  """A sample id read back: its query, the call within that query, the sample within
  that call's group."""

  query_id: str
  call: int
  j: int


def sample_id(query_id: str, call: int, j: int) -> str:
  """The id of sample `j` of the `call`-th generate call of query `query_id`."""
  return f'{query_id}_{call}_{j}'


def parse_sample_id(sid: str) -> SampleIdParts:
  """The inverse of `sample_id`; raises ValueError for anything it could not have built."""
  match = _SAMPLE_ID.fullmatch(sid) if isinstance(sid, str) else None
  if match is None:
    raise ValueError(f"sample_id={sid!r} is not of the form '{{query_id}}_{{call}}_{{j}}' "
                     '(call and j whole numbers); build it with '
                     'flexmarl.data.records.sample_id(query_id, call, j)')
  return SampleIdParts(match['query_id'], int(match['call']), int(match['j']))


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
