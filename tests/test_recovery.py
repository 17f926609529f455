"""Damaged workdirs: each fault is named, recovered from where it can be, and said so."""

import glob
import json
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flexmarl.metrics.stall import StallWatch
from flexmarl.metrics.summary import write_summary
from flexmarl.metrics.writer import MetricsWriter
from flexmarl.runtime.interrupt import StopRequest
from flexmarl.store.experience_store import ExperienceStore, Row
from flexmarl.train.checkpoint import AgentCheckpointer, CheckpointError, restore_latest

STATE = {'params': {'w': jnp.arange(1000.0)}, 'opt_state': {'m': jnp.ones(1000)}}


def _checkpoints(workdir, steps=(1, 2)):
  cs = {n: AgentCheckpointer(str(workdir), n) for n in ('a', 'b')}
  for s in steps:
    for c in cs.values():
      c.save(s, jax.tree.map(lambda x: x * s, STATE), {'step': s})
    for c in cs.values():
      c.wait()
  return cs


def _truncate_largest(folder):
  f = max(glob.glob(f'{folder}/state/ocdbt.process_0/d/*'), key=os.path.getsize)
  with open(f, 'r+b') as fh:
    fh.truncate(100)


def _restore(workdir):
  cs = {n: AgentCheckpointer(str(workdir), n) for n in ('a', 'b')}
  return restore_latest(cs, {n: STATE for n in cs})


@pytest.mark.quick
@pytest.mark.parametrize('damage', ['truncated_array', 'deleted_meta'])
def test_damaged_checkpoint_falls_back_and_says_so(tmp_path, damage):
  cs = _checkpoints(tmp_path)
  newest = os.path.join(cs['b'].directory, '2')
  if damage == 'truncated_array':
    _truncate_largest(newest)
  else:
    os.remove(os.path.join(newest, 'meta', 'metadata'))
  step, states, metas, warnings = _restore(tmp_path)
  assert step == 1 and metas['b'] == {'step': 1}
  np.testing.assert_array_equal(states['b']['params']['w'], np.arange(1000.0))
  assert len(warnings) == 1 and newest in warnings[0] and 'falling back' in warnings[0]


def test_no_intact_checkpoint_is_a_clear_error(tmp_path):
  cs = _checkpoints(tmp_path)
  for s in ('1', '2'):
    _truncate_largest(os.path.join(cs['a'].directory, s))
  with pytest.raises(CheckpointError, match=r'no checkpoint step is intact(.|\n)*new --workdir'):
    _restore(tmp_path)


def test_step_missing_for_one_agent_is_reported(tmp_path):
  cs = _checkpoints(tmp_path)
  cs['a'].save(3, STATE, {'step': 3})
  cs['a'].wait()
  step, _, _, warnings = _restore(tmp_path)
  assert step == 2 and 'steps [3] are not saved for every agent' in warnings[0]


def test_no_checkpoint_is_step_zero(tmp_path):
  assert _restore(tmp_path) == (0, {}, {}, [])


def _rows(n, start=0):
  return [Row(f'q{i}_0_0', 0, [1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], 1.0, 0.5)
          for i in range(start, start + n)]


def test_commit_claiming_unwritten_rows_is_trimmed_without_phantoms(tmp_path):
  with ExperienceStore.open(tmp_path, ['a']) as store:
    store.append('a', _rows(5))
  path = tmp_path / 'a' / 'commit.json'
  commit = json.loads(path.read_text())
  path.write_text(json.dumps(dict(commit, rows=9, sample_ids=commit['sample_ids'] + 24)))
  store = ExperienceStore.open(tmp_path, ['a'])
  assert len(store.recovered) == 1 and 'claimed 9 rows but only the first 5' in store.recovered[0]
  assert [r.sample_id for r in store.read('a')] == [f'q{i}_0_0' for i in range(5)]
  store.append('a', _rows(1, start=5))  # appended right after the real rows
  assert [r.sample_id for r in store.read('a')][-2:] == ['q4_0_0', 'q5_0_0']
  store.close()
  assert ExperienceStore.open(tmp_path, ['a']).recovered == []


def test_commit_with_the_right_rows_but_inflated_ends_is_trimmed(tmp_path):
  """Bug: a commit checked by its row count only; the next append then lands past the
  real data, and reopening drops it."""
  with ExperienceStore.open(tmp_path, ['a']) as store:
    store.append('a', _rows(5))
  path = tmp_path / 'a' / 'commit.json'
  commit = json.loads(path.read_text())
  path.write_text(json.dumps(dict(commit, sample_ids=commit['sample_ids'] + 24,
                                  prompt_ids=commit['prompt_ids'] + 3,
                                  response_ids=commit['response_ids'] + 7)))
  store = ExperienceStore.open(tmp_path, ['a'])
  assert len(store.recovered) == 1 and 'claimed 5 rows' in store.recovered[0]
  assert json.loads(path.read_text()) == commit
  store.append('a', _rows(1, start=5))
  store.close()
  store = ExperienceStore.open(tmp_path, ['a'])
  assert store.recovered == []
  rows = store.read('a')
  assert [r.sample_id for r in rows] == [f'q{i}_0_0' for i in range(6)]
  assert rows[-1].response_ids.tolist() == [3, 4, 5] and rows[-1].prompt_ids.tolist() == [1, 2]
  store.close()


def test_deleted_store_says_what_to_do(tmp_path):
  store = ExperienceStore.open(tmp_path, ['a'])
  store.append('a', _rows(2))
  os.remove(tmp_path / 'a' / 'commit.json')
  with pytest.raises(RuntimeError, match='lost its commit.json.*restore the store folder.*new'):
    store.read('a')
  (tmp_path / 'a' / 'commit.json').write_text('{"format": 1, "rows": ')
  with pytest.raises(RuntimeError, match='commit.json is damaged.*Fix'):
    ExperienceStore.open(tmp_path, ['a']).read('a')


def _metrics(workdir, steps):
  writer = MetricsWriter(str(workdir))
  for step in range(1, steps + 1):
    writer.write(step, 'solver', dict(reward_mean=step / 10, accuracy=step / 10, updated=1))
    writer.write(step, 'team', dict(tokens=10, step_time_s=1.0))
  writer.close()


def test_torn_line_in_the_middle_is_reported_and_counts_stay_right(tmp_path):
  _metrics(tmp_path, 6)
  path = tmp_path / 'metrics.jsonl'
  lines = path.read_text().splitlines(keepends=True)
  lines[5] = lines[5][:20] + '\n'  # step 3's team line, torn
  path.write_text(''.join(lines))
  summary = write_summary(str(tmp_path), wall_s=1.0, window=2)
  assert summary['steps'] == 6 and summary['agents']['solver']['updates'] == 6
  assert summary['agents']['solver']['first_reward'] == pytest.approx(0.15)  # mean of 2 first
  assert summary['agents']['solver']['last_reward'] == pytest.approx(0.55)
  assert len(summary['problems']) == 1 and 'metrics.jsonl:6 skipped' in summary['problems'][0]
  writer = MetricsWriter(str(tmp_path), resume_step=4)
  writer.close()
  assert 'metrics.jsonl:6' in writer.problems[0]


def test_deleted_metrics_file_is_reported_on_resume(tmp_path):
  writer = MetricsWriter(str(tmp_path), resume_step=3)
  writer.close()
  assert 'missing: the metrics of steps 1..3 are lost' in writer.problems[0]
  summary = write_summary(str(tmp_path), 0.0, steps=3)
  assert summary['steps'] == 3 and summary['metrics_lost'] == '1..3'
  assert 'steps 1..3 are lost' in summary['problems'][-1]


def test_metrics_cut_mid_line_names_the_lost_steps(tmp_path):
  """A file cut in the middle of step 2's lines: the torn line is reported, and so are the
  steps after it that lost every line; the summary still counts the run's steps."""
  _metrics(tmp_path, 4)
  path = tmp_path / 'metrics.jsonl'
  text = path.read_text()
  path.write_text(text[:text.index('"step": 2') + 30])  # inside step 2's first line
  writer = MetricsWriter(str(tmp_path), resume_step=4)
  writer.write(5, 'solver', dict(reward_mean=0.5, accuracy=0.5, updated=1))
  writer.close()
  assert any('metrics.jsonl:3 skipped' in p for p in writer.problems), writer.problems
  assert any('no lines for steps 2..4 of the 4' in p for p in writer.problems), writer.problems
  summary = write_summary(str(tmp_path), 1.0, steps=5)
  assert summary['steps'] == 5 and summary['metrics_lost'] == '2..4'
  assert summary['agents']['solver']['updates'] == 2  # steps 1 and 5


def test_lost_steps_are_named_as_ranges():
  from flexmarl.metrics.writer import format_steps, lost_steps
  lines = [{'step': s} for s in (1, 4, 5, 8)]
  assert lost_steps(lines, 9) == [2, 3, 6, 7, 9]
  assert format_steps([2, 3, 6, 7, 9]) == '2..3, 6..7, 9'
  assert lost_steps(lines, 0) == []


def test_first_ctrl_c_sets_the_flag_second_raises():
  previous = signal.getsignal(signal.SIGINT)
  with StopRequest() as stop:
    assert not stop.requested
    os.kill(os.getpid(), signal.SIGINT)
    assert stop.requested
    with pytest.raises(KeyboardInterrupt):
      os.kill(os.getpid(), signal.SIGINT)
  assert signal.getsignal(signal.SIGINT) is previous


def test_stall_watch_warns_once_per_stall():
  watch = StallWatch(threshold=0.8, patience=3)
  fractions = [1.0, 0.9, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
  warned = [s for s, f in enumerate(fractions) if watch.update('solver', s, f, entropy=0.05)]
  assert warned == [5]
  assert StallWatch(0.5, 1).update('x', 7, 1.0, accuracy=0.95) is None  # solved, not stalled
  assert StallWatch(0.5, 1).update('x', 7, 1.0, accuracy=0.3) is not None
  message = StallWatch(0.5, 1).update('x', 7, 1.0, entropy=0.05)
  assert "step 7: agent 'x' has stalled" in message and 'entropy 0.050' in message
  with pytest.raises(ValueError, match='threshold in'):
    StallWatch(threshold=2)
