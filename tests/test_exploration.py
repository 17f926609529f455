"""Exploration that holds: each row's entropy bonus follows how much of its group is
wrong (`grpo.entropy_weights`), so an agent explores where it is wrong and stays sharp
where it is right; the framework says when the bonus rises again."""

import math

import jax
import numpy as np
import pytest

from flexmarl.core.errors import ConfigError
from flexmarl.metrics.stall import RAISED, StallWatch
from flexmarl.models import sharding
from flexmarl.models.transformer import ModelConfig
from flexmarl.train import grpo
from flexmarl.train.spec import GRPOConfig
from flexmarl.train.trainer import AgentTrainer, OptimizerConfig, TrainBatch


@pytest.mark.quick
def test_each_row_gets_the_bonus_share_of_its_groups_error():
  nan = math.nan
  groups = [np.array([1.0, 1, 1, 1]), np.array([0.0, 0, 0, 0]), np.array([1.0, 0, 0, 1]),
            np.array([nan, nan])]
  weights = grpo.entropy_weights(GRPOConfig(), groups)
  np.testing.assert_array_equal(weights, [0, 0, 0, 0, 1, 1, 1, 1, .5, .5, .5, .5, 1, 1])
  # Rows the workflow did not judge count in neither the right nor the wrong share.
  np.testing.assert_allclose(grpo.entropy_weights(GRPOConfig(), [np.array([1.0, nan, 0, 0])]),
                             [2 / 3] * 4, rtol=1e-6)
  assert grpo.entropy_weights(GRPOConfig(), []).shape == (0,)
  # Off: every row the whole bonus.
  np.testing.assert_array_equal(
      grpo.entropy_weights(GRPOConfig(entropy_by_error=False), groups), np.ones(14))


def _trainer(cfg: GRPOConfig, seed: int = 3) -> AgentTrainer:
  mesh = sharding.make_mesh(jax.devices()[:1], (1, 1))
  return AgentTrainer('a', ModelConfig(vocab_size=20, layers=1),
                      OptimizerConfig(learning_rate=1e-2), cfg, mesh, seed=seed)


def _batch(seed: int, correct: float, rows: int = 8) -> TrainBatch:
  """One group of `rows` answers of 3 tokens, all right or all wrong, all alike in
  reward (zero advantages): the only gradient left is the entropy bonus."""
  rng = np.random.default_rng(seed)
  cfg = GRPOConfig()
  return TrainBatch.from_rows([list(rng.integers(3, 20, size=4)) for _ in range(rows)],
                              [rng.integers(3, 20, size=3) for _ in range(rows)],
                              [np.full(3, np.log(0.05), np.float32)] * rows,
                              np.zeros(rows, np.float32), prompt_len=5, response_len=4,
                              pad_id=0,
                              entropy_weight=grpo.entropy_weights(
                                  cfg, [np.full(rows, correct, np.float32)]))


def _step(t: AgentTrainer, seed: int, correct: float, update: int) -> dict:
  t.accumulate(_batch(seed, correct), update)
  return t.dispatch_apply()()


def _params(t: AgentTrainer) -> list[np.ndarray]:
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(t.params))]


def test_the_bonus_moves_a_wrong_agent_and_leaves_a_right_one_alone():
  """Zero advantages, an optimizer step forced (no skip): all wrong, the bonus raises the
  policy's entropy; all right, it has no gradient at all and nothing moves."""
  cfg = GRPOConfig(entropy_coef=0.5, skip_without_signal=False)
  wrong, right = _trainer(cfg), _trainer(cfg)
  before = _params(right)
  entropies = [_step(wrong, 0, 0.0, s)['entropy'] for s in range(5)]
  assert all(b > a for a, b in zip(entropies, entropies[1:]))
  stats = [_step(right, 0, 1.0, s) for s in range(3)]
  for a, b in zip(before, _params(right)):
    np.testing.assert_array_equal(a, b)
  assert {s['entropy_bonus'] for s in stats} == {0.0}
  assert {s['grad_norm'] for s in stats} == {0.0}


def test_the_bonus_stat_is_the_token_mean_of_coefficient_times_weight():
  t = _trainer(GRPOConfig(entropy_coef=0.2))
  rng = np.random.default_rng(1)
  correct = [np.array([1.0, 1.0]), np.array([0.0, 1.0])]  # weights 0, 0 | 0.5, 0.5
  lengths = [1, 3, 2, 2]
  batch = TrainBatch.from_rows([[5, 6]] * 4, [rng.integers(3, 20, size=n) for n in lengths],
                               [np.zeros(n, np.float32) for n in lengths],
                               np.array([0, 0, -1, 1], np.float32), prompt_len=4,
                               response_len=4, pad_id=0,
                               entropy_weight=grpo.entropy_weights(GRPOConfig(), correct))
  t.accumulate(batch, 0)
  stats = t.dispatch_apply()()
  assert stats['entropy_bonus'] == pytest.approx(0.2 * 0.5 * 4 / 8)  # 4 of 8 tokens at 0.1
  assert stats['entropy_coef'] == pytest.approx(0.2)


def test_an_agent_wrong_again_gets_the_stall_warning_and_the_intervention_line():
  """An agent right for a while (bonus 0), then collapsed onto wrong answers, all groups
  alike: the stall warning fires after `patience` updates, and the intervention line
  once, when the smoothed bonus has risen to RAISED x the coefficient."""
  cfg = GRPOConfig(entropy_coef=0.2)
  t = _trainer(cfg)
  watch = StallWatch(threshold=0.9, patience=3)
  warnings, notes = [], []
  for s in range(16):
    accuracy = 1.0 if s < 3 else 0.0
    stats = _step(t, s, accuracy, s)
    warnings.append(watch.update('a', s, zero_spread=1.0, entropy=stats['entropy'],
                                 accuracy=accuracy))
    notes.append(watch.intervention('a', s, stats['entropy_bonus'], cfg.entropy_coef,
                                    stats['entropy'], accuracy))
  assert [s for s, w in enumerate(warnings) if w] == [5]  # 3 wrong updates in a row
  # The mean over ~SMOOTH updates of 0.2 reaches 0.1 at the 7th wrong update; once.
  assert [s for s, n in enumerate(notes) if n] == [3 + 6]
  assert "agent 'a': the framework raises its entropy bonus to 0.104" in notes[9]  # 0.2 (1 - 0.9^7)


def test_intervention_line_for_a_lasting_rise_only():
  watch = StallWatch()
  # A solved agent with one wrong batch now and then: no line.
  spikes = [0.2 if s % 20 == 10 else 0.0 for s in range(100)]
  assert not any(watch.intervention('a', s, b, 0.2) for s, b in enumerate(spikes))
  # Wrong again for good: one line, however long it lasts.
  lines = [watch.intervention('a', 100 + s, 0.2, 0.2) for s in range(50)]
  assert sum(1 for l in lines if l) == 1
  assert watch.intervention('b', 1, 0.2, 0.2) is None  # started high: not a rise
  assert watch.intervention('b', 2, math.nan, 0.2) is None
  assert RAISED * 0.2 == 0.1


@pytest.mark.parametrize('experiment', ['hierarchical_assistant', 'solver_verifier',
                                        'planner_workers_judge', 'debate', 'chain',
                                        'router_six', 'planner_outcome', 'claim_checker',
                                        'sort3'])
def test_shipped_experiments_train_on_the_library_defaults(experiment):
  """No per-agent GRPO or optimizer tuning in the shipped experiments: what the
  robustness suite measures is what they run."""
  import importlib
  from flexmarl.config import agent_config
  config = importlib.import_module(f'experiments.{experiment}').get_config()
  defaults = agent_config()
  for name, agent in config.agents.items():
    assert agent.grpo.to_dict() == defaults.grpo.to_dict(), (experiment, name)
    assert agent.optimizer.to_dict() == defaults.optimizer.to_dict(), (experiment, name)


def test_bad_or_retired_entropy_fields_are_refused_naming_the_field():
  with pytest.raises(ConfigError, match='agents.a.grpo.entropy_coef'):
    GRPOConfig.from_config('agents.a.grpo', {'entropy_coef': -0.1}, 1.0, 2)
  with pytest.raises(ConfigError, match='entropy_target'):
    GRPOConfig.from_config('agents.a.grpo', {'entropy_target': 1.0}, 1.0, 2)
  off = GRPOConfig.from_config('agents.a.grpo', {'entropy_by_error': False,
                                                 'entropy_decay_steps': 100}, 1.0, 2)
  assert off.entropy_decay_steps == 100 and not off.entropy_by_error


def test_learning_rate_warms_up_then_follows_its_schedule():
  from flexmarl.train.optimizer import learning_rate
  warm = learning_rate(OptimizerConfig(learning_rate=4e-3, warmup_steps=4))
  np.testing.assert_allclose([warm(i) for i in range(6)], [1e-3, 2e-3, 3e-3, 4e-3, 4e-3, 4e-3],
                             rtol=1e-6)
  both = learning_rate(OptimizerConfig(learning_rate=4e-3, warmup_steps=2, decay_steps=10,
                                       final_lr_fraction=0.1))
  assert float(both(1)) == pytest.approx(4e-3)  # warmed up ...
  assert float(both(2)) == pytest.approx(4e-3)  # ... then the cosine starts at its top
  assert float(both(12)) == pytest.approx(4e-4)  # and ends at final_lr_fraction
  assert learning_rate(OptimizerConfig(learning_rate=4e-3)) == 4e-3  # constant: no schedule
  with pytest.raises(ConfigError, match='agents.a.optimizer.warmup_steps'):
    OptimizerConfig.from_config('agents.a.optimizer', {'warmup_steps': -1})

