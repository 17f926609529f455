"""Retention: dropping a table's oldest rows, so that a long run's store stays bounded.

Rows are dropped as a prefix: `commit.json` names the first row kept (`first`), and every chunk
that holds only rows below it is deleted. The commit is published before any chunk is deleted,
so a reader, or a store reopened after a crash, never finds a committed row without its data;
a crash in between leaves those chunks on disk (space only, never read). Another process that
reads the table while rows are dropped may find rows it was reading gone.
"""

from __future__ import annotations

import dataclasses

import tensorstore as ts

from flexmarl.store.layout import COMMIT_KEY, FLAT_CHUNK, IX, ROW_CHUNK, Table

_FLAT = {'sample_ids': 'sample_id_start', 'prompt_ids': 'prompt_start',
         'response_ids': 'response_start', 'logprobs': 'response_start'}


def drop_below(table: Table, first: int) -> list[str]:
  """Drops the committed rows below row `first` (rows already dropped stay dropped); returns the
  sample_ids of the rows it dropped."""
  old = table.commit
  first = min(first, old.rows)
  if first <= old.first:
    return []
  dropped = table.read_ids(old.first, first)
  low, high = (_flat_starts(table, row) for row in (old.first, first))
  commit = dataclasses.replace(old, first=first)
  table.kv.write(COMMIT_KEY, commit.to_json()).result()  # the commit point
  table.commit = commit
  keys = [f'{name}/c/{k}/0' for name in ('index', 'status')
          for k in range(old.first // ROW_CHUNK, first // ROW_CHUNK)]
  keys += [f'{name}/c/{k}' for name in _FLAT
           for k in range(low[name] // FLAT_CHUNK, high[name] // FLAT_CHUNK)]
  for future in [table.kv.delete_range(ts.KvStore.KeyRange(key, key + '\0')) for key in keys]:
    future.result()
  return dropped


def _flat_starts(table: Table, row: int) -> dict[str, int]:
  """Where committed row `row` (or, at the committed end, the next row) starts in each flat
  array."""
  if row == table.commit.rows:
    ends = dataclasses.asdict(table.commit)
    return {name: ends['response_ids' if name == 'logprobs' else name] for name in _FLAT}
  index = table.arrays['index'][row].read().result()
  return {name: int(index[IX[col]]) for name, col in _FLAT.items()}
