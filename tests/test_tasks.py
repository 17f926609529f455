"""Task families: exact answers, partial credit, and no constant-answer shortcut."""

import collections

import numpy as np
import pytest

from flexmarl import tasks


@pytest.mark.parametrize('family,args', [
    ('add', {'max_operand': 4}), ('add', {'max_operand': 9}),
    ('reverse', {'length': 3, 'alphabet': 4}), ('sort', {'length': 2, 'max_digit': 4}),
    ('sort', {'length': 3, 'max_digit': 4}), ('successor', {'alphabet': 8}),
    ('predecessor', {'alphabet': 8}), ('double', {'max_operand': 4}),
])
def test_no_constant_answer_reaches_0_3_exact_match(family, args):
  rng = np.random.default_rng(0)
  answers = collections.Counter(tasks.FAMILIES[family](rng, **args).answer for _ in range(4000))
  assert max(answers.values()) / 4000 <= 0.3, answers.most_common(3)


@pytest.mark.quick
def test_answers_are_right():
  rng = np.random.default_rng(1)
  for _ in range(50):
    t = tasks.add(rng, max_operand=9)
    a, b = map(int, t.prompt.split('+'))
    assert int(t.answer) == a + b
    r = tasks.reverse(rng)
    assert r.answer == r.prompt[::-1]
    s = tasks.sort(rng, length=3)
    assert s.answer == ''.join(sorted(s.prompt))
    d = tasks.double(rng)
    assert d.prompt.endswith('*2') and int(d.answer) == 2 * int(d.prompt[:-2])
    p = tasks.predecessor(rng, alphabet=8)
    assert p.prompt[1:] == '<'
    assert 'abcdefgh'.index(p.answer) == ('abcdefgh'.index(p.prompt[0]) - 1) % 8


@pytest.mark.parametrize('alphabet', [8, 26])
def test_successor_is_the_next_letter_wrapping_at_the_end(alphabet):
  rng = np.random.default_rng(2)
  answers = {}
  for _ in range(40 * alphabet):
    t = tasks.successor(rng, alphabet=alphabet)
    assert t.prompt[1:] == '>' and len(t.answer) == 1
    answers[t.prompt[0]] = t.answer
  letters = 'abcdefghijklmnopqrstuvwxyz'[:alphabet]
  assert answers == {c: letters[(i + 1) % alphabet] for i, c in enumerate(letters)}
  assert answers[letters[-1]] == 'a'


def test_partial_credit():
  assert tasks.partial_credit('cba', 'cba') == 1.0
  assert tasks.partial_credit('cbx', 'cba') == pytest.approx(2 / 3)
  assert tasks.partial_credit('c', 'cba') == pytest.approx(1 / 3)
  assert tasks.partial_credit('7xx', '7') == pytest.approx(1 / 3)
  assert tasks.partial_credit('', '7') == 0.0


def test_zipf_mix_is_skewed():
  p = tasks.zipf_probs(3, 1.0)
  np.testing.assert_allclose(p, np.array([1, 1 / 2, 1 / 3]) / (11 / 6))
