"""Self-imitation (`grpo.self_imitation`, `flexmarl.train.replay`): a group whose samples
are all wrong gets the agent's own last right answer for the same expected answer, in
place of its last sample (the batch keeps its shape); the update then raises that answer where GRPO alone takes no step, and a
checkpoint keeps what the agent remembers."""

import collections

import jax
import numpy as np
import pytest

from flexmarl.agent import Agent
from flexmarl.agent_spec import AgentSpec, agent_config
from flexmarl.data.groups import Group
from flexmarl.data.records import ServedGroup
from flexmarl.models import sharding
from flexmarl.models.transformer import ModelConfig
from flexmarl.rollout.pool import InstancePool
from flexmarl.train import replay
from flexmarl.train.loss import response_logprobs
from flexmarl.train.spec import GRPOConfig
from flexmarl.train.trainer import AgentTrainer, OptimizerConfig, TrainBatch

N, Y = np.array([6, 2]), np.array([5, 2])  # two answers' token ids (then EOS)


@pytest.mark.quick
def test_the_last_right_answer_per_expected_answer_is_remembered_and_replayed():
  memory = collections.OrderedDict()
  replay.remember_right(memory, 'n', np.array([0., 1., 1.]), [Y, N, np.array([6, 6, 2])])
  replay.remember_right(memory, 'y', np.array([0., 0.]), [N, N])  # nothing right: nothing
  replay.remember_right(memory, None, np.array([1.]), [Y])  # no expected answer: nothing
  assert list(memory) == ['n'] and memory['n'].tolist() == [6, 6, 2]  # the last right one
  cfg = GRPOConfig(self_imitation=1.0)
  out = replay.replays(cfg, ['n', 'n', 'y', 'n', None],
                       [np.zeros(2), np.array([1., 0.]), np.zeros(2),
                        np.array([np.nan, 0.]), np.zeros(2)], memory)
  # Only an all-wrong group whose expected answer the agent has given right elsewhere.
  assert out[0].tolist() == [6, 6, 2] and out[1:] == [None] * 4
  assert GRPOConfig().self_imitation == 1.0  # on by default (RESULTS.md)
  off = GRPOConfig(self_imitation=0.0)
  assert replay.replays(off, ['n'], [np.zeros(2)], memory) == [None]


@pytest.mark.quick
def test_the_memory_keeps_the_most_recent_expected_answers(monkeypatch):
  monkeypatch.setattr(replay, 'REPLAY_MEMORY', 2)
  memory = collections.OrderedDict()
  for answer in ('a', 'b', 'a', 'c'):
    replay.remember_right(memory, answer, np.ones(1), [Y])
  assert list(memory) == ['a', 'c']


def _agent(weight: float) -> Agent:
  spec = AgentSpec.from_config('a', agent_config(
      'tiny', group_size=4, global_batch=8, micro_batch=8,
      grpo=dict(self_imitation=weight)), 20)
  trainer = AgentTrainer('a', ModelConfig(vocab_size=20), OptimizerConfig(),
                         GRPOConfig(entropy_coef=0.0), sharding.make_mesh(jax.devices()[:1],
                                                                            (1, 1)), seed=3)
  return Agent(spec, trainer, InstancePool('a', [], make_sampler=None), checkpointer=None,
               prompt_len=5, pad_id=0)


def _logprob(agent: Agent, prompt: list[int], answer: np.ndarray) -> float:
  rows = TrainBatch.from_rows([prompt], [answer], [np.zeros(len(answer), np.float32)],
                              np.zeros(1, np.float32), prompt_len=5, response_len=4, pad_id=0)
  logp, _ = response_logprobs(agent.trainer.graphdef, agent.trainer.params,
                              rows.device_arrays(), 1.0)
  return float(np.asarray(logp)[0, :len(answer)].sum())


def _groups(agent: Agent, prompt: list[int], answer: np.ndarray, correct: float,
            expected: str) -> list[Group]:
  """Two groups of four samples that all gave `answer` (stale by a version, so that the
  served-logprob check, which needs a real sampler, leaves them)."""
  return [Group(ServedGroup(f'q{agent.version}_{q}', 0, 'a', agent.version - 1, prompt,
                            [f'q{agent.version}_{q}_0_{j}' for j in range(4)], [answer] * 4,
                            [np.full(2, np.log(0.5), np.float32)] * 4),
                np.full(4, correct, np.float32), np.zeros(4, np.float32), np.full(4, correct),
                expected) for q in range(2)]


def test_an_all_wrong_group_is_pulled_to_the_agents_own_right_answer():
  """A prompt answered `y` by every sample where `n` is right: GRPO has nothing (the
  twin without the option skips the batch); with it, the answer `n` the agent gave right
  to another prompt is replayed there, and its probability on that prompt rises. A
  restored agent remembers it."""
  stuck, other = [1, 7, 8], [1, 9, 8]
  imitating, grpo_only = _agent(1.0), _agent(0.0)
  for agent in (imitating, grpo_only):  # an update where `n` was right on another prompt
    seen = _groups(agent, other, N, 1.0, 'n')
    agent.update(seen, [seen])()
  assert list(imitating.right_answers) == ['n'] and not grpo_only.right_answers
  before = _logprob(imitating, stuck, N)
  assert before == _logprob(grpo_only, stuck, N)  # twins: both skipped the solved batch
  wrong = _groups(imitating, stuck, Y, 0.0, 'n')
  stats = imitating.update(wrong, [wrong])()
  assert stats['skipped_update'] == 0.0 and stats['replayed'] == 2 / 8
  # In place of a sample: the batch keeps its 8 rows (one more would pad it to 16).
  assert stats['rows'] == 8 and stats['trained_tokens'] == 8 * len(Y)
  assert _logprob(imitating, stuck, N) > before + 0.01
  wrong = _groups(grpo_only, stuck, Y, 0.0, 'n')
  assert grpo_only.update(wrong, [wrong])()['skipped_update'] == 1.0
  assert _logprob(grpo_only, stuck, N) == before
  restored = _agent(1.0)
  restored.restore(imitating.train_state(), imitating.counters())
  assert {e: t.tolist() for e, t in restored.right_answers.items()} == {'n': N.tolist()}
