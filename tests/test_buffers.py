"""How an agent's rows become batches: BatchBuilder (on-policy) and StaleBuffer (async:k)."""

import numpy as np
import pytest

from flexmarl.data.groups import BatchBuilder, Group, StaleBuffer
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
