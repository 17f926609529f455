"""Long runs: a solved agent stays solved (no optimizer step without advantage signal),
and what a run keeps (trace, per-step containers) stays bounded."""

import jax
import numpy as np
import pytest

from flexmarl.models import sharding
from flexmarl.models.transformer import ModelConfig
from flexmarl.train import grpo
from flexmarl.train.trainer import AgentTrainer, OptimizerConfig, TrainBatch

LR = 3e-3


def _trainer(entropy_coef: float, skip: bool) -> AgentTrainer:
  mesh = sharding.make_mesh(jax.devices()[:1], (1, 1))
  return AgentTrainer('a', ModelConfig(vocab_size=20), OptimizerConfig(learning_rate=LR),
                      grpo.GRPOConfig(entropy_coef=entropy_coef, skip_without_signal=skip),
                      mesh, seed=3)


def _batch(advantages: np.ndarray) -> TrainBatch:
  """Rows of 3 tokens each, as if every answer of every group got the same reward."""
  rng = np.random.default_rng(0)
  rows = len(advantages)
  return TrainBatch.from_rows([list(rng.integers(3, 20, size=4)) for _ in range(rows)],
                              [rng.integers(3, 20, size=3) for _ in range(rows)],
                              [np.full(3, np.log(0.5), np.float32)] * rows,
                              np.asarray(advantages, np.float32), prompt_len=5,
                              response_len=4, pad_id=0)


def _host(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


def _max_move(before, after) -> float:
  return max(float(np.max(np.abs(a - b)))
             for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))


ZERO = np.zeros(8)
SIGNAL = np.array([1.0, -1.0] * 4)


@pytest.mark.parametrize('entropy_coef', [0.1, 1e-6])
def test_without_the_fix_a_batch_without_signal_moves_every_step_by_a_learning_rate(
    entropy_coef):
  """The flip mechanism: zero advantages leave only the entropy bonus, and Adam turns
  it into a full learning-rate step however small it is (so scaling it does not help)."""
  t = _trainer(entropy_coef, skip=False)
  before = _host(t.params)
  t.accumulate(_batch(ZERO))
  stats = t.apply()
  assert 0 < stats['grad_norm'] < 5 * entropy_coef  # a gradient as small as the bonus ...
  assert 0.5 * LR < _max_move(before, _host(t.params)) < 1.5 * LR  # ... a full step
  assert stats['skipped_update'] == 0.0


def test_without_the_fix_momentum_moves_params_at_a_zero_gradient():
  """Why the fix skips the step instead of zeroing the entropy term: after one real
  update, Adam's momentum alone moves the parameters on a zero gradient."""
  t = _trainer(0.0, skip=False)
  t.accumulate(_batch(SIGNAL))
  t.apply()
  before = _host(t.params)
  t.accumulate(_batch(ZERO))
  assert t.apply()['grad_norm'] == 0.0
  assert _max_move(before, _host(t.params)) > 0.3 * LR


def test_a_batch_without_signal_leaves_params_and_adam_state_unchanged():
  t = _trainer(0.1, skip=True)
  t.accumulate(_batch(SIGNAL))
  assert t.apply()['skipped_update'] == 0.0
  params, opt_state = _host(t.params), _host(t.opt_state)
  for _ in range(3):  # a solved agent: every group agrees
    t.accumulate(_batch(ZERO[:4]))
    t.accumulate(_batch(ZERO[4:]))
    stats = t.apply()
    assert stats['skipped_update'] == 1.0 and stats['grad_norm'] == 0.0
    assert stats['trained_tokens'] == 24 and stats['entropy'] > 0  # still measured
  for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(_host(t.params))):
    np.testing.assert_array_equal(x, y)
  for x, y in zip(jax.tree.leaves(opt_state), jax.tree.leaves(_host(t.opt_state))):
    np.testing.assert_array_equal(x, y)
  assert t.state.grads is None
  # One row with signal among micro-batches without: the whole batch steps.
  t.accumulate(_batch(ZERO))
  t.accumulate(_batch(SIGNAL))
  assert t.apply()['skipped_update'] == 0.0
  assert _max_move(params, _host(t.params)) > 0.5 * LR


def test_the_step_decision_by_hand():
  assert not grpo.has_signal(np.zeros(4)) and not grpo.has_signal([])
  assert grpo.has_signal([0.0, 0.0, -1e-3])
  on, off = grpo.GRPOConfig(), grpo.GRPOConfig(skip_without_signal=False)
  assert on.skip_without_signal  # the default
  assert grpo.takes_step(on, True) and not grpo.takes_step(on, False)
  assert grpo.takes_step(off, True) and grpo.takes_step(off, False)
