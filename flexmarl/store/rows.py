"""Rows: the public Row and StoredRow records, and validating, comparing and reading rows."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import tensorstore as ts

from flexmarl.data.sample_id import parse_sample_id
from flexmarl.store.layout import BIT, IX, READY_FIELDS, SETTABLE_FIELDS, STATUS_COL, Table

_MAX_TOKEN_ID = 2**31 - 1
_READ_GAP = 1 << 16  # rows closer than this many elements are read in one request


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


class Prepared(NamedTuple):
  """A validated Row, converted to the stored dtypes."""

  sample_id: str
  sample_id_bytes: bytes
  policy_version: int
  prompt_ids: np.ndarray
  response_ids: np.ndarray
  logprobs: np.ndarray
  reward: float | None
  advantage: float | None


def id_list(sample_ids: Sequence[str]) -> list[str]:
  if isinstance(sample_ids, (str, bytes)):
    raise ValueError(f'sample_ids={sample_ids!r} is one string; pass a list of sample_ids')
  return list(sample_ids)


def prepare(rows: Sequence[Row]) -> list[Prepared]:
  """Validates `rows` (raising with the field, the value and the fix) and converts them.

  The value checks (token ids in range, finite logprobs) run once over the whole batch,
  not once per row: an append of a step's rows runs beside the step's own work."""
  checked = [_check_row(row, i) for i, row in enumerate(rows)]
  ids = [a for c in checked for a in (c.prompt_ids, c.response_ids)]
  if ids and _out_of_range(np.concatenate(ids)):
    for i, c in enumerate(checked):  # find the row to name
      for field in ('prompt_ids', 'response_ids'):
        array = getattr(c, field)
        if _out_of_range(array):
          raise ValueError(f'{_where(rows[i], i)}.{field} has a token id out of range [0, 2**31) '
                           f'(min {array.min()}, max {array.max()}); pass vocabulary ids')
  if checked and not np.isfinite(np.concatenate([c.logprobs for c in checked])).all():
    i, lp = next((i, c.logprobs) for i, c in enumerate(checked)
                 if not np.isfinite(c.logprobs).all())
    raise ValueError(f'{_where(rows[i], i)}.logprobs has a non-finite value '
                     f'({lp[~np.isfinite(lp)][0]}); a sampled token has a finite '
                     'logprob: check the sampler')
  return [c._replace(prompt_ids=c.prompt_ids.astype(np.int32),
                     response_ids=c.response_ids.astype(np.int32)) for c in checked]


def _where(row: Row, position: int) -> str:
  return f'rows[{position}] ({row.sample_id!r})'


def _check_row(row: Row, position: int) -> Prepared:
  """One row's id, types and shapes checked, its token ids as given; `prepare` checks
  their values and converts them."""
  sid = row.sample_id
  try:
    parse_sample_id(sid)
  except ValueError as e:
    raise ValueError(f'rows[{position}].{e}') from None
  where = _where(row, position)
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
  scalars = {}
  for field in SETTABLE_FIELDS:
    value = getattr(row, field)
    if value is not None:
      if not isinstance(value, (int, float, np.integer, np.floating)) or not np.isfinite(value):
        raise ValueError(f'{where}.{field}={value!r}: pass a finite number, or None if not '
                         'known yet (set_field fills it in later)')
      value = float(np.float32(value))
    scalars[field] = value
  return Prepared(sid, sid.encode(), int(version), prompt, response, logprobs, **scalars)


def _token_ids(values: Any, where: str) -> np.ndarray:
  """`values` as a 1-D integer array (its range is checked by `prepare`)."""
  array = np.asarray(values)
  if array.size == 0:
    return np.zeros(0, np.int32)
  if array.ndim != 1 or array.dtype.kind not in 'iu':
    raise ValueError(f'{where} has dtype {array.dtype} and shape {array.shape}: pass a 1-D '
                     'sequence of integer token ids')
  return array


def _out_of_range(ids: np.ndarray) -> bool:
  return bool(ids.size) and (ids.min() < 0 or ids.max() > _MAX_TOKEN_ID)


def first_difference(p: Prepared, stored: StoredRow) -> str | None:
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


def ready_fields(ready: str | Iterable[str], consumed: bool | None) -> tuple[str, ...]:
  """Checks the `ready` and `consumed` filters of a read; returns `ready` as a tuple."""
  ready = (ready,) if isinstance(ready, str) else tuple(ready)
  for field in ready:
    if field not in READY_FIELDS:
      raise ValueError(f'ready={ready!r}: unknown field {field!r}; fields with a ready flag '
                       f'are {READY_FIELDS}')
  if consumed is not None and not isinstance(consumed, (bool, np.bool_)):
    raise ValueError(f'consumed={consumed!r}: pass True, False or None (either)')
  return ready


def filter_rows(table: Table, rows: np.ndarray, version: int | Iterable[int] | None,
                ready: tuple[str, ...], consumed: bool | None, need_status: bool
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
  """Of `rows` (ascending), those that match every filter: (their index rows, or none when
  neither needed nor read; the rows; their status rows, or None when not needed)."""
  index = np.zeros((0, len(IX)), np.int64)
  if len(rows) and (need_status or version is not None):
    index = table.arrays['index'][rows[0]:rows[-1] + 1].read().result()[rows - rows[0]]
  if version is not None:
    versions = [version] if isinstance(version, (int, np.integer)) else list(version)
    keep = np.isin(index[:, IX['policy_version']], versions)
    rows, index = rows[keep], index[keep]
  status = None
  if len(rows) and (need_status or ready or consumed is not None):
    status = table.arrays['status'][rows[0]:rows[-1] + 1].read().result()[rows - rows[0]]
    required = sum(BIT[f] for f in set(ready))
    keep = (status[:, 0] & required) == required
    if consumed is not None:
      keep &= ((status[:, 0] & BIT['consumed']) != 0) == bool(consumed)
    rows, status = rows[keep], status[keep]
    if len(index):
      index = index[keep]
  return index, rows, status


def load_rows(table: Table, idx: np.ndarray, rows: np.ndarray,
              status: np.ndarray | None) -> list[StoredRow]:
  """StoredRows for `rows` (ascending) with their `index` rows `idx` and `status` rows: reads
  the sample_ids and token spans."""
  if not len(rows):
    return []
  (sample_ids,) = _read_slices([table.arrays['sample_ids']], idx[:, IX['sample_id_start']],
                               idx[:, IX['sample_id_len']])
  (prompts,) = _read_slices([table.arrays['prompt_ids']], idx[:, IX['prompt_start']],
                            idx[:, IX['prompt_len']])
  responses, logprobs = _read_slices(
      [table.arrays['response_ids'], table.arrays['logprobs']],
      idx[:, IX['response_start']], idx[:, IX['response_len']])
  flags = status[:, 0]
  values = {f: status[:, STATUS_COL[f]].view(np.float32) for f in SETTABLE_FIELDS}
  out = []
  for i, row in enumerate(rows):
    ready = frozenset(f for f in READY_FIELDS if flags[i] & BIT[f])
    scalars = {f: float(values[f][i]) if f in ready else None for f in SETTABLE_FIELDS}
    out.append(StoredRow(
        sample_id=sample_ids[i].tobytes().decode(), policy_version=int(idx[i, IX['policy_version']]),
        prompt_ids=prompts[i], response_ids=responses[i], logprobs=logprobs[i], **scalars,
        index=int(row), ready=ready, consumed=bool(flags[i] & BIT['consumed'])))
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
