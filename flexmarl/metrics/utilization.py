"""Where the time went: utilization, bubbles and critical paths, as pure functions of spans.

Definitions (per track, over a window [t0, t1)):
- busy: the length of the union of its non-wait spans clipped to the window
  (overlapping spans, e.g. concurrent requests on one instance, count once);
- idle = wall - busy, with wall = t1 - t0, so busy + idle = wall exactly;
- bubble: the idle time *between* its first and last busy moment in the window (gaps
  inside its work, as in a pipeline), a part of idle.
A group (the track name before '/') sums its tracks, so its wall is device-group
seconds: n tracks x window. A step's window runs from the first start to the last
end of the spans tagged with that step; its critical path is the chain of its spans
that ends last, each link the span that ended last before the next one started.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from flexmarl.metrics.spans import Span, group_of

Interval = tuple[float, float]


def merge(intervals: Iterable[Interval]) -> list[Interval]:
  """The union of intervals as sorted disjoint intervals (touching ones joined)."""
  out: list[list[float]] = []
  for start, end in sorted(intervals):
    if out and start <= out[-1][1]:
      out[-1][1] = max(out[-1][1], end)
    else:
      out.append([start, end])
  return [(s, e) for s, e in out]


def clip(intervals: Iterable[Interval], window: Interval) -> list[Interval]:
  t0, t1 = window
  return [(max(s, t0), min(e, t1)) for s, e in intervals if min(e, t1) > max(s, t0)]


@dataclasses.dataclass(frozen=True)
class Usage:
  wall: float
  busy: float
  bubble: float

  @property
  def idle(self) -> float:
    return self.wall - self.busy

  @property
  def utilization(self) -> float:
    return self.busy / self.wall if self.wall > 0 else 0.0

  def __add__(self, other: Usage) -> Usage:
    return Usage(self.wall + other.wall, self.busy + other.busy, self.bubble + other.bubble)

  def as_dict(self) -> dict[str, float]:
    return {'wall_s': self.wall, 'busy_s': self.busy, 'idle_s': self.idle,
            'bubble_s': self.bubble, 'utilization': self.utilization}


def interval_usage(busy: Sequence[Interval], window: Interval) -> Usage:
  """Usage of one track from its busy intervals (any order, may overlap)."""
  merged = merge(clip(busy, window))
  total = sum(e - s for s, e in merged)
  bubble = (merged[-1][1] - merged[0][0]) - total if merged else 0.0
  return Usage(window[1] - window[0], total, bubble)


def span_window(spans: Iterable[Span]) -> Interval:
  spans = list(spans)
  if not spans:
    raise ValueError('no spans: a window needs at least one span.')
  return min(s.start for s in spans), max(s.end for s in spans)


def track_usage(spans: Iterable[Span], window: Interval,
                tracks: Iterable[str] = ()) -> dict[str, Usage]:
  """Usage of every track seen in `spans` or named in `tracks` (idle ones included)."""
  busy: dict[str, list[Interval]] = {t: [] for t in tracks}
  for s in spans:
    busy.setdefault(s.track, [])
    if s.busy:
      busy[s.track].append((s.start, s.end))
  return {t: interval_usage(iv, window) for t, iv in sorted(busy.items())}


def group_usage(per_track: dict[str, Usage]) -> dict[str, Usage]:
  groups: dict[str, Usage] = {}
  for track, u in per_track.items():
    g = group_of(track)
    groups[g] = groups[g] + u if g in groups else u
  return groups


def step_windows(spans: Iterable[Span]) -> dict[int, Interval]:
  by_step: dict[int, list[Span]] = {}
  for s in spans:
    if s.step is not None:
      by_step.setdefault(s.step, []).append(s)
  return {step: span_window(ss) for step, ss in sorted(by_step.items())}


def critical_path(spans: Iterable[Span], eps: float = 1e-9) -> list[Span]:
  """The chain of busy spans ending last: from the span that ends last, step back to
  the span that ended last at or before it started, and so on (first to last)."""
  todo = sorted((s for s in spans if s.busy), key=lambda s: (s.end, s.duration))
  ends = [s.end for s in todo]
  path, hi = [], len(todo)
  while hi > 0:
    path.append(todo[hi - 1])
    # Candidates for the next link: spans before it in `todo` that ended by its start.
    hi = bisect.bisect_right(ends, path[-1].start + eps, 0, hi - 1)
  return path[::-1]


def step_report(spans: Sequence[Span]) -> dict[int, dict]:
  """Per step: wall, usage per group (over all spans in the step's window, whatever
  step they belong to), the track with the most busy time, and the critical path."""
  tracks = {s.track for s in spans}
  spans = sorted(spans, key=lambda s: s.start)
  starts = [s.start for s in spans]
  longest = max((s.duration for s in spans), default=0.0)
  by_step: dict[int, list[Span]] = {}
  for s in spans:
    by_step.setdefault(s.step, []).append(s)
  report = {}
  for step, window in step_windows(spans).items():
    # Only spans starting in [t0 - longest, t1) can overlap the window.
    near = spans[bisect.bisect_left(starts, window[0] - longest):
                 bisect.bisect_left(starts, window[1])]
    per_track = track_usage([s for s in near if s.end > window[0]], window, tracks)
    path = critical_path(by_step[step])
    report[step] = {
        'wall_s': window[1] - window[0],
        'groups': group_usage(per_track),
        'bound_by': max(per_track, key=lambda t: per_track[t].busy),
        'critical_path': path,
        'critical_busy_s': sum(s.duration for s in path),
    }
  return report


def step_scalars(entry: dict) -> dict[str, float]:
  """One `step_report` entry as flat scalars for metrics.jsonl / TensorBoard."""
  out = {'step_wall_s': entry['wall_s'], 'critical_busy_s': entry['critical_busy_s']}
  for group, u in entry['groups'].items():
    out[f'util/{group}'] = u.utilization
    out[f'bubble_s/{group}'] = u.bubble
  return out


def bound_by_summary(bound_by: Mapping[int, str], last: int) -> dict:
  """Which track bound the steps, in a size that does not grow with the run: how many
  steps each track bound (most first), and the track of each of the `last` steps."""
  counts = collections.Counter(bound_by.values())
  recent = sorted(bound_by)[-last:] if last > 0 else []
  return {'steps': dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))),
          'last_steps': {str(step): bound_by[step] for step in recent}}


def run_summary(spans: Sequence[Span], last_steps: int = 20) -> dict:
  """Whole-run usage per group, the mean step wall and what bound the steps (counts, and
  the last `last_steps` steps), JSON-ready for summary.json."""
  if not spans:
    return {}
  window = span_window(spans)
  groups = group_usage(track_usage(spans, window))
  steps = step_report(spans)
  walls = [e['wall_s'] for e in steps.values()]
  return {'window_s': window[1] - window[0],
          'groups': {g: u.as_dict() for g, u in groups.items()},
          'mean_step_wall_s': sum(walls) / len(walls) if walls else None,
          'bound_by': bound_by_summary({s: e['bound_by'] for s, e in steps.items()},
                                       last_steps)}
