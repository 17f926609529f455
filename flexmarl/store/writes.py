"""Writing one table: appending a batch past the committed end, and rewriting status rows
(the commit protocol these follow is in experience_store.py)."""

from __future__ import annotations

import numpy as np

from flexmarl.store.layout import (
    BIT, FLAT_CAPACITY, INDEX_COLS, IX, ROW_CAPACITY, SETTABLE_FIELDS, STATUS_COL, Commit, Table)
from flexmarl.store.rows import Prepared


def write_tail(table: Table, new: list[Prepared]) -> Commit:
  """Writes `new` past the committed end of every array; returns the commit that names them
  (not yet published)."""
  old = table.commit
  index = np.zeros((len(new), len(INDEX_COLS)), np.int64)
  data = {}
  sample_id_bytes = [np.frombuffer(p.sample_id_bytes, np.uint8) for p in new]
  for name, start_col, values in (
      ('sample_ids', 'sample_id_start', sample_id_bytes),
      ('prompt_ids', 'prompt_start', [p.prompt_ids for p in new]),
      ('response_ids', 'response_start', [p.response_ids for p in new])):
    lengths = np.array([len(v) for v in values], np.int64)
    index[:, IX[start_col]] = getattr(old, name) + np.cumsum(lengths) - lengths
    index[:, IX[start_col] + 1] = lengths
    data[name] = np.concatenate(values)
  data['logprobs'] = np.concatenate([p.logprobs for p in new])
  index[:, IX['policy_version']] = [p.policy_version for p in new]
  status = np.zeros((len(new), len(STATUS_COL)), np.uint32)
  status[:, 0] = BIT['tokens'] | BIT['logprobs']
  for field in SETTABLE_FIELDS:
    values = [getattr(p, field) for p in new]
    known = np.array([v is not None for v in values])
    status[known, 0] |= BIT[field]
    status[known, STATUS_COL[field]] = np.array(
        [v for v in values if v is not None], np.float32).view(np.uint32)
  commit = Commit(rows=old.rows + len(new),
                  sample_ids=old.sample_ids + len(data['sample_ids']),
                  prompt_ids=old.prompt_ids + len(data['prompt_ids']),
                  response_ids=old.response_ids + len(data['response_ids']), first=old.first)
  if commit.rows > ROW_CAPACITY or max(commit.sample_ids, commit.prompt_ids,
                                        commit.response_ids) > FLAT_CAPACITY:
    raise ValueError(f'table {table.agent!r} is full ({commit}); start a new store location')
  arrays = table.arrays
  flat_start = {'sample_ids': old.sample_ids, 'prompt_ids': old.prompt_ids,
                'response_ids': old.response_ids, 'logprobs': old.response_ids}
  writes = [arrays[name][start:start + len(data[name])].write(data[name])
            for name, start in flat_start.items()]
  writes.append(arrays['index'][old.rows:commit.rows].write(index))
  writes.append(arrays['status'][old.rows:commit.rows].write(status))
  for write in writes:  # all durable before the commit names them
    write.result()
  return commit


def update_status(table: Table, rows: np.ndarray, *, set_bits: int = 0, clear_bits: int = 0,
                  column: int | None = None, values: np.ndarray | None = None) -> None:
  """Read-modify-write of whole status rows, so each row's flags and value land together."""
  if not len(rows):
    return
  status = table.arrays['status']
  current = status[rows].read().result()
  current[:, 0] = (current[:, 0] | set_bits) & ~np.uint32(clear_bits)
  if column is not None:
    current[:, column] = values.astype(np.float32).view(np.uint32)
  status[rows].write(current).result()
