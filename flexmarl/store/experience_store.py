"""ExperienceStore: one TensorStore table per agent, with atomic, crash-safe appends.

A row is one sampled response: `sample_id` (`{query_id}_{call}_{j}`, see data/records.py), the
`policy_version` that sampled it, prompt and response token ids, the behaviour logprob of every
response token, a `reward` and an `advantage` (often filled in later, e.g. by a downstream agent),
a ready flag per field (tokens and logprobs are ready at insert; reward and advantage when given
to `append` or later to `set_field`) and a `consumed` flag.

    store = ExperienceStore.open('/runs/x/experience', agents=['planner', 'solver'])
    store.append('solver', [Row('q7_0_3', 4, prompt_ids, response_ids, logprobs)])
    store.set_field('solver', ['q7_0_3'], 'reward', [1.0])
    batch = store.read('solver', version=4, ready=('reward',), consumed=False)
    store.mark_consumed('solver', [r.sample_id for r in batch])

The on-disk layout of a table is described in layout.py.

Commit protocol, and why a crash never tears a row:
- `append` writes the batch past the committed end of every array (tokens, index and status
  concurrently), waits until all of those writes are durable, then publishes the new
  `commit.json`. Writing one key is atomic in every TensorStore kvstore (the file driver writes a
  temporary file, fsyncs it and renames it into place; see _FILE_LOCKING in layout.py for the
  mode this store uses), so a reader, or a store reopened after SIGKILL, sees the old counts or
  the new ones: all of a batch or none of it. The tail a crash leaves behind lies past the
  committed end; it is ignored, and the next append writes over it.
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
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt
import tensorstore as ts

from flexmarl.store.layout import (
    BIT, COMMIT_KEY, FLAT_CAPACITY, INDEX_COLS, IX, READY_FIELDS, ROW_CAPACITY,
    SETTABLE_FIELDS, STATUS_COL, Commit, Table, open_kvstore, open_table, refresh_table,
    validate_commit)
from flexmarl.store.rows import (
    Prepared, Row, StoredRow, first_difference, id_list, load_rows, prepare)

__all__ = ['READY_FIELDS', 'SETTABLE_FIELDS', 'ExperienceStore', 'Row', 'StoredRow']

_AGENT_NAME = re.compile(r'[A-Za-z0-9][A-Za-z0-9._-]*')


class ExperienceStore:
  """Per-agent experience tables in TensorStore. Create with `ExperienceStore.open`."""

  def __init__(self, root: ts.KvStore, tables: dict[str, Table], recovered: list[str] = ()):
    self._root = root
    self._tables = tables
    self.recovered = list(recovered)  # what `open` repaired (see validate_commit), to report
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
    root = open_kvstore(location, fsync)
    tables = {agent: open_table(root, agent) for agent in agents}
    recovered = [m for m in (validate_commit(t) for t in tables.values()) if m]
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
      prepared = [prepare(row, i) for i, row in enumerate(rows)]
      refresh_table(table)
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
    ids = id_list(sample_ids)
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
      refresh_table(table)
      rows = self._rows_of(table, ids)
      order = np.argsort(rows)
      self._update_status(table, rows[order], set_bits=BIT[field],
                          column=STATUS_COL[field], values=vals[order])

  def mark_consumed(self, agent: str, sample_ids: Sequence[str], consumed: bool = True) -> None:
    """Sets (or, with consumed=False, clears) the consumed flag of the given rows."""
    ids = id_list(sample_ids)
    with self._lock:
      table = self._table(agent)
      refresh_table(table)
      rows = np.unique(self._rows_of(table, ids))
      self._update_status(table, rows, set_bits=BIT['consumed'] if consumed else 0,
                          clear_bits=0 if consumed else BIT['consumed'])

  def set_aside(self, agent: str) -> str:
    """Move `agent`'s table (one that cannot be read) to a new name beside it, kept as it
    is, and start an empty table in its place; returns where it went (local folders only)."""
    with self._lock:
      self._table(agent)
      spec = self._root.spec().to_json()
      if spec.get('driver') != 'file':
        raise ValueError(f'store {spec}: only a local folder can set a table aside; move '
                         f'{agent}/ away by hand and reopen the store.')
      folder = os.path.join(spec['path'], agent)
      n = 1
      while os.path.exists(f'{folder}.damaged{n}'):
        n += 1
      os.rename(folder, f'{folder}.damaged{n}')
      self._tables[agent] = open_table(self._root, agent)
      return f'{folder}.damaged{n}'

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
    return load_rows(table, index, rows, status)

  def missing(self, agent: str, sample_ids: Sequence[str]) -> list[str]:
    """The ids among `sample_ids` that no committed row has (reads only the index)."""
    with self._lock:
      table = self._table(agent)
      refresh_table(table)
      return [s for s in sample_ids if s not in table.row_of]

  def count(self, agent: str, *, version: int | Iterable[int] | None = None,
            ready: str | Iterable[str] = (), consumed: bool | None = None,
            sample_ids: Sequence[str] | None = None) -> int:
    """How many rows `read` would return, without reading any tokens."""
    return len(self._select(agent, version, ready, consumed, sample_ids, need_status=False)[2])

  # --- internals -------------------------------------------------------------------------------

  def _table(self, agent: str) -> Table:
    if self._closed:
      raise ValueError('this ExperienceStore is closed; open it again with ExperienceStore.open')
    if agent not in self._tables:
      raise ValueError(f'unknown agent {agent!r}: this store was opened with agents='
                       f'{self.agents!r}; add it to ExperienceStore.open(..., agents=[...])')
    return self._tables[agent]

  def _rows_of(self, table: Table, ids: Sequence[str]) -> np.ndarray:
    missing = [s for s in ids if s not in table.row_of]
    if missing:
      raise ValueError(f'{len(missing)} sample_id(s) not in table {table.agent!r}, e.g. '
                       f'{missing[:3]!r}; append the rows first (only committed rows count)')
    return np.array([table.row_of[s] for s in ids], np.int64)

  def _drop_resent(self, table: Table, prepared: list[Prepared]) -> list[Prepared]:
    """The rows not stored yet; raises on a sample_id stored with different data."""
    seen: set[str] = set()
    new = []
    for p in prepared:
      if p.sample_id in seen:
        raise ValueError(f'sample_id {p.sample_id!r} appears twice in one append; '
                         'give every sample its own index j in sample_id(query_id, call, j)')
      seen.add(p.sample_id)
      if p.sample_id not in table.row_of:
        new.append(p)
        continue
      row = table.row_of[p.sample_id]
      status = table.arrays['status'][row:row + 1].read().result()
      stored = load_rows(table, table.index, np.array([row]), status)[0]
      differs = first_difference(p, stored)
      if differs:
        raise ValueError(f'sample_id {p.sample_id!r} is already stored with a different '
                         f'{differs}; a sample_id names one sample: use a new index j, '
                         'or set_field to change reward/advantage')
    return new

  def _write_tail(self, table: Table, new: list[Prepared]) -> tuple[Commit, np.ndarray]:
    """Writes `new` past the committed end of every array; returns their commit and index."""
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
    for i, p in enumerate(new):
      status[i, 0] = BIT['tokens'] | BIT['logprobs']
      for field in SETTABLE_FIELDS:
        value = getattr(p, field)
        if value is not None:
          status[i, 0] |= BIT[field]
          status[i, STATUS_COL[field]] = np.float32(value).view(np.uint32)
    commit = Commit(rows=old.rows + len(new),
                    sample_ids=old.sample_ids + len(data['sample_ids']),
                    prompt_ids=old.prompt_ids + len(data['prompt_ids']),
                    response_ids=old.response_ids + len(data['response_ids']))
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
    return commit, index

  def _publish(self, table: Table, commit: Commit) -> None:
    """The commit point of an append: one atomic write of one small key."""
    table.kv.write(COMMIT_KEY, commit.to_json()).result()

  def _update_status(self, table: Table, rows: np.ndarray, *, set_bits: int = 0,
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
              ) -> tuple[Table, np.ndarray, np.ndarray, np.ndarray | None]:
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
      refresh_table(table)
      index = table.index
      if sample_ids is None:
        rows = np.arange(len(index), dtype=np.int64)
      else:
        rows = np.unique(self._rows_of(table, id_list(sample_ids)))
    if version is not None:
      versions = [version] if isinstance(version, (int, np.integer)) else list(version)
      rows = rows[np.isin(index[rows, IX['policy_version']], versions)]
    status = None
    if len(rows) and (need_status or ready or consumed is not None):
      status = table.arrays['status'][rows[0]:rows[-1] + 1].read().result()[rows - rows[0]]
      keep = np.ones(len(rows), bool)
      required = sum(BIT[f] for f in set(ready))
      keep &= (status[:, 0] & required) == required
      if consumed is not None:
        keep &= ((status[:, 0] & BIT['consumed']) != 0) == bool(consumed)
      rows, status = rows[keep], status[keep]
    return table, index, rows, status
