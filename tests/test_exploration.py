"""Exploration that holds: the entropy control steers each agent's coefficient toward a
target scaled by its error rate, carries it through checkpoints, and says when it
intervenes."""

import math

import jax
import numpy as np
import pytest

from flexmarl.errors import ConfigError
from flexmarl.metrics.stall import RAISED, StallWatch
from flexmarl.models import sharding
from flexmarl.models.transformer import ModelConfig
from flexmarl.train import grpo
from flexmarl.train.checkpoint import AgentCheckpointer
from flexmarl.train.spec import GRPOConfig
from flexmarl.train.trainer import AgentTrainer, OptimizerConfig, TrainBatch

CFG = GRPOConfig(entropy_target=0.3, entropy_rate=0.1, entropy_coef_min=1e-3,
                 entropy_coef_max=1.0, entropy_coef=0.1)


def test_coefficient_rises_for_a_collapsed_wrong_agent_and_falls_for_a_solved_one():
  start = math.log(0.01)
  # Collapsed onto one answer (entropy 0.01) and wrong two times in three: up.
  up = grpo.next_log_entropy_coef(CFG, start, entropy=0.01, accuracy=1 / 3)
  assert up > start
  # By the rate times the relative gap: the target is 0.3 x 2/3 = 0.2.
  assert up - start == pytest.approx(0.1 * (0.2 - 0.01) / 0.2)
  # Solved: the target is 0, any entropy is too much: down at the full rate, however
  # small the entropy (a solved agent keeps no pressure toward randomness).
  assert grpo.next_log_entropy_coef(CFG, start, entropy=1e-4, accuracy=1.0) == (
      pytest.approx(start - 0.1))
  # Far above the target: down no faster than the agent succeeds (at least FALL_FLOOR).
  assert grpo.next_log_entropy_coef(CFG, start, 3.0, 0.9) == pytest.approx(start - 0.09)
  assert grpo.next_log_entropy_coef(CFG, start, 3.0, 0.0) == pytest.approx(
      start - 0.1 * grpo.FALL_FLOOR)
  # Unknown correctness steers toward the whole target; no tokens keep it.
  assert grpo.entropy_target_for(CFG, math.nan) == 0.3
  assert grpo.next_log_entropy_coef(CFG, start, math.nan, 0.0) == start


def test_coefficient_stays_within_its_bounds():
  top, bottom = math.log(CFG.entropy_coef_max), math.log(CFG.entropy_coef_min)
  assert grpo.next_log_entropy_coef(CFG, top, 0.0, 0.0) == top
  assert grpo.next_log_entropy_coef(CFG, bottom, 5.0, 1.0) == bottom
  assert math.exp(grpo.initial_log_entropy_coef(CFG)) == pytest.approx(0.1)
  for start, clamped in ((0.0, CFG.entropy_coef_min), (5.0, CFG.entropy_coef_max)):
    cfg = GRPOConfig(entropy_coef=start, entropy_coef_min=1e-3, entropy_coef_max=1.0)
    assert math.exp(grpo.initial_log_entropy_coef(cfg)) == pytest.approx(clamped)


def _trainer(cfg: GRPOConfig, seed: int = 3) -> AgentTrainer:
  mesh = sharding.make_mesh(jax.devices()[:1], (1, 1))
  return AgentTrainer('a', ModelConfig(vocab_size=20, layers=1),
                      OptimizerConfig(learning_rate=1e-2), cfg, mesh, seed=seed)


def _batch(seed: int, correct: float, rows: int = 8) -> TrainBatch:
  """`rows` answers of 3 tokens; advantages of a spread group unless `correct` is 1."""
  rng = np.random.default_rng(seed)
  adv = np.zeros(rows, np.float32) if correct == 1.0 else rng.normal(size=rows)
  return TrainBatch.from_rows([list(rng.integers(3, 20, size=4)) for _ in range(rows)],
                              [rng.integers(3, 20, size=3) for _ in range(rows)],
                              [np.full(3, np.log(0.05), np.float32)] * rows,
                              adv.astype(np.float32), prompt_len=5, response_len=4,
                              pad_id=0, correct=np.full(rows, correct, np.float32))


def _step(t: AgentTrainer, seed: int, correct: float, update: int) -> dict:
  t.accumulate(_batch(seed, correct), update)
  return t.dispatch_apply()()


def test_trainer_steers_the_coefficient_from_measured_entropy_and_accuracy():
  # A target above any entropy over 20 tokens (ln 20 = 3.0): a wrong agent is pushed up.
  wrong = _trainer(GRPOConfig(entropy_target=10.0, entropy_coef=0.05))
  coefs = [_step(wrong, s, 0.0, s)['entropy_coef'] for s in range(4)]
  assert coefs[0] == pytest.approx(0.05)
  assert all(b > a for a, b in zip(coefs, coefs[1:]))
  # The same target, every answer right: the target is 0, the coefficient falls.
  right = _trainer(GRPOConfig(entropy_target=10.0, entropy_coef=0.05))
  coefs = [_step(right, s, 1.0, s)['entropy_coef'] for s in range(4)]
  assert all(b < a for a, b in zip(coefs, coefs[1:]))
  # Off: the fixed bonus, whatever the accuracy.
  fixed = _trainer(GRPOConfig(entropy_target=0.0, entropy_coef=0.05))
  assert {_step(fixed, s, 0.0, s)['entropy_coef'] for s in range(3)} == {0.05}


def test_coefficient_survives_checkpoint_and_resume(tmp_path):
  cfg = GRPOConfig(entropy_target=10.0, entropy_coef=0.05)
  first = _trainer(cfg)
  for s in range(3):
    _step(first, s, 0.0, s)
  ckpt = AgentCheckpointer(str(tmp_path), 'a')
  ckpt.save(3, first.train_state(), {'version': 3})
  ckpt.wait()
  resumed = _trainer(cfg, seed=9)  # other weights and the start coefficient ...
  state, _ = ckpt.restore(3, resumed.train_state())
  resumed.load_train_state(state)  # ... replaced by the checkpoint's
  ckpt.close()
  a, b = _step(first, 3, 0.0, 3), _step(resumed, 3, 0.0, 3)
  assert a['entropy_coef'] > 0.05
  assert b['entropy_coef'] == a['entropy_coef']
  assert b['loss'] == a['loss']


def test_a_stalled_agent_gets_the_warning_and_the_intervention_line():
  """A collapsed agent, always wrong, all groups alike: the stall warning fires, the
  control raises its coefficient past RAISED x its floor, and says so once."""
  cfg = GRPOConfig(entropy_target=10.0, entropy_rate=0.5, entropy_coef=1e-3)
  t = _trainer(cfg)
  watch = StallWatch(threshold=0.9, patience=3)
  warnings, notes = [], []
  for s in range(8):
    t.accumulate(_batch(s, 0.0), s)
    stats = t.dispatch_apply()()
    warnings.append(watch.update('a', s, zero_spread=1.0, entropy=stats['entropy'],
                                 accuracy=0.0))
    notes.append(watch.intervention('a', s, stats['entropy_coef'], cfg.entropy_coef_min,
                                    stats['entropy'], 0.0))
  assert [s for s, w in enumerate(warnings) if w] == [2]
  raised = [s for s, n in enumerate(notes) if n]
  assert len(raised) == 1  # once per rise
  assert "agent 'a': the framework raises its entropy bonus" in notes[raised[0]]
  coef = float(notes[raised[0]].split('entropy_coef ')[1].split(',')[0])
  assert coef >= RAISED * cfg.entropy_coef_min and f'from {cfg.entropy_coef_min:.3g}' in (
      notes[raised[0]])


def test_intervention_line_for_a_rise_from_a_high_start():
  watch = StallWatch()
  lines = [watch.intervention('a', s, c, 1e-3) for s, c in enumerate([0.1, 0.2, 0.39, 0.41])]
  assert [s for s, l in enumerate(lines) if l] == [3]  # 4x its lowest, 0.1
  assert watch.intervention('a', 4, 0.5, 1e-3) is None  # the same rise: said once


def test_intervention_line_is_not_printed_for_a_high_start_or_without_control():
  watch = StallWatch()
  assert watch.intervention('a', 1, 0.2, 1e-3) is None  # started high: not a rise
  assert watch.intervention('a', 2, 0.3, 1e-3) is None
  assert watch.intervention('b', 1, math.nan, 1e-3) is None


def test_a_fixed_anneal_with_control_on_is_refused_naming_the_field():
  with pytest.raises(ConfigError, match='entropy_decay_steps.*entropy_target=0'):
    GRPOConfig.from_config('agents.a.grpo', {'entropy_target': 1.0,
                                             'entropy_decay_steps': 100}, 1.0, 2)
  with pytest.raises(ConfigError, match='entropy_coef_min'):
    GRPOConfig.from_config('agents.a.grpo', {'entropy_target': 1.0, 'entropy_coef_min': 0.0},
                           1.0, 2)
  off = GRPOConfig.from_config('agents.a.grpo', {'entropy_target': 0.0,
                                                 'entropy_decay_steps': 100}, 1.0, 2)
  assert off.entropy_decay_steps == 100
