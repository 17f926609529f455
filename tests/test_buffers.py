"""How an agent's rows become batches: BatchBuilder (on-policy) and StaleBuffer (async:k)."""

import dataclasses

import numpy as np
import pytest

from flexmarl.data.groups import (BatchBuilder, ConstantBaseline, Group, StaleBuffer,
                                  batch_stats)
from flexmarl.data.records import ServedGroup


def _group(query: int, size: int, version: int = 0) -> Group:
  ids = [f'q{query}_0_{j}' for j in range(size)]
  served = ServedGroup(f'q{query}', 0, 'solver', version, [1, 2], ids,
                       [np.array([3], np.int32)] * size, [np.array([-0.5], np.float32)] * size)
  zeros = np.zeros(size, np.float32)
  return Group(served, zeros, zeros, zeros)


@pytest.mark.quick
def test_batch_builder_cuts_whole_groups_and_counts_surplus():
  b = BatchBuilder(global_batch=8, micro_groups=2)
  for q, size in enumerate([2, 4, 4, 2]):  # 2 + 4 fit; 4 does not (surplus); then full
    b.add(_group(q, size))
  assert [g.size for g in b.kept] == [2, 4] and b.surplus_rows == 4 + 2 and b.full
  assert [[g.size for g in m] for m in b.micro_batches(final=True)] == [[2, 4]]


def test_stale_buffer_drops_rows_past_the_bound_and_keeps_the_rest():
  b = StaleBuffer(global_batch=4, micro_groups=1, max_staleness=1)
  for q, version in enumerate([0, 1, 1, 2]):
    b.add(_group(q, 2, version))
  assert b.fresh_rows(2) == 6  # version 0 is two behind version 2
  assert b.drop_stale(2) == 2
  batch = b.take()  # the oldest fresh groups, up to 4 rows
  assert [[g.served.query_id for g in m] for m in batch] == [['q1'], ['q2']]
  assert [g.served.query_id for g in b.kept] == ['q3']


@pytest.mark.parametrize('buffer', [BatchBuilder(8, 1), StaleBuffer(8, 1, 1)])
def test_a_group_larger_than_the_batch_is_refused(buffer):
  with pytest.raises(ValueError, match=r"'solver'.*generate\(n=16\).*global_batch=8.*raise"):
    buffer.add(_group(0, 16))


def _scored(query: int, expected: str, correct: list[float]) -> Group:
  g = _group(query, len(correct))
  return dataclasses.replace(g, correct=np.array(correct, np.float32), expected=expected)


def test_a_constant_answer_scores_its_share_and_no_skill():
  """A verifier that always says 'y', on calls whose right verdict is 'y' 3 times in 4:
  accuracy 0.75 = the best constant's, nothing above it, balanced accuracy 1/2. One that
  is right on every call stands 0.25 above it, balanced 1."""
  truths = ['y', 'y', 'y', 'n']
  constant = [_scored(q, t, [float(t == 'y')] * 4) for q, t in enumerate(truths)]
  assert batch_stats(constant)['accuracy'] == 0.75
  stats = ConstantBaseline().stats('verifier', constant)
  assert stats['best_constant'] == 0.75 and stats['above_constant'] == 0.0
  assert stats['balanced_accuracy'] == 0.5
  right = ConstantBaseline().stats('verifier', [_scored(q, t, [1.0] * 4)
                                                for q, t in enumerate(truths)])
  assert right['above_constant'] == 0.25 and right['balanced_accuracy'] == 1.0
  # Rows weigh by count (a group of 2 'n' against 2 groups of 4 'y'); without expected
  # answers there is no skill figure.
  mixed = ConstantBaseline().stats('a', [_scored(0, 'y', [1, 1, 1, 1]),
                                         _scored(1, 'y', [1, 0, 1, 0]), _scored(2, 'n', [0, 0])])
  assert mixed['best_constant'] == 0.8 and mixed['above_constant'] == pytest.approx(0.6 - 0.8)
  assert mixed['balanced_accuracy'] == pytest.approx((0.75 + 0.0) / 2)
  assert ConstantBaseline().stats('a', [_group(0, 4)]) == {}


def test_the_best_constant_is_measured_over_a_window_of_calls_each_once():
  """Over one batch of few calls the likeliest answer's share errs high; the baseline
  pools the agent's last `calls` calls, counts a call carried to the next step once,
  and forgets the oldest."""
  baseline = ConstantBaseline(calls=6)
  first = [_scored(q, str(q % 3), [1.0] * 2) for q in range(3)]  # answers 0, 1, 2
  assert baseline.stats('a', first[:1])['best_constant'] == 1.0  # one call: all '0'
  assert baseline.stats('a', first)['best_constant'] == pytest.approx(1 / 3)  # q0 once
  baseline.stats('a', [_scored(q, '0', [1.0] * 2) for q in range(3, 9)])  # six '0' calls
  # The window holds the last six calls, all '0': the first three are forgotten.
  assert baseline.stats('a', [])['best_constant'] == 1.0
  assert ConstantBaseline().stats('b', first)['best_constant'] == pytest.approx(1 / 3)


def test_a_call_scored_with_two_expected_answers_is_refused():
  from flexmarl.data.groups import groups_of
  from flexmarl.data.records import EpisodeResult
  from flexmarl.workflows.base import Completion, Episode, Query

  def _rewards_as_advantages(result, agent):
    return [np.array([result.episode.rewards[s] for s in g.sample_ids]) for g in result.served]
  g = _group(0, 2)
  episode = Episode()
  for sid, truth in zip(g.served.sample_ids, ['3', '4']):
    episode.score(Completion(sid, 'solver', '3', 0), 1.0, True, expected=truth)
  result = EpisodeResult(Query('q0', '1+2'), 0, [g.served], episode)
  with pytest.raises(ValueError, match=r"different expected answers \['3', '4'\]"):
    groups_of(result, {'solver': _rewards_as_advantages})
  episode.expected[g.served.sample_ids[1]] = '3'
  assert groups_of(result, {'solver': _rewards_as_advantages})['solver'][0].expected == '3'
