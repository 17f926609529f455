"""ExperienceStore: one TensorStore table per agent, with atomic, crash-safe appends.

A row is one sampled response: `sample_id` (`{query_id}_{turn}_{trajectory_id}`), the
`policy_version` that sampled it, prompt and response token ids, the behaviour logprob of every
response token, a `reward` and an `advantage` (often filled in later, e.g. by a downstream agent),
a ready flag per field (tokens and logprobs are ready at insert; reward and advantage when given
to `append` or later to `set_field`) and a `consumed` flag.

    store = ExperienceStore.open('/runs/x/experience', agents=['planner', 'solver'])
    store.append('solver', [Row('q7_0_3', 4, prompt_ids, response_ids, logprobs)])
    store.set_field('solver', ['q7_0_3'], 'reward', [1.0])
    batch = store.read('solver', version=4, ready=('reward',), consumed=False)
    store.mark_consumed('solver', [r.sample_id for r in batch])

Layout of one table (the folder `{location}/{agent}/`; zarr3 arrays unless noted):

    prompt_ids    int32   [tokens]   every row's prompt, back to back (no padding)
    response_ids  int32   [tokens]   every row's response, back to back
    logprobs      float32 [tokens]   one per response token, laid out like response_ids
    sample_ids    uint8   [bytes]    every row's sample_id in UTF-8, back to back
    index         int64   [rows, 7]  per row: start and length of its sample_id, prompt and
                                     response in the flat arrays, and its policy_version
    status        uint32  [rows, 3]  per row: flag bits, reward and advantage (float32 bits)
    commit.json   (one key)          committed row count and the committed end of each flat array

The arrays have a huge fixed shape: zarr keeps only the chunks that were written, so nothing is
ever resized, and `commit.json` alone says how much of each array is valid.

Commit protocol, and why a crash never tears a row:
- `append` writes the batch past the committed end of every array (tokens, index and status
  concurrently), waits until all of those writes are durable, then publishes the new
  `commit.json`. Writing one key is atomic in every TensorStore kvstore (the file driver writes a
  temporary file, fsyncs it and renames it into place; see _FILE_LOCKING for the mode this store
  uses), so a reader, or a store reopened after SIGKILL, sees the old counts or the new ones: all
  of a batch or none of it. The tail a crash leaves behind lies past the committed end; it is
  ignored, and the next append writes over it.
- `set_field` and `mark_consumed` rewrite rows of `status`. A row's flags and values lie in one
  chunk, one chunk is one key, so after a crash each row shows either its old value with its old
  flags or its new value with its new flags. A call is atomic per row, not as a whole: rows of
  one call that lie in different chunks (1024 rows each) can land separately.

Duplicates: appending a sample_id the table already has is a no-op when the row is the same
(version, tokens, logprobs, and reward/advantage where the resent row gives them), so a producer
that restarts may resend its last batch; it raises when the row differs.

Concurrency: one writing process per table (appends and updates of a store object are serialised
by a lock); any number of processes may read, and they see each commit as it is published. Two
processes appending to the same table at once would write over each other's uncommitted tails.
Each process keeps the sample_ids of a table in memory (to find rows and reject duplicates),
about 100 bytes per row; reopening reads them back once.

On local files a write killed half-way leaves a temporary `*.__lock` file next to a chunk; it is
never read, only takes space, and is safe to delete while no writer runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import tensorstore as ts

FORMAT = 1
READY_FIELDS = ('tokens', 'logprobs', 'reward', 'advantage')
SETTABLE_FIELDS = ('reward', 'advantage')

_BIT = {'tokens': 1, 'logprobs': 2, 'reward': 4, 'advantage': 8, 'consumed': 16}
_STATUS_COL = {'flags': 0, 'reward': 1, 'advantage': 2}
_INDEX_COLS = ('sample_id_start', 'sample_id_len', 'prompt_start', 'prompt_len',
               'response_start', 'response_len', 'policy_version')
_IX = {name: i for i, name in enumerate(_INDEX_COLS)}
_COMMIT_KEY = 'commit.json'
_AGENT_NAME = re.compile(r'[A-Za-z0-9][A-Za-z0-9._-]*')
_SAMPLE_ID = re.compile(r'.+_\d+_[^_]+')
_MAX_TOKEN_ID = 2**31 - 1
_FLAT_CAPACITY = 2**40  # elements per flat array
_ROW_CAPACITY = 2**36
_ROW_CHUNK = 1024
_READ_GAP = 1 << 16  # rows closer than this many elements are read in one request
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
    'sample_ids': _zarr3('uint8', [_FLAT_CAPACITY], [1 << 14]),
    'prompt_ids': _zarr3('int32', [_FLAT_CAPACITY], [1 << 14]),
    'response_ids': _zarr3('int32', [_FLAT_CAPACITY], [1 << 14]),
    'logprobs': _zarr3('float32', [_FLAT_CAPACITY], [1 << 14]),
    'index': _zarr3('int64', [_ROW_CAPACITY, len(_INDEX_COLS)], [_ROW_CHUNK, len(_INDEX_COLS)]),
    'status': _zarr3('uint32', [_ROW_CAPACITY, len(_STATUS_COL)], [_ROW_CHUNK, len(_STATUS_COL)]),
}


def make_sample_id(query_id: str, turn: int, trajectory_id: int | str) -> str:
  """The row key the whole pipeline uses: one sampled response of one turn of one query."""
  return f'{query_id}_{turn}_{trajectory_id}'


@dataclasses.dataclass(frozen=True, eq=False)
class Row:
  """One sample to append. Arrays compare elementwise, so rows have no `==`."""

  sample_id: str
  policy_version: int
  prompt_ids: Sequence[int] | npt.NDArray[np.integer]
  response_ids: Sequence[int] | npt.NDArray[np.integer]
  logprobs: Sequence[float] | npt.NDArray[np.floating]  # behaviour logprob per response token
  reward: float | None = None  # None: not known yet (set_field fills it in later)
  advantage: float | None = None


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class StoredRow(Row):
  """A row as read back: arrays as int32/float32 numpy, plus its position and flags.

  `reward`/`advantage` are None unless ready. A StoredRow is a Row, so resending one is a no-op.
  """

  index: int  # insertion position in the table
  ready: frozenset[str]  # names from READY_FIELDS
  consumed: bool


@dataclasses.dataclass(frozen=True)
class _Commit:
  """What `commit.json` publishes: the committed rows and the committed end of each flat array."""

  rows: int = 0
  sample_ids: int = 0  # bytes
  prompt_ids: int = 0  # tokens
  response_ids: int = 0  # tokens; logprobs shares these offsets

  def to_json(self) -> bytes:
    return json.dumps({'format': FORMAT, **dataclasses.asdict(self)}).encode()

  @classmethod
  def from_json(cls, raw: bytes, where: str) -> _Commit:
    data = json.loads(raw)
    if data.pop('format', None) != FORMAT:
      raise ValueError(f'{where}: table format {data.get("format")!r} is not {FORMAT}; '
                       'open it with the FlexMARL version that wrote it')
    return cls(**data)


@dataclasses.dataclass
class _Table:
  """One agent's arrays and a cache of its committed per-row columns (immutable once committed)."""

  agent: str
  kv: ts.KvStore
  arrays: dict[str, ts.TensorStore]
  commit: _Commit
  index: np.ndarray  # [commit.rows, 7] int64
  sample_ids: list[str]  # by row
  row_of: dict[str, int]


@dataclasses.dataclass(frozen=True)
class _Prepared:
  """A validated Row, converted to the stored dtypes."""

  sample_id: str
  sample_id_bytes: bytes
  policy_version: int
  prompt_ids: np.ndarray
  response_ids: np.ndarray
  logprobs: np.ndarray
  reward: float | None
  advantage: float | None


class ExperienceStore:
  """Per-agent experience tables in TensorStore. Create with `ExperienceStore.open`."""

  def __init__(self, root: ts.KvStore, tables: dict[str, _Table], recovered: list[str] = ()):
    self._root = root
    self._tables = tables
    self.recovered = list(recovered)  # what `open` repaired (see _validate_commit), to report
    self._lock = threading.RLock()
    self._closed = False

  @classmethod
  def open(cls, location: str | os.PathLike | dict | ts.KvStore,
           agents: Sequence[str], fsync: bool = False) -> ExperienceStore:
    """Opens (or creates) the tables of `agents` at `location` and carries on from their commits.

    `location`: a local folder, a TensorStore kvstore URL (`file:///...`, `gs://...`, `memory://`),
    a kvstore JSON spec, or an open `ts.KvStore`. Tables of other agents stored there are left
    alone; tables missing for `agents` are created.
    `fsync` (local files): without it a commit survives a killed process (the kernel keeps the
    written pages; writes still land by rename, atomically), not a crash of the machine; with it,
    that too, at ≈10 ms of fsyncs per append on this kind of machine.
    """
    if isinstance(agents, str) or not agents:
      raise ValueError(f'agents={agents!r}: pass a non-empty list of agent names, '
                       "e.g. agents=['solver']")
    for agent in agents:
      if not isinstance(agent, str) or not _AGENT_NAME.fullmatch(agent):
        raise ValueError(f'agent name {agent!r} is not usable as a folder name; use letters, '
                         "digits, '.', '_' and '-', starting with a letter or digit")
    if len(set(agents)) != len(agents):
      raise ValueError(f'agents={list(agents)!r} names an agent twice; list each once')
    root = _open_kvstore(location, fsync)
    tables = {agent: _open_table(root, agent) for agent in agents}
    recovered = [m for m in (_validate_commit(t) for t in tables.values()) if m]
    return cls(root, tables, recovered)

  @property
  def agents(self) -> list[str]:
    return list(self._tables)

  def close(self) -> None:
    """Drops the array handles; everything committed is already durable."""
    with self._lock:
      self._tables, self._closed = {}, True

  def __enter__(self) -> ExperienceStore:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()

  def __repr__(self) -> str:
    return f'ExperienceStore({self._root.spec().to_json()!r}, agents={self.agents!r})'

  # --- writes ----------------------------------------------------------------------------------

  def append(self, agent: str, rows: Sequence[Row]) -> int:
    """Appends `rows` as one atomic, durable batch; returns how many rows were new.

    Rows whose sample_id is already stored are skipped if identical, and raise if they differ;
    every row is checked before anything is written.
    """
    with self._lock:
      table = self._table(agent)
      prepared = [_prepare(row, i) for i, row in enumerate(rows)]
      self._refresh(table)
      new = self._drop_resent(table, prepared)
      if not new:
        return 0
      commit, index = self._write_tail(table, new)
      self._publish(table, commit)
      table.commit, table.index = commit, np.concatenate([table.index, index])
      for p in new:
        table.row_of[p.sample_id] = len(table.sample_ids)
        table.sample_ids.append(p.sample_id)
      return len(new)

  def set_field(self, agent: str, sample_ids: Sequence[str], field: str,
                values: Sequence[float] | npt.NDArray[np.floating]) -> None:
    """Sets `field` ('reward' or 'advantage') of the given rows and marks it ready."""
    if field not in SETTABLE_FIELDS:
      raise ValueError(f'field={field!r} cannot be set; settable fields are {SETTABLE_FIELDS} '
                       '(token ids and logprobs are fixed at append)')
    ids = _id_list(sample_ids)
    vals = np.asarray(values, np.float32)
    if vals.shape != (len(ids),):
      raise ValueError(f'set_field({field!r}): values has shape {vals.shape} but there are '
                       f'{len(ids)} sample_ids; pass one value per sample_id')
    if not np.isfinite(vals).all():
      bad = ids[int(np.flatnonzero(~np.isfinite(vals))[0])]
      raise ValueError(f'{field} of {bad!r} is {vals[ids.index(bad)]}; pass finite values')
    if len(set(ids)) != len(ids):
      raise ValueError(f'set_field({field!r}): a sample_id appears twice in sample_ids; '
                       'pass each row once')
    with self._lock:
      table = self._table(agent)
      self._refresh(table)
      rows = self._rows_of(table, ids)
      order = np.argsort(rows)
      self._update_status(table, rows[order], set_bits=_BIT[field],
                          column=_STATUS_COL[field], values=vals[order])

  def mark_consumed(self, agent: str, sample_ids: Sequence[str], consumed: bool = True) -> None:
    """Sets (or, with consumed=False, clears) the consumed flag of the given rows."""
    ids = _id_list(sample_ids)
    with self._lock:
      table = self._table(agent)
      self._refresh(table)
      rows = np.unique(self._rows_of(table, ids))
      self._update_status(table, rows, set_bits=_BIT['consumed'] if consumed else 0,
                          clear_bits=0 if consumed else _BIT['consumed'])

  # --- reads -----------------------------------------------------------------------------------

  def read(self, agent: str, *, version: int | Iterable[int] | None = None,
           ready: str | Iterable[str] = (), consumed: bool | None = None,
           sample_ids: Sequence[str] | None = None) -> list[StoredRow]:
    """Committed rows matching every filter, in insertion order, with all fields and flags.

    version: a policy version or several; ready: fields that must be ready (READY_FIELDS);
    consumed: True/False to keep only (un)consumed rows; sample_ids: only these rows (each must
    exist).
    """
    table, index, rows, status = self._select(agent, version, ready, consumed, sample_ids,
                                              need_status=True)
    return _load(table, index, rows, status)

  def count(self, agent: str, *, version: int | Iterable[int] | None = None,
            ready: str | Iterable[str] = (), consumed: bool | None = None,
            sample_ids: Sequence[str] | None = None) -> int:
    """How many rows `read` would return, without reading any tokens."""
    return len(self._select(agent, version, ready, consumed, sample_ids, need_status=False)[2])

  # --- internals -------------------------------------------------------------------------------

  def _table(self, agent: str) -> _Table:
    if self._closed:
      raise ValueError('this ExperienceStore is closed; open it again with ExperienceStore.open')
    if agent not in self._tables:
      raise ValueError(f'unknown agent {agent!r}: this store was opened with agents='
                       f'{self.agents!r}; add it to ExperienceStore.open(..., agents=[...])')
    return self._tables[agent]

  def _refresh(self, table: _Table) -> None:
    """Catches the cache up with `commit.json` (rows committed by this or another process)."""
    commit = _read_commit(table)
    have = len(table.sample_ids)
    if commit.rows < have:
      raise RuntimeError(f'table {table.agent!r} shrank from {have} to {commit.rows} rows: '
                         'another writer replaced it; reopen the store')
    if commit.rows > have:
      index = table.arrays['index'][have:commit.rows].read().result()
      if not (index[:, _IX['sample_id_len']] > 0).all():
        raise RuntimeError(
            f'table {table.agent!r}: {_COMMIT_KEY} claims {commit.rows} rows but rows past '
            f'{have + int(np.argmin(index[:, _IX["sample_id_len"]] > 0))} were never written; '
            'another process replaced or damaged it. Fix: reopen the store '
            '(ExperienceStore.open keeps the fully written rows and says what it dropped).')
      first = int(index[0, _IX['sample_id_start']])
      raw = table.arrays['sample_ids'][first:commit.sample_ids].read().result().tobytes()
      starts = index[:, _IX['sample_id_start']] - first
      for k, (start, length) in enumerate(zip(starts, index[:, _IX['sample_id_len']])):
        sample_id = raw[start:start + length].decode()
        table.row_of[sample_id] = have + k
        table.sample_ids.append(sample_id)
      table.index = np.concatenate([table.index, index])
    table.commit = commit

  def _rows_of(self, table: _Table, ids: Sequence[str]) -> np.ndarray:
    missing = [s for s in ids if s not in table.row_of]
    if missing:
      raise ValueError(f'{len(missing)} sample_id(s) not in table {table.agent!r}, e.g. '
                       f'{missing[:3]!r}; append the rows first (only committed rows count)')
    return np.array([table.row_of[s] for s in ids], np.int64)

  def _drop_resent(self, table: _Table, prepared: list[_Prepared]) -> list[_Prepared]:
    """The rows not stored yet; raises on a sample_id stored with different data."""
    seen: set[str] = set()
    new = []
    for p in prepared:
      if p.sample_id in seen:
        raise ValueError(f'sample_id {p.sample_id!r} appears twice in one append; '
                         'give every sample its own trajectory_id')
      seen.add(p.sample_id)
      if p.sample_id not in table.row_of:
        new.append(p)
        continue
      row = table.row_of[p.sample_id]
      status = table.arrays['status'][row:row + 1].read().result()
      stored = _load(table, table.index, np.array([row]), status)[0]
      differs = _first_difference(p, stored)
      if differs:
        raise ValueError(f'sample_id {p.sample_id!r} is already stored with a different '
                         f'{differs}; a sample_id names one sample: use a new trajectory_id, '
                         'or set_field to change reward/advantage')
    return new

  def _write_tail(self, table: _Table, new: list[_Prepared]) -> tuple[_Commit, np.ndarray]:
    """Writes `new` past the committed end of every array; returns their commit and index."""
    old = table.commit
    index = np.zeros((len(new), len(_INDEX_COLS)), np.int64)
    data = {}
    sample_id_bytes = [np.frombuffer(p.sample_id_bytes, np.uint8) for p in new]
    for name, start_col, values in (
        ('sample_ids', 'sample_id_start', sample_id_bytes),
        ('prompt_ids', 'prompt_start', [p.prompt_ids for p in new]),
        ('response_ids', 'response_start', [p.response_ids for p in new])):
      lengths = np.array([len(v) for v in values], np.int64)
      index[:, _IX[start_col]] = getattr(old, name) + np.cumsum(lengths) - lengths
      index[:, _IX[start_col] + 1] = lengths
      data[name] = np.concatenate(values)
    data['logprobs'] = np.concatenate([p.logprobs for p in new])
    index[:, _IX['policy_version']] = [p.policy_version for p in new]
    status = np.zeros((len(new), len(_STATUS_COL)), np.uint32)
    for i, p in enumerate(new):
      status[i, 0] = _BIT['tokens'] | _BIT['logprobs']
      for field in SETTABLE_FIELDS:
        value = getattr(p, field)
        if value is not None:
          status[i, 0] |= _BIT[field]
          status[i, _STATUS_COL[field]] = np.float32(value).view(np.uint32)
    commit = _Commit(rows=old.rows + len(new),
                     sample_ids=old.sample_ids + len(data['sample_ids']),
                     prompt_ids=old.prompt_ids + len(data['prompt_ids']),
                     response_ids=old.response_ids + len(data['response_ids']))
    if commit.rows > _ROW_CAPACITY or max(commit.sample_ids, commit.prompt_ids,
                                          commit.response_ids) > _FLAT_CAPACITY:
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
    return commit, index

  def _publish(self, table: _Table, commit: _Commit) -> None:
    """The commit point of an append: one atomic write of one small key."""
    table.kv.write(_COMMIT_KEY, commit.to_json()).result()

  def _update_status(self, table: _Table, rows: np.ndarray, *, set_bits: int = 0,
                     clear_bits: int = 0, column: int | None = None,
                     values: np.ndarray | None = None) -> None:
    """Read-modify-write of whole status rows, so each row's flags and value land together."""
    if not len(rows):
      return
    status = table.arrays['status']
    current = status[rows].read().result()
    current[:, 0] = (current[:, 0] | set_bits) & ~np.uint32(clear_bits)
    if column is not None:
      current[:, column] = values.astype(np.float32).view(np.uint32)
    status[rows].write(current).result()

  def _select(self, agent: str, version: int | Iterable[int] | None,
              ready: str | Iterable[str], consumed: bool | None,
              sample_ids: Sequence[str] | None, need_status: bool
              ) -> tuple[_Table, np.ndarray, np.ndarray, np.ndarray | None]:
    """(table, index snapshot, selected rows ascending, their status rows or None)."""
    ready = (ready,) if isinstance(ready, str) else tuple(ready)
    for field in ready:
      if field not in READY_FIELDS:
        raise ValueError(f'ready={ready!r}: unknown field {field!r}; fields with a ready flag '
                         f'are {READY_FIELDS}')
    if consumed is not None and not isinstance(consumed, (bool, np.bool_)):
      raise ValueError(f'consumed={consumed!r}: pass True, False or None (either)')
    with self._lock:
      table = self._table(agent)
      self._refresh(table)
      index = table.index
      if sample_ids is None:
        rows = np.arange(len(index), dtype=np.int64)
      else:
        rows = np.unique(self._rows_of(table, _id_list(sample_ids)))
    if version is not None:
      versions = [version] if isinstance(version, (int, np.integer)) else list(version)
      rows = rows[np.isin(index[rows, _IX['policy_version']], versions)]
    status = None
    if len(rows) and (need_status or ready or consumed is not None):
      status = table.arrays['status'][rows[0]:rows[-1] + 1].read().result()[rows - rows[0]]
      keep = np.ones(len(rows), bool)
      required = sum(_BIT[f] for f in set(ready))
      keep &= (status[:, 0] & required) == required
      if consumed is not None:
        keep &= ((status[:, 0] & _BIT['consumed']) != 0) == bool(consumed)
      rows, status = rows[keep], status[keep]
    return table, index, rows, status


def _open_kvstore(location: str | os.PathLike | dict | ts.KvStore, fsync: bool) -> ts.KvStore:
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


def _open_table(root: ts.KvStore, agent: str) -> _Table:
  """Opens an agent's table, creating it if absent: arrays first, commit.json (0 rows) last."""
  kv = root / f'{agent}/'
  futures = {name: ts.open(spec, kvstore=kv / f'{name}/', create=True, open=True)
             for name, spec in _ARRAYS.items()}
  arrays = {name: future.result() for name, future in futures.items()}
  table = _Table(agent, kv, arrays, _Commit(), np.zeros((0, len(_INDEX_COLS)), np.int64), [], {})
  if kv.read(_COMMIT_KEY).result().state == 'missing':
    kv.write(_COMMIT_KEY, _Commit().to_json()).result()
  return table  # the caller's first operation refreshes it from commit.json


_LOST_FIX = ('Fix: restore the store folder from a backup; or start the run over in a new '
             '--workdir (a resume needs the rows its checkpoint carries).')


def _read_commit(table: _Table) -> _Commit:
  result = table.kv.read(_COMMIT_KEY).result()
  if result.state != 'value':
    raise RuntimeError(f'table {table.agent!r} lost its {_COMMIT_KEY}; its location was deleted '
                       f'or replaced while open. {_LOST_FIX}')
  try:
    return _Commit.from_json(result.value, f'table {table.agent!r}')
  except (json.JSONDecodeError, TypeError, UnicodeDecodeError) as e:
    raise RuntimeError(f'table {table.agent!r}: {_COMMIT_KEY} is damaged ({e}). {_LOST_FIX}'
                       ) from None


def consistent_commit(commit: _Commit, index: np.ndarray, flags: np.ndarray) -> _Commit:
  """The longest prefix of `commit`'s rows that was fully written.

  A written row has a non-empty sample_id and the tokens/logprobs flags, and its spans
  follow the previous row's in every flat array, within the committed ends (rows that
  were never written read back as zeros). The flat ends become those of the last kept row.
  """
  bits = _BIT['tokens'] | _BIT['logprobs']
  ok = (index[:, _IX['sample_id_len']] > 0) & ((flags.astype(np.int64) & bits) == bits)
  ends = {}
  for name, col in (('sample_ids', 'sample_id_start'), ('prompt_ids', 'prompt_start'),
                    ('response_ids', 'response_start')):
    starts, lengths = index[:, _IX[col]], index[:, _IX[col] + 1]
    follows = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    ok &= (starts == follows) & (starts + lengths <= getattr(commit, name))
    ends[name] = np.concatenate([[0], np.cumsum(lengths)])
  rows = int(np.argmin(ok)) if not ok.all() else len(ok)
  return _Commit(rows=rows, **{name: int(e[rows]) for name, e in ends.items()})


def _validate_commit(table: _Table) -> str | None:
  """Check `commit.json` against the rows written; trim it to the written ones if it claims
  more (a commit published before its data, or a copy cut short). Returns what was done."""
  commit = _read_commit(table)
  if not commit.rows:
    return None
  index = table.arrays['index'][:commit.rows].read().result()
  flags = table.arrays['status'][:commit.rows, 0].read().result()
  good = consistent_commit(commit, index, flags)
  if good == commit:
    return None
  table.kv.write(_COMMIT_KEY, good.to_json()).result()
  return (f'table {table.agent!r}: {_COMMIT_KEY} claimed {commit.rows} rows but only the first '
          f'{good.rows} are fully written; the commit now names those {good.rows} (the others '
          'were never fully written and cannot be read; a rerun serves their queries again).')


def _id_list(sample_ids: Sequence[str]) -> list[str]:
  if isinstance(sample_ids, (str, bytes)):
    raise ValueError(f'sample_ids={sample_ids!r} is one string; pass a list of sample_ids')
  return list(sample_ids)


def _prepare(row: Row, position: int) -> _Prepared:
  """Validates one Row (raising with the field, the value and the fix) and converts it."""
  sid = row.sample_id
  if not isinstance(sid, str) or not _SAMPLE_ID.fullmatch(sid):
    raise ValueError(f'rows[{position}].sample_id={sid!r} is not of the form '
                     "'{query_id}_{turn}_{trajectory_id}'; build it with make_sample_id")
  where = f'rows[{position}] ({sid!r})'
  version = row.policy_version
  if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
    raise ValueError(f'{where}.policy_version={version!r}: pass the sampling policy version as '
                     'an int >= 0')
  prompt = _token_ids(row.prompt_ids, f'{where}.prompt_ids')
  response = _token_ids(row.response_ids, f'{where}.response_ids')
  logprobs = np.asarray(row.logprobs, np.float32)
  if logprobs.ndim != 1 or len(logprobs) != len(response):
    raise ValueError(f'{where}.logprobs has shape {logprobs.shape} but response_ids has '
                     f'{len(response)} tokens; pass one behaviour logprob per response token')
  if not np.isfinite(logprobs).all():
    raise ValueError(f'{where}.logprobs has a non-finite value '
                     f'({logprobs[~np.isfinite(logprobs)][0]}); a sampled token has a finite '
                     'logprob: check the sampler')
  scalars = {}
  for field in SETTABLE_FIELDS:
    value = getattr(row, field)
    if value is not None:
      if not isinstance(value, (int, float, np.integer, np.floating)) or not np.isfinite(value):
        raise ValueError(f'{where}.{field}={value!r}: pass a finite number, or None if not '
                         'known yet (set_field fills it in later)')
      value = float(np.float32(value))
    scalars[field] = value
  return _Prepared(sid, sid.encode(), int(version), prompt, response, logprobs, **scalars)


def _token_ids(values: Any, where: str) -> np.ndarray:
  array = np.asarray(values)
  if array.size == 0:
    return np.zeros(0, np.int32)
  if array.ndim != 1 or array.dtype.kind not in 'iu':
    raise ValueError(f'{where} has dtype {array.dtype} and shape {array.shape}: pass a 1-D '
                     'sequence of integer token ids')
  if array.min() < 0 or array.max() > _MAX_TOKEN_ID:
    raise ValueError(f'{where} has a token id out of range [0, 2**31) '
                     f'(min {array.min()}, max {array.max()}); pass vocabulary ids')
  return array.astype(np.int32)


def _first_difference(p: _Prepared, stored: StoredRow) -> str | None:
  """Name of the first field where a resent row differs from the stored one, else None."""
  if p.policy_version != stored.policy_version:
    return f'policy_version ({p.policy_version} vs stored {stored.policy_version})'
  for field in ('prompt_ids', 'response_ids', 'logprobs'):
    if not np.array_equal(getattr(p, field), getattr(stored, field)):
      return field
  for field in SETTABLE_FIELDS:
    value = getattr(p, field)
    if value is not None and value != getattr(stored, field):
      return f'{field} ({value} vs stored {getattr(stored, field)})'
  return None


def _load(table: _Table, index: np.ndarray, rows: np.ndarray,
          status: np.ndarray | None) -> list[StoredRow]:
  """StoredRows for `rows` (ascending) with their `status` rows: reads the token spans."""
  if not len(rows):
    return []
  idx = index[rows]
  (prompts,) = _read_slices([table.arrays['prompt_ids']], idx[:, _IX['prompt_start']],
                            idx[:, _IX['prompt_len']])
  responses, logprobs = _read_slices(
      [table.arrays['response_ids'], table.arrays['logprobs']],
      idx[:, _IX['response_start']], idx[:, _IX['response_len']])
  flags = status[:, 0]
  values = {f: status[:, _STATUS_COL[f]].view(np.float32) for f in SETTABLE_FIELDS}
  out = []
  for i, row in enumerate(rows):
    ready = frozenset(f for f in READY_FIELDS if flags[i] & _BIT[f])
    scalars = {f: float(values[f][i]) if f in ready else None for f in SETTABLE_FIELDS}
    out.append(StoredRow(
        sample_id=table.sample_ids[row], policy_version=int(idx[i, _IX['policy_version']]),
        prompt_ids=prompts[i], response_ids=responses[i], logprobs=logprobs[i], **scalars,
        index=int(row), ready=ready, consumed=bool(flags[i] & _BIT['consumed'])))
  return out


def _read_slices(arrays: Sequence[ts.TensorStore], starts: np.ndarray,
                 lengths: np.ndarray) -> list[list[np.ndarray]]:
  """Per array, the slices [start, start + length) (starts ascending).

  Neighbouring slices are merged into spans read in one request each (one request per row is
  slow; one request over everything reads the gaps between sparse rows), all spans concurrently.
  """
  ends = starts + lengths
  prev_end = np.maximum.accumulate(ends)
  new_span = np.ones(len(starts), bool)
  new_span[1:] = starts[1:] - prev_end[:-1] > _READ_GAP
  firsts = np.flatnonzero(new_span)
  span_of = np.cumsum(new_span) - 1
  lo, hi = starts[firsts], np.maximum.reduceat(ends, firsts)
  futures = [[array[a:b].read() for a, b in zip(lo, hi)] for array in arrays]
  out = []
  for array_futures in futures:
    spans = [f.result() for f in array_futures]
    out.append([spans[g][s - lo[g]:e - lo[g]] for g, s, e in zip(span_of, starts, ends)])
  return out
