"""On-disk layout of one ExperienceStore table: zarr3 specs, the commit record, and opening,
catching up with and validating a table (the protocol is in experience_store.py).

Layout of one table (the folder `{location}/{agent}/`; zarr3 arrays unless noted):

    prompt_ids    int32   [tokens]   every row's prompt, back to back (no padding)
    response_ids  int32   [tokens]   every row's response, back to back
    logprobs      float32 [tokens]   one per response token, laid out like response_ids
    sample_ids    uint8   [bytes]    every row's sample_id in UTF-8, back to back
    index         int64   [rows, 7]  per row: start and length of its sample_id, prompt and
                                     response in the flat arrays, and its policy_version
    status        uint32  [rows, 3]  per row: flag bits, reward and advantage (float32 bits)
    commit.json   (one key)          committed row count and the committed end of each flat array;
                                     with retention, the first row kept (rows below were dropped)

The arrays have a huge fixed shape: zarr keeps only the chunks that were written, so nothing is
ever resized, and `commit.json` alone says how much of each array is valid. Dropping old rows
(retention.py) deletes the chunks that hold only rows below the commit's `first` row.

On local files a write killed half-way leaves a temporary `*.__lock` file next to a chunk; it is
never read, only takes space, and is safe to delete while no writer runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from flexmarl.store.ids import SampleIds

FORMAT = 1
FORMAT_WITH_FIRST = 2  # a table that dropped rows: older versions refuse to open it
READY_FIELDS = ('tokens', 'logprobs', 'reward', 'advantage')
SETTABLE_FIELDS = ('reward', 'advantage')

BIT = {'tokens': 1, 'logprobs': 2, 'reward': 4, 'advantage': 8, 'consumed': 16}
STATUS_COL = {'flags': 0, 'reward': 1, 'advantage': 2}
INDEX_COLS = ('sample_id_start', 'sample_id_len', 'prompt_start', 'prompt_len',
              'response_start', 'response_len', 'policy_version')
IX = {name: i for i, name in enumerate(INDEX_COLS)}
COMMIT_KEY = 'commit.json'
FLAT_CAPACITY = 2**40  # elements per flat array
ROW_CAPACITY = 2**36
ROW_CHUNK = 1024  # rows per chunk of index and status
FLAT_CHUNK = 1 << 14  # elements per chunk of a flat array
_SETTLE_ROWS = 1 << 16  # rows read back per request when a table is reopened
# The file kvstore's default locking ('os') writes a key through `key.__lock` and, in TensorStore
# 0.1.86, does not truncate a stale `key.__lock` left by a killed writer: the next, shorter value
# keeps the old tail and the chunk no longer decodes. Mode 'none' writes each value to a fresh
# temporary file and renames it into place (still atomic), at the price of no
# inter-process write locks, which a single-writer table does not need.
_FILE_LOCKING = {'mode': 'none'}


def _zarr3(dtype: str, shape: Sequence[int], chunk: Sequence[int]) -> dict[str, Any]:
  # Byte shuffle + zstd: the high bytes of token ids are (nearly) all zero, and logprobs of one
  # chunk share few exponents; level 1 keeps appends cheap.
  blosc = {'cname': 'zstd', 'clevel': 1, 'shuffle': 'shuffle',
           'typesize': np.dtype(dtype).itemsize, 'blocksize': 0}
  return {'driver': 'zarr3', 'metadata': {
      'shape': list(shape), 'data_type': dtype,
      'chunk_grid': {'name': 'regular', 'configuration': {'chunk_shape': list(chunk)}},
      'codecs': [{'name': 'bytes', 'configuration': {'endian': 'little'}},
                 {'name': 'blosc', 'configuration': blosc}]}}


_ARRAYS = {
    'sample_ids': _zarr3('uint8', [FLAT_CAPACITY], [FLAT_CHUNK]),
    'prompt_ids': _zarr3('int32', [FLAT_CAPACITY], [FLAT_CHUNK]),
    'response_ids': _zarr3('int32', [FLAT_CAPACITY], [FLAT_CHUNK]),
    'logprobs': _zarr3('float32', [FLAT_CAPACITY], [FLAT_CHUNK]),
    'index': _zarr3('int64', [ROW_CAPACITY, len(INDEX_COLS)], [ROW_CHUNK, len(INDEX_COLS)]),
    'status': _zarr3('uint32', [ROW_CAPACITY, len(STATUS_COL)], [ROW_CHUNK, len(STATUS_COL)]),
}


@dataclasses.dataclass(frozen=True)
class Commit:
  """What `commit.json` publishes: the committed rows and the committed end of each flat array."""

  rows: int = 0
  sample_ids: int = 0  # bytes
  prompt_ids: int = 0  # tokens
  response_ids: int = 0  # tokens; logprobs shares these offsets
  first: int = 0  # rows below were dropped (retention)

  def to_json(self) -> bytes:
    data = dataclasses.asdict(self)
    if not self.first:  # readable by versions from before retention
      del data['first']
      return json.dumps({'format': FORMAT, **data}).encode()
    return json.dumps({'format': FORMAT_WITH_FIRST, **data}).encode()

  @classmethod
  def from_json(cls, raw: bytes, where: str) -> Commit:
    data = json.loads(raw)
    if data.pop('format', None) not in (FORMAT, FORMAT_WITH_FIRST):
      raise ValueError(f'{where}: table format {data.get("format")!r} is not {FORMAT} or '
                       f'{FORMAT_WITH_FIRST}; open it with the FlexMARL version that wrote it')
    return cls(**data)


@dataclasses.dataclass
class Table:
  """One agent's arrays, its last seen commit and where its sample_ids are (ids.py)."""

  agent: str
  kv: ts.KvStore
  arrays: dict[str, ts.TensorStore]
  commit: Commit
  ids: SampleIds

  def read_ids(self, lo: int, hi: int) -> list[str]:
    """The sample_ids of committed rows [lo, hi), read from disk."""
    return self.ids_in(self.arrays['index'][lo:hi].read().result()) if hi > lo else []

  def ids_in(self, index: np.ndarray) -> list[str]:
    """The sample_ids of the consecutive rows whose `index` rows these are."""
    spans = index[:, IX['sample_id_start']:IX['sample_id_len'] + 1]
    first = int(spans[0, 0])
    raw = self.arrays['sample_ids'][first:int(spans[-1].sum())].read().result().tobytes()
    return [raw[a - first:a - first + n].decode() for a, n in spans.tolist()]


def open_kvstore(location: str | os.PathLike | dict | ts.KvStore, fsync: bool) -> ts.KvStore:
  """The root kvstore; local files get file_io_locking mode 'none' (see _FILE_LOCKING)."""
  if isinstance(location, ts.KvStore):
    spec = location.spec().to_json()
    if spec.get('driver') != 'file':
      return location  # e.g. memory: reopening its spec would give a new, empty store
  elif isinstance(location, os.PathLike) or (isinstance(location, str) and '://' not in location):
    spec = {'driver': 'file', 'path': os.path.abspath(location)}
  else:
    spec = ts.KvStore.Spec(location).to_json()
  if spec.get('driver') == 'file':
    spec.setdefault('file_io_locking', _FILE_LOCKING)
    spec.setdefault('file_io_sync', fsync)
  return ts.KvStore.open(spec).result()


def open_table(root: ts.KvStore, agent: str) -> Table:
  """Opens an agent's table, creating it if absent: arrays first, commit.json (0 rows) last."""
  kv = root / f'{agent}/'
  futures = {name: ts.open(spec, kvstore=kv / f'{name}/', create=True, open=True)
             for name, spec in _ARRAYS.items()}
  arrays = {name: future.result() for name, future in futures.items()}
  table = Table(agent, kv, arrays, Commit(), SampleIds())
  if kv.read(COMMIT_KEY).result().state == 'missing':
    kv.write(COMMIT_KEY, Commit().to_json()).result()
  return table  # the caller validates it, then settles its rows (settle_stored)


def settle_stored(table: Table) -> None:
  """Catches up with `commit.json`, the stored rows starting settled (see ids.py), so that
  reopening a long table holds only their hashes."""
  commit = _read_commit(table)
  for lo in range(commit.first, commit.rows, _SETTLE_ROWS):
    table.ids.add_settled(table.read_ids(lo, min(lo + _SETTLE_ROWS, commit.rows)))
  table.commit = commit


_LOST_FIX = ('Fix: restore the store folder from a backup; or start the run over in a new '
             '--workdir (a resume needs the rows its checkpoint carries).')


def _read_commit(table: Table) -> Commit:
  result = table.kv.read(COMMIT_KEY).result()
  if result.state != 'value':
    raise RuntimeError(f'table {table.agent!r} lost its {COMMIT_KEY}; its location was deleted '
                       f'or replaced while open. {_LOST_FIX}')
  try:
    return Commit.from_json(result.value, f'table {table.agent!r}')
  except (json.JSONDecodeError, TypeError, UnicodeDecodeError) as e:
    raise RuntimeError(f'table {table.agent!r}: {COMMIT_KEY} is damaged ({e}). {_LOST_FIX}'
                       ) from None


def refresh_table(table: Table) -> None:
  """Catches up with `commit.json` (rows committed by this or another process)."""
  commit = _read_commit(table)
  have = table.commit.rows
  if commit.rows < have:
    raise RuntimeError(f'table {table.agent!r} shrank from {have} to {commit.rows} rows: '
                       'another writer replaced it; reopen the store')
  have = max(have, commit.first)  # rows another process dropped meanwhile are not read
  if commit.rows > have:
    index = table.arrays['index'][have:commit.rows].read().result()
    if not (index[:, IX['sample_id_len']] > 0).all():
      raise RuntimeError(
          f'table {table.agent!r}: {COMMIT_KEY} claims {commit.rows} rows but rows past '
          f'{have + int(np.argmin(index[:, IX["sample_id_len"]] > 0))} were never written; '
          'another process replaced or damaged it. Fix: reopen the store '
          '(ExperienceStore.open keeps the fully written rows and says what it dropped).')
    table.ids.add(table.ids_in(index), have)
  table.commit = commit


def consistent_commit(commit: Commit, index: np.ndarray, flags: np.ndarray) -> Commit:
  """The longest prefix of `commit`'s rows [first, rows) that was fully written (`index` and
  `flags` of those rows).

  A written row has a non-empty sample_id and the tokens/logprobs flags, and its spans
  follow the previous row's in every flat array, within the committed ends (rows that
  were never written read back as zeros; the first kept row after dropped ones follows
  what was dropped). The flat ends become those of the last kept row.
  """
  bits = BIT['tokens'] | BIT['logprobs']
  ok = (index[:, IX['sample_id_len']] > 0) & ((flags.astype(np.int64) & bits) == bits)
  ends = {}
  for name, col in (('sample_ids', 'sample_id_start'), ('prompt_ids', 'prompt_start'),
                    ('response_ids', 'response_start')):
    starts, lengths = index[:, IX[col]], index[:, IX[col] + 1]
    base = int(starts[0]) if commit.first and len(starts) else 0
    ends[name] = base + np.concatenate([[0], np.cumsum(lengths)])
    ok &= (starts == ends[name][:-1]) & (starts + lengths <= getattr(commit, name))
  kept = int(np.argmin(ok)) if not ok.all() else len(ok)
  return Commit(rows=commit.first + kept, first=commit.first,
                **{name: int(e[kept]) for name, e in ends.items()})


def validate_commit(table: Table) -> str | None:
  """Check `commit.json` against the rows written; trim it to the written ones if it claims
  more (a commit published before its data, or a copy cut short). Returns what was done."""
  commit = _read_commit(table)
  if commit.rows == commit.first:
    return None
  index = table.arrays['index'][commit.first:commit.rows].read().result()
  flags = table.arrays['status'][commit.first:commit.rows, 0].read().result()
  good = consistent_commit(commit, index, flags)
  if good == commit:
    return None
  table.kv.write(COMMIT_KEY, good.to_json()).result()
  return (f'table {table.agent!r}: {COMMIT_KEY} claimed {commit.rows} rows but only the first '
          f'{good.rows} are fully written; the commit now names those {good.rows} (the others '
          'were never fully written and cannot be read; a rerun serves their queries again).')
