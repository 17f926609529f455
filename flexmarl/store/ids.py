"""SampleIds: which row of a table holds a sample_id, in memory that does not grow with the table.

A run asks for few rows by id: the rows it just appended (to mark them consumed once a checkpoint
holds their update), the rows a resumed run resends (to skip them), and the rows a checkpoint
carries (read back on resume). So only *open* rows, appended or looked up since the last
`settle`, keep their id in a dict (≈170 bytes a row). Every other committed row keeps an 8-byte
hash of its id, only to tell a new id (the hot path: every append) from one that may be stored; a
hit is confirmed by reading ids back from disk, newest rows first, and the rows read become open
until the next `settle`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import numpy as np

_SCAN_ROWS = 1 << 14  # rows read back per request when a settled id is looked up

# (lo, hi) -> the sample_ids of rows [lo, hi), read from disk
ReadIds = Callable[[int, int], list[str]]


def _hashes(ids: Sequence[str]) -> np.ndarray:
  return np.fromiter((hash(s) for s in ids), np.int64, len(ids))


class SampleIds:
  """The ids of one table's committed rows: open ones by row, settled ones as sorted hashes."""

  def __init__(self) -> None:
    self._open: dict[str, int] = {}
    self._settled = np.zeros(0, np.int64)  # sorted; may hold hashes of open ids too

  @property
  def open_rows(self) -> int:
    return len(self._open)

  @property
  def settled_rows(self) -> int:
    return len(self._settled)

  def add(self, ids: Sequence[str], first_row: int) -> None:
    """Newly committed rows `first_row`, `first_row + 1`, ...: open until the next settle."""
    self._open.update(zip(ids, range(first_row, first_row + len(ids))))

  def add_settled(self, ids: Sequence[str]) -> None:
    """Committed rows that start settled (a table being reopened)."""
    self._settled = np.union1d(self._settled, _hashes(ids))

  def settle(self, keep: Collection[str] = ()) -> None:
    """Every open row but those in `keep` keeps only its hash from now on."""
    moved = [s for s in self._open if s not in keep]
    self._settled = np.union1d(self._settled, _hashes(moved))
    self._open = {s: self._open[s] for s in keep if s in self._open}

  def forget(self, ids: Sequence[str], first: int) -> None:
    """Rows below `first`, whose ids are `ids`, were dropped from the table."""
    self._open = {s: row for s, row in self._open.items() if row >= first}
    self._settled = self._settled[~np.isin(self._settled, _hashes(ids))]

  def find(self, ids: Sequence[str], first: int, end: int, read: ReadIds) -> dict[str, int]:
    """The rows of those `ids` that rows [first, end) hold (the others are not stored)."""
    found = {s: self._open[s] for s in ids if s in self._open}
    unsure = [s for s in ids if s not in found]
    if unsure:
      h = _hashes(unsure)
      at = np.minimum(np.searchsorted(self._settled, h), max(len(self._settled) - 1, 0))
      hit = self._settled[at] == h if len(self._settled) else np.zeros(len(h), bool)
      wanted = {s for s, maybe in zip(unsure, hit) if maybe}
      hi = end
      while wanted and hi > first:  # newest first: a resend or a resume asks for recent rows
        lo = max(first, hi - _SCAN_ROWS)
        self.add(read(lo, hi), lo)
        wanted -= self._open.keys()
        hi = lo
      found.update((s, self._open[s]) for s in unsure if s in self._open)
    return found
