"""Spans: what each device group did, when, for which agent and version.

The parts that do the work record spans on a `SpanRecorder`: one span per generate
call, micro-batch, optimizer step, weight sync, swap, store write or wait. A span
sits on a *track*, one device group or instance: 'train:router' (a training mesh),
'rollout:reverser/0' (instance 0 of the reverser's rollout tier). The text before
the first '/' is the track's *group*; utilization is computed per track and per
group (flexmarl.metrics.utilization).

The recorder streams every span to `WORKDIR/trace.json` in the Trace Event format
(JSON array form), which Perfetto and chrome://tracing open: one process per group,
one thread per track, each named by metadata events; times in microseconds of the
clock (epoch-anchored for a real run, so resumed segments follow each other on one
timeline). One file spans all segments of a run: a resumed run drops the spans of
steps past the restored one (as metrics.jsonl does; that lost time shows as a gap)
and appends. Each event is one line, so a crash loses at most the line being written.

A long run keeps a window: with `keep_steps` N > 0 the file holds the spans of the
last N to 1.5 N steps (and every span that names no step): once it holds more, it is
rewritten with the last N. So it stays a size Perfetto opens, however long the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from flexmarl.core.clock import Clock

TRACE_FILE = 'trace.json'

# Span names the parts use (the trace's `cat`); WAIT spans are not busy time.
GENERATE = 'generate'          # a sampler call on a rollout instance
MICRO_BATCH = 'micro_batch'    # forward/backward of one micro-batch on a training mesh
OPTIMIZER_STEP = 'optimizer_step'
WEIGHT_SYNC = 'weight_sync'    # publishing new weights to a rollout instance
SWAP_IN = 'swap_in'            # an agent's train state host/storage -> mesh
SWAP_OUT = 'swap_out'          # mesh -> host/storage
STORE_WRITE = 'store_write'    # rows appended to the experience store
WAIT = 'wait'                  # a device group held but idle, waiting for work
IDLE_NAMES = frozenset({WAIT})


@dataclasses.dataclass(frozen=True)
class Span:
  """[start, end) in seconds on `track`; args: agent, version, tokens, bytes, step..."""

  track: str
  name: str
  start: float
  end: float
  args: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def duration(self) -> float:
    return self.end - self.start

  @property
  def step(self) -> int | None:
    return self.args.get('step')

  @property
  def busy(self) -> bool:
    return self.name not in IDLE_NAMES


def group_of(track: str) -> str:
  """'rollout:reverser/0' -> 'rollout:reverser': the device group a track belongs to."""
  return track.split('/', 1)[0]


def label(span: Span) -> str:
  """The name Perfetto shows on the slice: 'generate reverser v3'."""
  parts = [span.name]
  if span.args.get('agent') is not None:
    parts.append(str(span.args['agent']))
  if span.args.get('version') is not None:
    parts.append(f"v{span.args['version']}")
  return ' '.join(parts)


def _step_of(event: dict) -> int | None:
  """The step a span event belongs to; None for metadata and spans of no step."""
  return (event.get('args') or {}).get('step') if event.get('ph') == 'X' else None


class TraceWriter:
  """Appends spans to a Trace Event JSON file; valid JSON again after `close()`.
  `keep_steps` > 0 bounds the file to a window of recent steps (see the module)."""

  def __init__(self, path: str, resume_step: int = 0, keep_steps: int = 0):
    if keep_steps < 0:
      raise ValueError(f'TraceWriter(keep_steps={keep_steps}): give the steps to keep, '
                       'or 0 to keep every step.')
    self.path, self.keep_steps = path, keep_steps
    events = read_events(path) if resume_step and os.path.exists(path) else []
    events = [e for e in events if (_step_of(e) or 0) <= resume_step]
    self._pids: dict[str, int] = {}
    self._tids: dict[str, int] = {}
    for e in events:
      if e.get('ph') == 'M' and e['name'] == 'process_name':
        self._pids[e['args']['name']] = e['pid']
      elif e.get('ph') == 'M' and e['name'] == 'thread_name':
        self._tids[e['args']['name']] = e['tid']
    self._rewrite(events)

  def _rewrite(self, events: list[dict]) -> None:
    """Replace the file by `events` (atomically) and append from there on."""
    tmp = self.path + '.tmp'
    with open(tmp, 'w', encoding='utf-8') as f:
      f.write('[\n' + ''.join(f'{"," if i else ""}{json.dumps(e)}\n' for i, e in enumerate(events)))
    os.replace(tmp, self.path)
    steps = [s for s in map(_step_of, events) if s is not None]
    self._oldest = min(steps, default=None)  # the span steps the file holds
    self._newest = max(steps, default=None)
    self._first = not events
    self._file = open(self.path, 'a', encoding='utf-8')

  def _keep_window(self) -> None:
    """Drop the spans of all but the last `keep_steps` steps once the file holds 1.5×
    that many (so the rewrite's cost is spread over half a window of steps)."""
    if not self.keep_steps or self._oldest is None:
      return
    if self._newest - self._oldest + 1 <= self.keep_steps + self.keep_steps // 2:
      return
    self._file.close()
    first = self._newest - self.keep_steps + 1
    self._rewrite([e for e in read_events(self.path)
                   if _step_of(e) is None or _step_of(e) >= first])

  def _line(self, event: dict) -> str:
    line = ('' if self._first else ',') + json.dumps(event) + '\n'
    self._first = False
    return line

  def _ids(self, track: str) -> tuple[int, int, str]:
    """(pid, tid) of a track, and the metadata lines naming them if they are new."""
    meta = ''
    group = group_of(track)
    if group not in self._pids:
      self._pids[group] = len(self._pids) + 1
      meta += self._line({'name': 'process_name', 'ph': 'M', 'pid': self._pids[group], 'tid': 0,
                          'args': {'name': group}})
    pid = self._pids[group]
    if track not in self._tids:
      self._tids[track] = len(self._tids) + 1
      meta += self._line({'name': 'thread_name', 'ph': 'M', 'pid': pid, 'tid': self._tids[track],
                          'args': {'name': track}})
    return pid, self._tids[track], meta

  def write(self, span: Span) -> None:
    pid, tid, meta = self._ids(span.track)
    event = {'name': label(span), 'cat': span.name, 'ph': 'X', 'ts': round(span.start * 1e6, 3),
             'dur': round(span.duration * 1e6, 3), 'pid': pid, 'tid': tid, 'args': dict(span.args)}
    self._file.write(meta + self._line(event))
    self._file.flush()
    if span.step is not None:
      self._oldest = span.step if self._oldest is None else min(self._oldest, span.step)
      self._newest = span.step if self._newest is None else max(self._newest, span.step)
      self._keep_window()

  def close(self) -> None:
    if not self._file.closed:
      self._file.write(']\n')
      self._file.close()


def read_events(path: str) -> list[dict]:
  """Every event of a trace file, closed or not; a torn last line is skipped."""
  events = []
  with open(path, encoding='utf-8') as f:
    for raw in f:
      line = raw.strip().lstrip(',')
      if line in ('', '[', ']'):
        continue
      try:
        events.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return events


def load_spans(path: str) -> list[Span]:
  """The spans of a trace file (the inverse of `TraceWriter.write`), by start time."""
  events = read_events(path)
  tracks = {(e['pid'], e['tid']): e['args']['name'] for e in events
            if e.get('ph') == 'M' and e['name'] == 'thread_name'}
  spans = [Span(tracks[(e['pid'], e['tid'])], e['cat'], e['ts'] / 1e6,
                (e['ts'] + e['dur']) / 1e6, e.get('args', {}))
           for e in events if e.get('ph') == 'X']
  return sorted(spans, key=lambda s: (s.start, s.end))


class SpanRecorder:
  """Thread-safe sink for spans: keeps them in memory (for per-step metrics) and
  streams them to a `TraceWriter` when one is given."""

  def __init__(self, clock: Clock, writer: TraceWriter | None = None):
    self.clock = clock
    self._writer = writer
    # The step a span belongs to unless it says otherwise (the run loop sets it).
    self.step: int | None = None
    self._spans: list[Span] = []
    self._lock = threading.Lock()

  @classmethod
  def for_workdir(cls, clock: Clock, workdir: str, resume_step: int = 0,
                  keep_steps: int = 0) -> SpanRecorder:
    return cls(clock, TraceWriter(os.path.join(workdir, TRACE_FILE), resume_step, keep_steps))

  @contextlib.contextmanager
  def span(self, track: str, name: str, **args: Any) -> Iterator[dict[str, Any]]:
    """Times the body; yields `args`, so the body can add what it learns
    (e.g. `a['tokens'] = n` once the call returned)."""
    start = self.clock.now()
    try:
      yield args
    finally:
      self.add(track, name, start, self.clock.now(), **args)

  def add(self, track: str, name: str, start: float, end: float, **args: Any) -> Span:
    """Records a span whose times are already known (e.g. a simulated job)."""
    if end < start:
      raise ValueError(f'span {name!r} on {track!r} ends before it starts '
                       f'(start={start}, end={end}): pass end >= start.')
    args.setdefault('step', self.step)
    span = Span(track, name, float(start), float(end),
                {k: v for k, v in args.items() if v is not None})
    with self._lock:
      self._spans.append(span)
      if self._writer is not None:
        self._writer.write(span)
    return span

  def write_to(self, writer: TraceWriter) -> None:
    """Stream every span from now on to `writer` (a run knows where its trace resumes
    only once it has restored its checkpoint)."""
    with self._lock:
      self._writer = writer

  def spans(self, step: int | None = None) -> list[Span]:
    """A copy of the spans in memory, all of them or those tagged `step`."""
    with self._lock:
      return [s for s in self._spans if step is None or s.step == step]

  def discard(self, up_to_step: int) -> None:
    """Drops from memory (not from the trace) the spans of steps <= `up_to_step`."""
    with self._lock:
      self._spans = [s for s in self._spans if s.step is None or s.step > up_to_step]

  def close(self) -> None:
    with self._lock:
      if self._writer is not None:
        self._writer.close()
