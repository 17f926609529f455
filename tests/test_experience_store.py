"""ExperienceStore: round trips, filters, flags, duplicates, reopening, SIGKILL at any moment."""

import collections
import os
import random
import signal
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import pytest
import tensorstore as ts

from flexmarl.data import sample_id as sample_ids
from flexmarl.store.experience_store import ExperienceStore, Row, StoredRow

_AGENT = 'solver'
_BATCH_ROWS = 24


def _expected_row(sample_id: str) -> Row:
  """The row written for `sample_id`: a pure function of it, so a reader can recompute it."""
  rng = np.random.default_rng(zlib.crc32(sample_id.encode()))
  n = int(rng.integers(0, 600))
  response = rng.integers(0, 50_000, n, dtype=np.int32)
  # Logprobs derived from the ids: a shifted or mixed-up span shows as a mismatch.
  logprobs = -(response % 977).astype(np.float32) / 100 - rng.random(n, dtype=np.float32)
  return Row(sample_id, _batch_of(sample_id) % 5,
             rng.integers(0, 50_000, int(rng.integers(1, 80)), dtype=np.int32), response, logprobs)


def _expected_reward(sample_id: str) -> float:
  return float(np.float32((zlib.crc32(sample_id.encode()) % 1000) / 7))


def _batch_ids(batch: int) -> list[str]:
  return [sample_ids.sample_id(f'q{batch}', batch % 3, j) for j in range(_BATCH_ROWS)]


def _batch_of(sample_id: str) -> int:
  return int(sample_ids.parse_sample_id(sample_id).query_id[1:])


def _assert_row(got: StoredRow, want: Row) -> None:
  assert got.sample_id == want.sample_id
  assert got.policy_version == want.policy_version
  assert got.prompt_ids.dtype == np.int32 and got.response_ids.dtype == np.int32
  assert got.logprobs.dtype == np.float32
  np.testing.assert_array_equal(got.prompt_ids, want.prompt_ids)
  np.testing.assert_array_equal(got.response_ids, want.response_ids)
  np.testing.assert_array_equal(got.logprobs, want.logprobs)


@pytest.mark.quick
def test_round_trip_variable_length_rows_and_all_fields(tmp_path):
  rows = [_expected_row(s) for s in _batch_ids(0)[:6]]
  rows[1] = Row('q0_0_1', 3, [5], [], [], reward=1.5)  # empty response
  rows[2] = Row('q0_0_2', 3, [1, 2, 3], [7] * 3000, [-0.25] * 3000, reward=-2.0, advantage=0.75)
  with ExperienceStore.open(tmp_path / 'store', agents=[_AGENT, 'critic']) as store:
    assert store.append(_AGENT, rows) == 6
    got = store.read(_AGENT)
    assert store.read('critic') == [] and store.count('critic') == 0
  assert [r.index for r in got] == list(range(6))
  for g, w in zip(got, rows):
    _assert_row(g, w)
    assert g.consumed is False
  assert (got[0].reward, got[0].advantage, got[0].ready) == (None, None,
                                                               frozenset({'tokens', 'logprobs'}))
  assert (got[1].reward, got[1].advantage) == (1.5, None)
  assert got[1].ready == {'tokens', 'logprobs', 'reward'}
  assert (got[2].reward, got[2].advantage) == (-2.0, 0.75)
  assert got[2].ready == {'tokens', 'logprobs', 'reward', 'advantage'}


def test_filters_by_version_ready_consumed_and_sample_ids(tmp_path):
  store = ExperienceStore.open(tmp_path, agents=[_AGENT])
  ids = [f'q{i}_0_{j}' for i in range(6) for j in range(4)]
  store.append(_AGENT, [Row(s, int(s[1]) % 3, [1], [2, 3], [-1.0, -2.0]) for s in ids])
  rewarded, consumed = ids[::2], ids[::3]
  store.set_field(_AGENT, rewarded, 'reward', np.arange(len(rewarded), dtype=np.float32))
  store.mark_consumed(_AGENT, consumed)

  def ids_of(**filters):
    got = [r.sample_id for r in store.read(_AGENT, **filters)]
    assert store.count(_AGENT, **filters) == len(got)
    return got

  version1 = [s for s in ids if int(s[1]) % 3 == 1]
  assert ids_of(version=1) == version1
  assert ids_of(version=[0, 2]) == [s for s in ids if s not in version1]
  assert ids_of(ready=('reward',)) == rewarded
  assert ids_of(ready='reward', consumed=False) == [s for s in rewarded if s not in consumed]
  assert ids_of(consumed=True) == consumed
  assert ids_of(ready=('reward', 'advantage')) == []
  assert ids_of(version=1, consumed=False, ready=('reward',)) == [
      s for s in rewarded if s in version1 and s not in consumed]
  assert ids_of(sample_ids=[ids[5], ids[1]]) == [ids[1], ids[5]]  # insertion order
  assert ids_of(sample_ids=ids[:8], consumed=True) == [s for s in ids[:8] if s in consumed]


def test_set_field_and_mark_consumed_flip_flags(tmp_path):
  store = ExperienceStore.open(tmp_path, agents=[_AGENT])
  ids = _batch_ids(0)[:3]
  store.append(_AGENT, [_expected_row(s) for s in ids])
  assert store.count(_AGENT, ready=('reward',)) == 0
  store.set_field(_AGENT, [ids[2], ids[0]], 'reward', [2.5, -1.0])
  got = store.read(_AGENT)
  assert [r.reward for r in got] == [-1.0, None, 2.5]
  assert ['reward' in r.ready for r in got] == [True, False, True]
  assert all('advantage' not in r.ready and r.advantage is None for r in got)
  store.set_field(_AGENT, ids, 'advantage', [0.1, 0.2, 0.3])
  store.set_field(_AGENT, ids[:1], 'reward', [4.0])  # overwrite
  got = store.read(_AGENT)
  assert [r.advantage for r in got] == pytest.approx([0.1, 0.2, 0.3])
  assert [r.reward for r in got] == [4.0, None, 2.5]
  for r in got:
    _assert_row(r, _expected_row(r.sample_id))  # the token data is untouched
  store.mark_consumed(_AGENT, ids[1:])
  assert [r.consumed for r in store.read(_AGENT)] == [False, True, True]
  store.mark_consumed(_AGENT, ids[1:2], consumed=False)
  assert [r.consumed for r in store.read(_AGENT)] == [False, False, True]
  assert ExperienceStore.open(tmp_path, agents=[_AGENT]).read(_AGENT)[2].consumed  # durable


def test_duplicate_sample_ids_identical_is_noop_different_raises(tmp_path):
  store = ExperienceStore.open(tmp_path, agents=[_AGENT])
  ids = _batch_ids(1)
  rows = [_expected_row(s) for s in ids[:4]]
  assert store.append(_AGENT, rows) == 4
  assert store.append(_AGENT, rows) == 0  # a restarted producer resending its batch
  store.set_field(_AGENT, ids[:1], 'reward', [1.0])
  assert store.append(_AGENT, rows[:1]) == 0  # resent without the reward set downstream
  assert store.append(_AGENT, store.read(_AGENT)) == 0  # StoredRows resent
  assert store.append(_AGENT, [rows[0], _expected_row(ids[4])]) == 1  # only the new one
  assert store.count(_AGENT) == 5
  changed = Row(ids[2], rows[2].policy_version, rows[2].prompt_ids, rows[2].response_ids,
                np.asarray(rows[2].logprobs) - 1)
  with pytest.raises(ValueError, match=r"'q1_1_2'.*different logprobs"):
    store.append(_AGENT, [_expected_row(ids[5]), changed])
  with pytest.raises(ValueError, match='policy_version'):
    store.append(_AGENT, [Row(ids[0], 99, rows[0].prompt_ids, rows[0].response_ids,
                              rows[0].logprobs)])
  with pytest.raises(ValueError, match='reward'):
    store.append(_AGENT, [Row(ids[0], rows[0].policy_version, rows[0].prompt_ids,
                              rows[0].response_ids, rows[0].logprobs, reward=2.0)])
  with pytest.raises(ValueError, match='appears twice'):
    store.append(_AGENT, [_expected_row(ids[6]), _expected_row(ids[6])])
  assert [r.sample_id for r in store.read(_AGENT)] == ids[:5]  # nothing written by the failures


def test_bad_input_raises_before_writing(tmp_path):
  store = ExperienceStore.open(tmp_path, agents=[_AGENT])
  good = _expected_row('q0_0_0')
  cases = [
      (lambda: store.append('nobody', [good]), r"unknown agent 'nobody'.*agents=\['solver'\]"),
      (lambda: store.read('nobody'), "unknown agent 'nobody'"),
      (lambda: store.append(_AGENT, [good, Row('q0_0_1', 0, [1], [1, 2, 3], [-1.0, -1.0])]),
       r"rows\[1\] \('q0_0_1'\)\.logprobs has shape \(2,\) but response_ids has 3 tokens"),
      (lambda: store.append(_AGENT, [good, Row('q0_0_2', 0, [1], [1.5], [-1.0])]),
       r'response_ids has dtype float64'),
      (lambda: store.append(_AGENT, [Row('bad-id', 0, [1], [1], [-1.0])]),
       r"sample_id='bad-id'.*query_id"),
      (lambda: store.append(_AGENT, [Row('q0_0_3', -1, [1], [1], [-1.0])]), 'policy_version=-1'),
      (lambda: store.append(_AGENT, [Row('q0_0_4', 0, [1], [1], [np.nan])]), 'non-finite'),
      # The value checks run over the whole batch; the error still names the row.
      (lambda: store.append(_AGENT, [good, Row('q0_0_6', 0, [1], [1, 2], [-1.0, np.inf])]),
       r"rows\[1\] \('q0_0_6'\)\.logprobs has a non-finite value \(inf\)"),
      (lambda: store.append(_AGENT, [good, Row('q0_0_7', 0, [1, 2**31], [1], [-1.0])]),
       r"rows\[1\] \('q0_0_7'\)\.prompt_ids has a token id out of range.*max 2147483648"),
      (lambda: store.append(_AGENT, [good, Row('q0_0_8', 0, [1], [-3], [-1.0])]),
       r"rows\[1\] \('q0_0_8'\)\.response_ids has a token id out of range.*min -3"),
      (lambda: store.append(_AGENT, [Row('q0_0_5', 0, [1], [1], [-1.0], reward=np.inf)]),
       'reward=inf'),
      (lambda: store.set_field(_AGENT, ['q0_0_0'], 'rewrd', [1.0]),
       r"field='rewrd'.*\('reward', 'advantage'\)"),
      (lambda: store.set_field(_AGENT, ['q0_0_0'], 'logprobs', [1.0]), "field='logprobs'"),
      (lambda: store.set_field(_AGENT, ['q0_0_0'], 'reward', [1.0, 2.0]), 'one value per'),
      (lambda: store.set_field(_AGENT, 'q0_0_0', 'reward', [1.0]), 'list of sample_ids'),
      (lambda: store.read(_AGENT, ready=('rewrd',)), "unknown field 'rewrd'"),
  ]
  for call, message in cases:
    with pytest.raises(ValueError, match=message):
      call()
  assert store.count(_AGENT) == 0
  store.append(_AGENT, [good])
  with pytest.raises(ValueError, match=r"not in table 'solver'.*'q9_0_0'"):
    store.set_field(_AGENT, ['q0_0_0', 'q9_0_0'], 'reward', [1.0, 2.0])
  assert store.read(_AGENT)[0].reward is None  # the known row was not touched either
  with pytest.raises(ValueError, match='not usable as a folder name'):
    ExperienceStore.open(tmp_path, agents=['../x'])


def test_reopen_after_close_continues_appending(tmp_path):
  path = str(tmp_path / 'store')
  store = ExperienceStore.open(path, agents=[_AGENT])
  first = [_expected_row(s) for s in _batch_ids(0) + _batch_ids(1)]
  store.append(_AGENT, first)
  store.set_field(_AGENT, [first[3].sample_id], 'reward', [3.0])
  store.close()
  with pytest.raises(ValueError, match='closed'):
    store.read(_AGENT)
  store = ExperienceStore.open('file://' + path, agents=[_AGENT, 'verifier'])  # URL, new agent
  second = [_expected_row(s) for s in _batch_ids(2)]
  assert store.append(_AGENT, second) == len(second)
  assert store.append(_AGENT, first[:3]) == 0  # the reopened index knows the old ids
  store.append('verifier', second[:2])
  got = store.read(_AGENT)
  assert [r.index for r in got] == list(range(len(first) + len(second)))
  for g, w in zip(got, first + second):
    _assert_row(g, w)
  assert got[3].reward == 3.0
  assert [r.sample_id for r in store.read('verifier')] == [r.sample_id for r in second[:2]]


def test_any_kvstore_location(tmp_path):
  kv = ts.KvStore.open({'driver': 'memory'}).result()
  ExperienceStore.open(kv, agents=[_AGENT]).append(_AGENT, [_expected_row('q0_0_0')])
  (row,) = ExperienceStore.open(kv, agents=[_AGENT]).read(_AGENT)
  _assert_row(row, _expected_row('q0_0_0'))


class _Crash(Exception):
  pass


def test_append_interrupted_before_commit_is_invisible_and_overwritten(tmp_path, monkeypatch):
  store = ExperienceStore.open(tmp_path, agents=[_AGENT])
  store.append(_AGENT, [_expected_row(s) for s in _batch_ids(0)])

  def crash(self, table, commit):
    raise _Crash()

  monkeypatch.setattr(ExperienceStore, '_publish', crash)
  long_rows = [Row(s, 1, [9] * 500, [8] * 4000, [-0.5] * 4000) for s in _batch_ids(1)]
  with pytest.raises(_Crash):
    store.append(_AGENT, long_rows)  # everything written but the commit
  monkeypatch.undo()
  assert store.count(_AGENT) == _BATCH_ROWS  # the same object carries on too
  reopened = ExperienceStore.open(tmp_path, agents=[_AGENT])
  assert reopened.count(_AGENT) == _BATCH_ROWS
  with pytest.raises(ValueError, match='not in table'):
    reopened.read(_AGENT, sample_ids=_batch_ids(1)[:1])
  reopened.append(_AGENT, [_expected_row(s) for s in _batch_ids(2)])  # over the stale tail
  got = reopened.read(_AGENT)
  assert len(got) == 2 * _BATCH_ROWS
  for r in got:
    _assert_row(r, _expected_row(r.sample_id))


def test_concurrent_reader_sees_only_whole_batches(tmp_path):
  writer = ExperienceStore.open(tmp_path, agents=[_AGENT])
  reader = ExperienceStore.open(tmp_path, agents=[_AGENT])  # as another process would
  batches = 20

  def write():
    for b in range(batches):
      writer.append(_AGENT, [_expected_row(s) for s in _batch_ids(b)])

  thread = threading.Thread(target=write)
  thread.start()
  seen = set()
  while thread.is_alive() or len(seen) < batches * _BATCH_ROWS:
    rows = reader.read(_AGENT)
    assert len(rows) % _BATCH_ROWS == 0
    assert [r.sample_id for r in rows] == [s for b in range(len(rows) // _BATCH_ROWS)
                                           for s in _batch_ids(b)]
    for r in rows[len(seen):]:
      _assert_row(r, _expected_row(r.sample_id))
    seen = {r.sample_id for r in rows}
  thread.join()


# --- SIGKILL at random moments ---------------------------------------------------------------

# The producer: appends batch after batch, then sets their rewards, saying what it does (and how
# long each step took) on stdout.
_CHILD = """
import sys
import time
sys.path.insert(0, sys.argv[1])
from test_experience_store import _AGENT, _batch_ids, _expected_reward, _expected_row
from flexmarl.store.experience_store import ExperienceStore
store = ExperienceStore.open(sys.argv[2], agents=[_AGENT])
print('ready', flush=True)
batch = int(sys.argv[3])
while True:
  ids = _batch_ids(batch)
  rows = [_expected_row(s) for s in ids]
  print('writing', batch, flush=True)
  start = time.perf_counter()
  store.append(_AGENT, rows)
  print('committed', batch, time.perf_counter() - start, flush=True)
  start = time.perf_counter()
  store.set_field(_AGENT, ids, 'reward', [_expected_reward(s) for s in ids])
  print('rewarded', batch, time.perf_counter() - start, flush=True)
  batch += 1
"""
_STEP_STARTS = {'append': 'writing', 'set_field': 'committed'}  # line printed just before a step
_STEP_ENDS = {'append': 'committed', 'set_field': 'rewarded'}  # line printed after, with its time


def _run_child_until_killed(path: str, first: int, plan: tuple) -> list[list[str]]:
  """Runs the producer from batch `first` and SIGKILLs it as `plan` says:

  ('delay', s): s seconds after it opened the store;
  ('append' | 'set_field', batch, into): once it starts that step for `batch`, `into` times the
  step's previous duration later (0 to 1: somewhere inside the step, if it takes as long).
  Returns its output lines, split into words.
  """
  proc = subprocess.Popen(
      [sys.executable, '-c', _CHILD, os.path.dirname(__file__), path, str(first)],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  watchdog = threading.Timer(30, proc.kill)
  watchdog.start()
  lines, step_s = [], 0.0
  for line in proc.stdout:
    words = line.split()
    if not words:  # a blank line (the child's output is cut mid-line when it is killed)
      continue
    lines.append(words)
    if plan[0] == 'delay':
      if words == ['ready']:
        threading.Timer(plan[1], proc.kill).start()
      continue
    step, batch, into = plan
    if words[0] == _STEP_ENDS[step] and len(words) == 3:  # a line cut by the kill has fewer
      step_s = float(words[2])
    if words[:2] == [_STEP_STARTS[step], str(batch)]:
      time.sleep(into * step_s)
      proc.kill()
  _, err = proc.communicate(timeout=30)
  watchdog.cancel()
  assert proc.returncode == -signal.SIGKILL, f'the producer failed by itself:\n{err}'
  return lines


def _reported(lines: list[list[str]], word: str) -> set[int]:
  return {int(line[1]) for line in lines if line[0] == word and len(line) > 1}


def _check_after_crash(path: str, committed: set[int], rewarded: set[int], writing: int) -> None:
  """Every reported batch is there, whole, exact and once; each row's reward matches its flag."""
  store = ExperienceStore.open(path, agents=[_AGENT])
  rows = store.read(_AGENT)
  ids = [r.sample_id for r in rows]
  assert len(set(ids)) == len(ids), 'a sample_id is stored twice'
  sizes = collections.Counter(_batch_of(s) for s in ids)
  present = sorted(sizes)
  assert present == list(range(len(present))), f'batches missing in between: {present}'
  assert set(sizes.values()) <= {_BATCH_ROWS}, f'a batch is partly stored: {sizes}'
  assert committed <= set(present), f'committed batches lost: {committed - set(present)}'
  assert not present or present[-1] <= writing, 'a batch that was never written'
  assert ids == [s for b in present for s in _batch_ids(b)]
  assert [r.index for r in rows] == list(range(len(rows)))
  for r in rows:
    _assert_row(r, _expected_row(r.sample_id))  # nothing torn or shifted
    if 'reward' in r.ready:
      assert r.reward == _expected_reward(r.sample_id)
    else:
      assert r.reward is None and _batch_of(r.sample_id) not in rewarded
  assert store.count(_AGENT) == len(rows)
  store.close()


def test_sigkill_at_random_moments_loses_nothing_committed(tmp_path):
  path = str(tmp_path / 'store')
  seed = random.randrange(2**32)
  rng = random.Random(seed)
  print(f'seed {seed}')  # shown if the test fails
  # Eight kills: three at random times, three inside an append, two inside a set_field.
  plans = [('delay', rng.uniform(0.0, 0.1)), ('delay', rng.uniform(0.1, 0.25)),
           ('delay', rng.uniform(0.25, 0.5))]
  plans += [(step, rng.randrange(2, 5), rng.uniform(0.0, 1.0))
            for step in ('append', 'append', 'append', 'set_field', 'set_field')]
  rng.shuffle(plans)
  committed, rewarded, next_batch = set(), set(), 0
  for plan in plans:
    if plan[0] != 'delay':
      plan = (plan[0], next_batch + plan[1], plan[2])
    print('plan', plan)
    # Each restarted producer first resends the batch it was writing when killed.
    lines = _run_child_until_killed(path, next_batch, plan)
    committed |= _reported(lines, 'committed')
    rewarded |= _reported(lines, 'rewarded')
    next_batch = max(_reported(lines, 'writing'), default=next_batch)
    _check_after_crash(path, committed, rewarded, next_batch)
  store = ExperienceStore.open(path, agents=[_AGENT])
  before = store.count(_AGENT)
  new_ids = _batch_ids(next_batch + 1)
  store.append(_AGENT, [_expected_row(s) for s in new_ids])
  assert store.count(_AGENT) == before + _BATCH_ROWS
  for r in store.read(_AGENT, sample_ids=new_ids):
    _assert_row(r, _expected_row(r.sample_id))
