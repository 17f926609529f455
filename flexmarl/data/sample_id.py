"""The id of one sampled response: `{query_id}_{call}_{j}`.

`call` is the index of the `generate` call within its query and `j` the sample's index
within that call's group. Build it with `sample_id` and read it with `parse_sample_id`;
nothing else writes or splits the format. The id is the store's row key and the seed of
the sample's PRNG key, so it must never change for a given (query, call, sample). It sits
at the bottom of the package: the rollout, the store, the workflow checks and the config
all read it.
"""

from __future__ import annotations

import re
from typing import NamedTuple

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
                     'flexmarl.data.sample_id.sample_id(query_id, call, j)')
  return SampleIdParts(match['query_id'], int(match['call']), int(match['j']))
