"""A long run's store stays bounded: settled sample ids leave memory (and are still found,
on disk), and retention drops old rows from disk while every kept row reads back."""

import json
import os
import tracemalloc

import numpy as np
import pytest

from flexmarl.store import ids as ids_lib
from flexmarl.store.experience_store import ExperienceStore, Row
from flexmarl.store.ids import SampleIds
from flexmarl.store.layout import Commit

A = 'solver'


def _rows(step: int, n: int = 64, tokens: int = 6) -> list[Row]:
  rng = np.random.default_rng(step)
  return [Row(f'q{step}_0_{j}', step, rng.integers(3, 50, size=5), rng.integers(3, 50, size=tokens),
              -rng.random(tokens), reward=float(j % 2), advantage=0.5) for j in range(n)]


def _ids(step: int, n: int = 64) -> list[str]:
  return [f'q{step}_0_{j}' for j in range(n)]


def _ids_of(store) -> SampleIds:
  return store._tables[A].ids  # pylint: disable=protected-access


def _disk_bytes(path) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def test_settled_ids_leave_memory_and_are_still_found(tmp_path, monkeypatch):
  monkeypatch.setattr(ids_lib, '_SCAN_ROWS', 256)
  store = ExperienceStore.open(tmp_path, [A])
  for step in range(40):
    store.append(A, _rows(step))
  assert _ids_of(store).open_rows == 40 * 64
  store.settle(A, keep=_ids(39)[:2])
  assert (_ids_of(store).open_rows, _ids_of(store).settled_rows) == (2, 40 * 64 - 2)
  # A recent settled row is found reading back only the newest rows, which become open ...
  assert store.missing(A, _ids(37)[:1]) == []
  assert _ids_of(store).open_rows == 256
  # ... and every way of asking by id still finds older ones ...
  assert store.missing(A, _ids(3) + ['q999_0_0']) == ['q999_0_0']
  assert [r.sample_id for r in store.read(A, sample_ids=_ids(3)[:3])] == _ids(3)[:3]
  store.mark_consumed(A, _ids(5))
  assert store.count(A, consumed=True) == 64
  assert store.append(A, _rows(7)) == 0  # a resend of settled rows is a no-op ...
  changed = _rows(7)[:1]
  changed[0] = Row(changed[0].sample_id, 99, [1], [1], [0.0])
  with pytest.raises(ValueError, match='already stored with a different policy_version'):
    store.append(A, changed)  # ... and a differing one is refused
  # ... until the next settle.
  store.settle(A)
  assert _ids_of(store).open_rows == 0
  assert store.append(A, _rows(40)) == 64 and store.end(A) == 41 * 64


def test_a_reopened_store_holds_only_hashes(tmp_path):
  with ExperienceStore.open(tmp_path, [A]) as store:
    for step in range(10):
      store.append(A, _rows(step))
  store = ExperienceStore.open(tmp_path, [A])
  assert (_ids_of(store).open_rows, _ids_of(store).settled_rows) == (0, 640)
  assert store.append(A, _rows(9)) == 0 and store.append(A, _rows(10)) == 64
  assert [r.index for r in store.read(A, sample_ids=_ids(2)[:2])] == [128, 129]


def test_settled_ids_cost_a_few_bytes_a_row():
  rows = 16000
  held = SampleIds()
  tracemalloc.start()
  before = tracemalloc.get_traced_memory()[0]
  held.add([f'q{i}_1_{j}' for i in range(rows // 8) for j in range(8)], 0)
  open_bytes = tracemalloc.get_traced_memory()[0] - before
  held.settle()
  settled_bytes = tracemalloc.get_traced_memory()[0] - before
  tracemalloc.stop()
  assert open_bytes / rows > 80  # a dict entry and a string per row
  assert settled_bytes / rows < 12  # an 8-byte hash per row
  assert held.find(['q0_1_0', 'nope_0_0'], 0, 0, lambda lo, hi: []) == {}  # only on disk


@pytest.mark.quick
def test_retention_keeps_the_disk_bounded_and_the_kept_rows_readable(tmp_path):
  store = ExperienceStore.open(tmp_path, [A])
  sizes = []
  for step in range(240):
    store.append(A, _rows(step))
    if step % 20 == 19:
      store.settle(A)
      # keep the last 10 steps' rows, and one old row a checkpoint still carries
      store.drop_below(A, store.end(A) - 10 * 64, keep=_ids(5)[:1] if step < 100 else ())
      sizes.append(_disk_bytes(tmp_path))
  # While the old row is kept, nothing after it can go (a prefix is dropped): the table
  # grows as without retention (12-fold over the run); then it stays within a few chunks
  # of the window it keeps.
  assert sizes[4] > 4 * sizes[0] and max(sizes[5:]) < 3 * sizes[0], sizes
  end = store.end(A)
  assert end == 240 * 64 and store.count(A) == 10 * 64
  assert store.missing(A, _ids(100) + _ids(239)) == _ids(100)
  store.close()
  # Reopened: nothing to repair, the kept rows read back, the dropped are gone.
  store = ExperienceStore.open(tmp_path, [A])
  assert not store.recovered
  kept = store.read(A)
  assert [r.index for r in kept] == list(range(end - 640, end))
  np.testing.assert_array_equal(kept[-1].response_ids, _rows(239)[-1].response_ids)
  assert store.append(A, _rows(239)) == 0 and store.append(A, _rows(240)) == 64


def test_a_checkpoint_keeps_its_carried_rows_from_retention(tmp_path):
  store = ExperienceStore.open(tmp_path, [A])
  for step in range(30):
    store.append(A, _rows(step))
  carried = _ids(4)[10:12]
  assert store.drop_below(A, 25 * 64, keep=carried) == 4 * 64 + 10
  assert store.missing(A, carried + _ids(3)[:1]) == _ids(3)[:1]
  assert [r.advantage for r in store.read(A, sample_ids=carried)] == [0.5, 0.5]
  assert store.drop_below(A, 2 * 64) == 0  # dropped rows stay dropped
  with pytest.raises(ValueError, match=r'drop_below\(row=1.5\)'):
    store.drop_below(A, 1.5)


def test_reopening_repairs_a_commit_past_the_written_rows_after_a_drop(tmp_path):
  with ExperienceStore.open(tmp_path, [A]) as store:
    for step in range(5):
      store.append(A, _rows(step))
    store.drop_below(A, 130)
  path = tmp_path / A / 'commit.json'
  claimed = json.loads(path.read_text()) | {'rows': 5 * 64 + 7}
  path.write_text(json.dumps(claimed))
  store = ExperienceStore.open(tmp_path, [A])
  assert store.recovered and 'only the first 320' in store.recovered[0]
  assert store.count(A) == 5 * 64 - 130


def test_a_table_without_dropped_rows_keeps_the_old_format():
  assert json.loads(Commit(rows=3).to_json())['format'] == 1
  assert 'first' not in json.loads(Commit(rows=3).to_json())
  raw = Commit(rows=3, first=2).to_json()
  assert json.loads(raw)['format'] == 2 and Commit.from_json(raw, 't') == Commit(rows=3, first=2)


def test_a_run_with_retention_resumes_as_if_uninterrupted_and_drops_old_rows(tmp_path):
  from flexmarl.run import train  # pylint: disable=import-outside-toplevel
  from test_resume import AGENTS, assert_same_run  # pylint: disable=import-outside-toplevel
  from test_team import two_agent_config  # pylint: disable=import-outside-toplevel
  config = two_agent_config(steps=9)
  config.checkpoint_every, config.store_keep_steps = 3, 3
  quiet = lambda *_: None
  straight, resumed = str(tmp_path / 'straight'), str(tmp_path / 'resumed')
  train(config, straight, log=quiet)
  config.steps = 3
  train(config, resumed, log=quiet)
  config.steps = 9
  train(config, resumed, log=quiet)
  assert_same_run(straight, resumed, 9)
  for workdir in (straight, resumed):
    with ExperienceStore.open(os.path.join(workdir, 'store'), list(AGENTS)) as store:
      for agent in AGENTS:
        kept = store.read(agent)
        assert kept[0].index > 0 and len(kept) < store.end(agent), f'{agent}: none dropped'
