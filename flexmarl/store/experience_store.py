"""ExperienceStore: one TensorStore table per agent, with atomic, crash-safe appends.

A row is one sampled response: `sample_id` (`{query_id}_{call}_{j}`, see sample_id.py), the
`policy_version` that sampled it, prompt and response token ids, the behaviour logprob of every
response token, a `reward` and an `advantage` (often filled in later, e.g. by a downstream agent),
a ready flag per field (tokens and logprobs are ready at insert; reward and advantage when given
to `append` or later to `set_field`) and a `consumed` flag.

    store = ExperienceStore.open('/runs/x/experience', agents=['planner', 'solver'])
    store.append('solver', [Row('q7_0_3', 4, prompt_ids, response_ids, logprobs)])
    store.set_field('solver', ['q7_0_3'], 'reward', [1.0])
    batch = store.read('solver', version=4, ready=('reward',), consumed=False)
    store.mark_consumed('solver', [r.sample_id for r in batch])
    store.settle('solver')  # ids no longer asked for leave memory (see ids.py)
    store.drop_below('solver', store.end('solver') - 10_000)  # retention (see retention.py)

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
Each process keeps in memory the sample_ids of the rows it appended or looked up since it last
called `settle` (≈170 bytes a row) and an 8-byte hash of every other row's id (ids.py); reopening
reads the ids back once. A row dropped by `drop_below` is gone: resending it appends it anew.
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
    BIT, COMMIT_KEY, READY_FIELDS, SETTABLE_FIELDS, STATUS_COL, Commit, Table, open_kvstore,
    open_table, refresh_table, settle_stored, validate_commit)
from flexmarl.store.retention import drop_below
from flexmarl.store.rows import (
    Prepared, Row, StoredRow, filter_rows, first_difference, id_list, load_rows, prepare,
    ready_fields)
from flexmarl.store.writes import update_status, write_tail

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
    for table in tables.values():
      settle_stored(table)
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
      prepared = prepare(rows)
      refresh_table(table)
      new = self._drop_resent(table, prepared)
      if not new:
        return 0
      commit = write_tail(table, new)
      self._publish(table, commit)
      table.ids.add([p.sample_id for p in new], table.commit.rows)
      table.commit = commit
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
      update_status(table, rows[order], set_bits=BIT[field],
                    column=STATUS_COL[field], values=vals[order])

  def mark_consumed(self, agent: str, sample_ids: Sequence[str], consumed: bool = True) -> None:
    """Sets (or, with consumed=False, clears) the consumed flag of the given rows."""
    ids = id_list(sample_ids)
    with self._lock:
      table = self._table(agent)
      refresh_table(table)
      rows = np.unique(self._rows_of(table, ids))
      update_status(table, rows, set_bits=BIT['consumed'] if consumed else 0,
                    clear_bits=0 if consumed else BIT['consumed'])

  def settle(self, agent: str, keep: Sequence[str] = ()) -> None:
    """Lets the ids of `agent`'s rows leave memory, but those of `keep` (rows still to be
    asked for by id): looking one up later reads ids back from disk (see ids.py). A run
    settles at every checkpoint, keeping the rows the checkpoint carries."""
    keep = set(id_list(keep))
    with self._lock:
      self._table(agent).ids.settle(keep)

  def drop_below(self, agent: str, row: int, keep: Sequence[str] = ()) -> int:
    """Retention: deletes `agent`'s rows below row `row` (insertion position, see `end`), but
    not those from the first row of `keep` on; returns how many rows were dropped. Dropped
    rows are gone for every reader; rows dropped already stay dropped."""
    if isinstance(row, bool) or not isinstance(row, (int, np.integer)):
      raise ValueError(f'drop_below(row={row!r}): pass a row position (an int; see end())')
    ids = id_list(keep)
    with self._lock:
      table = self._table(agent)
      refresh_table(table)
      if ids:
        row = min(row, int(self._rows_of(table, ids).min()))
      dropped = drop_below(table, row)
      table.ids.forget(dropped, table.commit.first)
      return len(dropped)

  def end(self, agent: str) -> int:
    """The committed end of `agent`'s table: the position the next appended row gets."""
    with self._lock:
      table = self._table(agent)
      refresh_table(table)
      return table.commit.rows

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
      found = self._find(table, id_list(sample_ids))
      return [s for s in sample_ids if s not in found]

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

  def _find(self, table: Table, ids: Sequence[str]) -> dict[str, int]:
    return table.ids.find(ids, table.commit.first, table.commit.rows, table.read_ids)

  def _rows_of(self, table: Table, ids: Sequence[str]) -> np.ndarray:
    found = self._find(table, ids)
    missing = [s for s in ids if s not in found]
    if missing:
      raise ValueError(f'{len(missing)} sample_id(s) not in table {table.agent!r}, e.g. '
                       f'{missing[:3]!r}; append the rows first (only committed rows count, '
                       'and rows dropped by retention are gone)')
    return np.array([found[s] for s in ids], np.int64)

  def _drop_resent(self, table: Table, prepared: list[Prepared]) -> list[Prepared]:
    """The rows not stored yet; raises on a sample_id stored with different data."""
    seen: set[str] = set()
    for p in prepared:
      if p.sample_id in seen:
        raise ValueError(f'sample_id {p.sample_id!r} appears twice in one append; '
                         'give every sample its own index j in sample_id(query_id, call, j)')
      seen.add(p.sample_id)
    stored_at = self._find(table, [p.sample_id for p in prepared])
    new = []
    for p in prepared:
      if p.sample_id not in stored_at:
        new.append(p)
        continue
      row = stored_at[p.sample_id]
      index = table.arrays['index'][row:row + 1].read().result()
      status = table.arrays['status'][row:row + 1].read().result()
      stored = load_rows(table, index, np.array([row]), status)[0]
      differs = first_difference(p, stored)
      if differs:
        raise ValueError(f'sample_id {p.sample_id!r} is already stored with a different '
                         f'{differs}; a sample_id names one sample: use a new index j, '
                         'or set_field to change reward/advantage')
    return new

  def _publish(self, table: Table, commit: Commit) -> None:
    """The commit point of an append: one atomic write of one small key."""
    table.kv.write(COMMIT_KEY, commit.to_json()).result()

  def _select(self, agent: str, version: int | Iterable[int] | None,
              ready: str | Iterable[str], consumed: bool | None,
              sample_ids: Sequence[str] | None, need_status: bool
              ) -> tuple[Table, np.ndarray, np.ndarray, np.ndarray | None]:
    """(table, the selected rows' index rows (when needed), selected rows ascending, their
    status rows or None)."""
    ready = ready_fields(ready, consumed)
    with self._lock:
      table = self._table(agent)
      refresh_table(table)
      if sample_ids is None:
        rows = np.arange(table.commit.first, table.commit.rows, dtype=np.int64)
      else:
        rows = np.unique(self._rows_of(table, id_list(sample_ids)))
    return (table, *filter_rows(table, rows, version, ready, consumed, need_status))
