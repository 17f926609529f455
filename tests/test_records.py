"""Sample ids: one format, built and read back by one pair of functions."""

import pytest

from flexmarl.data.sample_id import parse_sample_id, sample_id


@pytest.mark.quick
@pytest.mark.parametrize('query_id, call, j', [('q0', 0, 0), ('q17', 3, 12),
                                               ('task_a_7', 10, 2), ('q_1_2', 1, 0)])
def test_a_sample_id_reads_back_as_it_was_built(query_id, call, j):
  parts = parse_sample_id(sample_id(query_id, call, j))
  assert parts == (query_id, call, j)
  assert (parts.query_id, parts.call, parts.j) == (query_id, call, j)


@pytest.mark.parametrize('bad', ['bad-id', 'q0_1', 'q0_x_1', 'q0_1_x', '_1_2', 7, None])
def test_anything_else_is_refused_naming_the_value_and_the_builder(bad):
  with pytest.raises(ValueError, match=rf"sample_id={bad!r}.*sample_id\(query_id, call, j\)"):
    parse_sample_id(bad)
