"""The journal: every served row to the ExperienceStore, and back.

Rows are appended once a step per agent (an append costs ≈10 ms of fsyncs, however
small), on one background thread, in order, off the rollout's critical path. Rows
are marked consumed once a checkpoint holds the update that trained on them; the
rows a checkpoint carries over are named by id and read back from the store on
restore.

What the journal keeps stays bounded: at each checkpoint the store lets go of the ids of
every row but those the checkpoint carries (see store/ids.py), and with retention
(`config.store_keep_steps`) it drops the rows of steps older than that many, but those
the last two checkpoints carry (the checkpointer keeps two; a resume may fall back to the
older).
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Mapping, Sequence

import numpy as np

from flexmarl.data.groups import Group
from flexmarl.data.records import ServedGroup
from flexmarl.data.sample_id import parse_sample_id
from flexmarl.metrics.spans import STORE_WRITE, SpanRecorder
from flexmarl.store.experience_store import ExperienceStore, Row


class Journal:

  def __init__(self, store: ExperienceStore, agents: Sequence[str],
               recorder: SpanRecorder | None = None):
    self.store, self.recorder = store, recorder
    self._rows: dict[str, list[Row]] = {n: [] for n in agents}
    self._trained: dict[str, list[str]] = {n: [] for n in agents}
    self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='store')
    self._writes: list[concurrent.futures.Future] = []
    # per agent, (step, the table's end after that step's append), oldest first
    self._ends: dict[str, collections.deque[tuple[int, int]]] = {
        n: collections.deque() for n in agents}
    self._carried_before: dict[str, list[str]] = {n: [] for n in agents}

  def record(self, name: str, groups: Sequence[Group]) -> None:
    """Queue served rows, with rewards and advantages, for the agent's table."""
    for g in groups:
      s = g.served
      self._rows[name] += [
          Row(sid, s.version, s.prompt_ids, tokens, logprobs, float(r), float(a))
          for sid, tokens, logprobs, r, a in zip(s.sample_ids, s.tokens, s.logprobs,
                                                 g.rewards, g.advantages)]

  def trained(self, name: str, groups: Sequence[Group]) -> None:
    """Rows an update trained on: consumed once the next checkpoint is written."""
    self._trained[name] += [s for g in groups for s in g.served.sample_ids]

  def to_consume(self, name: str) -> list[str]:
    """The rows trained on since the last checkpoint: the next checkpoint names them, so
    that a resume from it marks them consumed again where a crash cut `checkpointed` off
    (between the checkpoint's write and the store's marks)."""
    return list(self._trained[name])

  def resumed(self, name: str, trained: Sequence[str]) -> None:
    """A resume from a checkpoint that names `trained` (see `to_consume`): mark those
    rows consumed, as `checkpointed` did or would have done before a crash (marking is
    idempotent); rows retention has dropped since stay dropped."""
    missing = set(self.store.missing(name, trained)) if trained else set()
    self.store.mark_consumed(name, [s for s in trained if s not in missing])

  def write(self, step: int) -> None:
    """Append the queued rows of step `step` in the background.

    A rerun after a crash serves the same queries at the same versions and so draws
    the same rows: their append is a no-op (and raises if anything differs)."""
    self.flush(wait=False)
    for name, rows in self._rows.items():
      if rows:
        self._writes.append(self._writer.submit(self._append, name, rows, step))
    self._rows = {n: [] for n in self._rows}

  def _append(self, name: str, rows: Sequence[Row], step: int) -> None:
    if self.recorder is None:
      self.store.append(name, rows)
    else:
      with self.recorder.span(f'store:{name}', STORE_WRITE, agent=name, rows=len(rows),
                              step=step):
        self.store.append(name, rows)
    self._ends[name].append((step, self.store.end(name)))

  def flush(self, wait: bool = True) -> None:
    """Re-raise any failed append; with `wait`, first let every pending one finish."""
    pending = []
    for f in self._writes:
      if wait or f.done():
        f.result()
      else:
        pending.append(f)
    self._writes = pending

  def checkpointed(self, step: int, carried: Mapping[str, Sequence[str]],
                   keep_steps: int = 0) -> None:
    """A checkpoint of step `step`, carrying the rows `carried` (ids per agent), now holds
    every update so far: mark their rows consumed, let the store forget the other rows'
    ids, and with `keep_steps` > 0 drop the rows of steps before `step - keep_steps`."""
    for name, ids in self._trained.items():
      self.store.mark_consumed(name, ids)
      ids.clear()
      keep = list(carried.get(name, ()))
      self.store.settle(name, keep)
      ends = self._ends[name]
      horizon = None
      while ends and ends[0][0] <= step - keep_steps:
        horizon = ends.popleft()[1]
      if keep_steps and horizon is not None:
        self.store.drop_below(name, horizon, keep=keep + self._carried_before[name])
      self._carried_before[name] = keep

  def close(self) -> None:
    self.flush()
    self._writer.shutdown()
    self.store.close()


def group_ref(g: Group) -> dict:
  """A buffered group as the checkpoint names it: its rows live in the ExperienceStore, and
  its call is read back from its sample ids."""
  s = g.served
  return dict(query_id=s.query_id, agent=s.agent, sample_ids=s.sample_ids,
              correct=g.correct.tolist(), expected=g.expected)


class CarriedRowsLost(RuntimeError):
  """A checkpoint carries rows that its agent's store table no longer holds: the table was
  deleted (`unreadable` False) or cannot be read, e.g. a truncated chunk (`unreadable` True)."""

  def __init__(self, agent: str, cause: str, unreadable: bool):
    super().__init__(f'agent {agent!r}: the checkpoint carries rows that the store does not '
                     f'hold with reward and advantage: {cause}')
    self.agent, self.cause, self.unreadable = agent, cause, unreadable


def groups_from_store(store: ExperienceStore, agent: str, refs: Sequence[dict]) -> list[Group]:
  """The groups `refs` name, read back from the agent's store table (one read); raises
  CarriedRowsLost when the table lost them."""
  ids = [s for ref in refs for s in ref['sample_ids']]
  try:
    missing = store.missing(agent, ids)
    if missing:
      raise CarriedRowsLost(agent, f'{len(missing)} rows are not in its table, e.g. '
                            f'{missing[:3]}', unreadable=False)
    rows = {r.sample_id: r for r in store.read(agent, sample_ids=ids,
                                                ready=('reward', 'advantage'))}
  except ValueError as e:  # TensorStore's read errors (a damaged chunk) are ValueErrors
    raise CarriedRowsLost(agent, f'its table cannot be read ({e})', unreadable=True) from e
  missing = [s for s in ids if s not in rows]
  if missing:
    raise CarriedRowsLost(agent, f'{len(missing)} rows lack their reward or advantage, e.g. '
                          f'{missing[:3]}', unreadable=False)
  out = []
  for ref in refs:
    mine = [rows[s] for s in ref['sample_ids']]
    call = parse_sample_id(ref['sample_ids'][0]).call
    served = ServedGroup(ref['query_id'], call, ref['agent'], mine[0].policy_version,
                         mine[0].prompt_ids.tolist(), ref['sample_ids'],
                         [r.response_ids for r in mine], [r.logprobs for r in mine])
    out.append(Group(served, np.array([r.reward for r in mine], np.float32),
                     np.array([r.advantage for r in mine], np.float32),
                     np.asarray(ref['correct'], np.float32), ref.get('expected')))
  return out
