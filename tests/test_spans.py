"""Spans and trace.json: Perfetto's JSON schema, resume/append, and the utilization math."""

import json
import threading

import pytest

from flexmarl.core.clock import SimClock
from flexmarl.metrics import spans as sp
from flexmarl.metrics import utilization as ut
from flexmarl.metrics.spans import Span, SpanRecorder, TraceWriter, load_spans


def _record(rec: SpanRecorder, clock: SimClock):
  with rec.span('rollout:solver/0', sp.GENERATE, agent='solver', version=0, step=1) as a:
    clock.advance(1.5)
    a['tokens'] = 96
  rec.add('rollout:solver/1', sp.GENERATE, 0.0, 1.0, agent='solver', version=0, tokens=64, step=1)
  rec.add('train:solver', sp.WAIT, 0.0, 1.5, agent='solver', step=1)
  rec.add('train:solver', sp.MICRO_BATCH, 1.5, 2.0, agent='solver', version=0, tokens=160, step=1)
  rec.add('train:solver', sp.OPTIMIZER_STEP, 2.0, 2.25, agent='solver', version=0, step=1)
  rec.add('rollout:solver/0', sp.WEIGHT_SYNC, 2.25, 2.5, agent='solver', version=1,
          bytes=4096, step=1)


def test_trace_has_the_fields_perfettos_json_loader_needs(tmp_path):
  clock = SimClock()
  rec = SpanRecorder.for_workdir(clock, str(tmp_path), resume_step=0)
  _record(rec, clock)
  rec.close()
  events = json.loads((tmp_path / sp.TRACE_FILE).read_text())
  complete = [e for e in events if e['ph'] == 'X']
  assert len(complete) == 6
  for e in complete:
    assert isinstance(e['name'], str) and e['cat'] in {sp.GENERATE, sp.WAIT, sp.MICRO_BATCH,
                                                     sp.OPTIMIZER_STEP, sp.WEIGHT_SYNC}
    assert all(isinstance(e[k], (int, float)) for k in ('ts', 'dur', 'pid', 'tid'))
  threads = {(e['pid'], e['tid']): e['args']['name'] for e in events
             if e['ph'] == 'M' and e['name'] == 'thread_name'}
  processes = {e['pid']: e['args']['name'] for e in events
               if e['ph'] == 'M' and e['name'] == 'process_name'}
  assert {(e['pid'], e['tid']) for e in complete} == set(threads)
  assert sorted(threads.values()) == ['rollout:solver/0', 'rollout:solver/1', 'train:solver']
  assert sorted(processes.values()) == ['rollout:solver', 'train:solver']
  first = complete[0]
  assert first['name'] == 'generate solver v0' and first['ts'] == 0 and first['dur'] == 1.5e6
  assert first['args'] == {'agent': 'solver', 'version': 0, 'step': 1, 'tokens': 96}
  assert load_spans(str(tmp_path / sp.TRACE_FILE)) == sorted(rec.spans(),
                                                             key=lambda s: (s.start, s.end))


def test_a_resumed_run_drops_later_steps_and_appends_to_one_valid_file(tmp_path):
  path = str(tmp_path / sp.TRACE_FILE)
  writer = TraceWriter(path)
  for step in (1, 2, 3):
    writer.write(Span('train:a', sp.MICRO_BATCH, step, step + 0.5, {'step': step}))
  writer.write(Span('rollout:a/0', sp.GENERATE, 3.5, 3.9, {'step': 3}))
  writer._file.close()  # the run dies: no closing bracket ...
  with open(path, 'a') as f:
    f.write(',{"name": "micro_b')  # ... and a torn last line
  writer = TraceWriter(path, resume_step=2)
  writer.write(Span('train:a', sp.MICRO_BATCH, 10.0, 10.5, {'step': 3}))
  writer.close()
  events = json.loads(open(path).read())
  assert [e['args']['step'] for e in events if e['ph'] == 'X'] == [1, 2, 3]
  assert len({e['tid'] for e in events if e['ph'] == 'X'}) == 1  # same track, same thread
  assert [s.start for s in load_spans(path)] == [1.0, 2.0, 10.0]
  TraceWriter(path, resume_step=0).close()  # a fresh run starts a fresh file
  assert json.loads(open(path).read()) == []


def test_recorder_is_thread_safe(tmp_path):
  rec = SpanRecorder.for_workdir(SimClock(), str(tmp_path))

  def work(i):
    for j in range(200):
      rec.add(f'rollout:a/{i}', sp.GENERATE, j, j + 1, step=j)

  threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  rec.close()
  assert len(load_spans(str(tmp_path / sp.TRACE_FILE))) == len(rec.spans()) == 800
  rec.discard(up_to_step=99)
  assert len(rec.spans()) == 400 and rec.spans(step=150)[0].track.startswith('rollout:a/')
  with pytest.raises(ValueError, match='ends before it starts'):
    rec.add('train:a', sp.SWAP_IN, 2.0, 1.0)


@pytest.mark.quick
def test_busy_plus_idle_is_wall_and_overlaps_count_once():
  spans = [Span('rollout:a/0', sp.GENERATE, 0, 2), Span('rollout:a/0', sp.GENERATE, 1, 3),
           Span('rollout:a/0', sp.GENERATE, 5, 6), Span('rollout:a/0', sp.WAIT, 3, 5),
           Span('rollout:a/1', sp.GENERATE, 8, 12), Span('train:a', sp.WAIT, 0, 10)]
  per_track = ut.track_usage(spans, (0.0, 10.0), tracks=['train:b'])
  a0 = per_track['rollout:a/0']
  assert (a0.busy, a0.idle, a0.bubble) == (4, 6, 2)  # [0,3] + [5,6]; gap 3..5 is a bubble
  assert (per_track['rollout:a/1'].busy, per_track['rollout:a/1'].bubble) == (2, 0)  # clipped
  assert per_track['train:a'].busy == 0 and per_track['train:b'].idle == 10
  groups = ut.group_usage(per_track)
  assert set(groups) == {'rollout:a', 'train:a', 'train:b'}
  assert groups['rollout:a'].wall == 20 and groups['rollout:a'].utilization == pytest.approx(0.3)
  for u in list(per_track.values()) + list(groups.values()):
    assert u.busy + u.idle == pytest.approx(u.wall)


def test_critical_path_of_a_hand_built_step():
  a1 = Span('rollout:a/0', sp.GENERATE, 0, 4, {'step': 1})
  a2 = Span('rollout:a/0', sp.GENERATE, 4, 6, {'step': 1})
  side = Span('rollout:a/1', sp.GENERATE, 1, 5.5, {'step': 1})  # ends before b starts, but early
  b = Span('train:a', sp.MICRO_BATCH, 6, 9, {'step': 1})
  wait = Span('train:a', sp.WAIT, 0, 6, {'step': 1})  # waits are never on the path
  c = Span('rollout:a/0', sp.WEIGHT_SYNC, 9, 10, {'step': 1})
  short = Span('rollout:a/1', sp.GENERATE, 6, 7, {'step': 1})
  assert ut.critical_path([side, c, wait, short, b, a2, a1]) == [a1, a2, b, c]
  report = ut.step_report([side, c, wait, short, b, a2, a1])
  entry = report[1]
  assert entry['wall_s'] == 10 and entry['critical_busy_s'] == 10
  assert entry['bound_by'] == 'rollout:a/0'
  assert entry['groups']['train:a'].busy == 3 and entry['groups']['rollout:a'].busy == 7 + 5.5
  scalars = ut.step_scalars(entry)
  assert scalars['util/train:a'] == pytest.approx(0.3)
  assert scalars['bubble_s/rollout:a'] == pytest.approx(3 + 0.5)  # a/0: 6..9; a/1: 5.5..6


def test_step_windows_overlap_in_a_pipeline_and_usage_counts_all_steps_spans():
  spans = [Span('rollout:a/0', sp.GENERATE, 0, 4, {'step': 1}),
           Span('train:a', sp.MICRO_BATCH, 4, 8, {'step': 1}),
           Span('rollout:a/0', sp.GENERATE, 4, 8, {'step': 2}),
           Span('train:a', sp.MICRO_BATCH, 8, 12, {'step': 2})]
  assert ut.step_windows(spans) == {1: (0, 8), 2: (4, 12)}
  report = ut.step_report(spans)
  assert report[2]['groups']['rollout:a'].busy == 4  # [4, 8], step 2's own
  assert report[1]['groups']['rollout:a'].busy == 8  # [0, 4] of step 1 and [4, 8] of step 2
  summary = ut.run_summary(spans)
  assert summary['window_s'] == 12 and summary['mean_step_wall_s'] == 8
  assert summary['groups']['train:a']['utilization'] == pytest.approx(8 / 12)


def test_bound_by_in_the_summary_does_not_grow_with_the_run():
  """A long run's summary holds counts per track and the last steps, not every step."""
  bound_by = {step: 'train:a' if step % 3 else 'rollout:a/0' for step in range(1, 1201)}
  summary = ut.bound_by_summary(bound_by, last=4)
  assert summary['steps'] == {'train:a': 800, 'rollout:a/0': 400}
  assert list(summary['steps']) == ['train:a', 'rollout:a/0']  # most first
  assert summary['last_steps'] == {'1197': 'rollout:a/0', '1198': 'train:a',
                                   '1199': 'train:a', '1200': 'rollout:a/0'}
  spans = [Span('rollout:a/0', sp.GENERATE, 2 * i, 2 * i + 1, {'step': i}) for i in range(1, 31)]
  spans += [Span('train:a', sp.MICRO_BATCH, 2 * i + 1, 2 * i + 1.5, {'step': i})
            for i in range(1, 31)]
  run = ut.run_summary(spans, last_steps=5)
  assert run['bound_by']['steps'] == {'rollout:a/0': 30}
  assert list(run['bound_by']['last_steps']) == ['26', '27', '28', '29', '30']
