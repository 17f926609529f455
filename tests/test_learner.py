"""The Learner owns an agent's algorithm: a new advantage estimator is one registry entry
and one config field, with no other edit, and the Learner saves and restores its state."""

import numpy as np
import pytest

from flexmarl.config import AgentSpec, ConfigError, agent_config
from flexmarl.data.groups import Group
from flexmarl.data.records import ServedGroup
from flexmarl.run import train
from flexmarl.store.experience_store import ExperienceStore
from flexmarl.train import credit
from flexmarl.train.learner import Learner
from flexmarl.train.spec import GRPOConfig

from test_bad_input import Sums, small_config


def rank(rewards: np.ndarray, cfg) -> np.ndarray:
  """A test-only estimator: each sample's rank in its group, centred (ties by order)."""
  return (np.argsort(np.argsort(rewards, kind='stable')) - (len(rewards) - 1) / 2).astype(
      np.float32)


class Spread(Sums):
  """Rewarded by its answer's characters: the rewards of a group differ."""

  def reward(self, c, query):
    return float(sum(map(ord, c.text)) % 5)


@pytest.mark.quick
def test_a_registered_estimator_trains_a_team_by_its_name_alone(tmp_path, monkeypatch):
  monkeypatch.setitem(credit.ESTIMATORS, 'rank', rank)
  c = small_config(steps=2)
  c.agents.solver.grpo.advantage = 'rank'
  summary = train(c, str(tmp_path), Spread(), log=lambda *_: None)
  assert summary['agents']['solver']['updates'] == 2
  with ExperienceStore.open(tmp_path / 'store', ['solver']) as store:
    rows = store.read('solver', ready=('reward', 'advantage'))
  groups = {}
  for r in rows:
    groups.setdefault(r.sample_id.rsplit('_', 1)[0], []).append(r)
  assert len(groups) == 4
  for members in groups.values():
    np.testing.assert_array_equal([r.advantage for r in members],
                                  rank(np.array([r.reward for r in members], np.float32), None))


def test_an_unknown_estimator_is_refused_with_the_names_there_are():
  c = agent_config('tiny', grpo=dict(advantage='ranked'))
  with pytest.raises(ConfigError, match=r"grpo.advantage.*'ranked'.*\['grpo'"):
    AgentSpec.from_config('a', c, 20)
  with pytest.raises(ValueError, match='registered already'):
    credit.register_advantage('grpo')(rank)


def test_the_learner_saves_and_restores_its_state():
  cfg = GRPOConfig(self_imitation=1.0, zero_spread_baseline=1.0, balance_answers=10)
  learner = Learner(cfg, global_batch=4)
  served = ServedGroup('q0', 0, 'a', 0, [1, 2], [f'q0_0_{j}' for j in range(4)],
                       [np.array([5, 1])] * 4, [np.zeros(2, np.float32)] * 4)
  rewards = np.array([1.0, 0.0, 0.0, 0.0], np.float32)
  group = Group(served, rewards, credit.group_advantages(rewards, 4), np.array([1.0, 0, 0, 0]),
                'y')
  learner.micro_batch([group], version=0)
  plan = learner.update([group])
  assert plan.takes_step and not plan.reset and plan.stats['replayed'] == 0.0
  restored = Learner(cfg, global_batch=4)
  restored.load(learner.state_dict())
  assert restored.state_dict() == learner.state_dict()
  assert list(restored.rewards) == [1.0, 0.0, 0.0, 0.0] and list(restored.answers) == ['y']
  assert list(restored.best_answers) == ['y']
