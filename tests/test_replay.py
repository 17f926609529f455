"""Self-imitation (`grpo.self_imitation`, `flexmarl.train.replay`): a group whose samples
are all wrong gets the agent's own best answer so far for the same expected answer, in
place of its last sample (the batch keeps its shape); the update then raises that answer where GRPO alone takes no step, and a
checkpoint keeps what the agent remembers."""

import collections

import jax
import numpy as np
import pytest

from flexmarl.agent import Agent
from flexmarl.data.groups import Group
from flexmarl.data.records import ServedGroup
from flexmarl.models import sharding
from flexmarl.models.transformer import ModelConfig
from flexmarl.rollout.pool import InstancePool
from flexmarl.spec.agent import AgentSpec, agent_config
from flexmarl.train import replay
from flexmarl.train.loss import response_logprobs
from flexmarl.train.spec import GRPOConfig
from flexmarl.train.trainer import AgentTrainer, OptimizerConfig, TrainBatch

N, Y = np.array([6, 2]), np.array([5, 2])  # two answers' token ids (then EOS)


@pytest.mark.quick
def test_the_last_right_answer_per_expected_answer_is_remembered_and_replayed():
  memory = collections.OrderedDict()
  replay.remember_best(memory, 'n', np.array([0., 1., 1.]), np.array([0., 1., 1.]),
                       [Y, N, np.array([6, 6, 2])])
  replay.remember_best(memory, 'y', np.zeros(2), np.zeros(2), [N, N])  # no reward: nothing
  replay.remember_best(memory, None, np.ones(1), np.ones(1), [Y])  # no expected answer
  assert list(memory) == ['n'] and memory['n'].tokens.tolist() == [6, 6, 2]  # the last
  cfg = GRPOConfig(self_imitation=1.0)
  out = replay.replays(cfg, ['n', 'n', 'y', 'n', None],
                       [np.zeros(2), np.array([1., 0.]), np.zeros(2), np.zeros(2),
                        np.zeros(2)],
                       [np.zeros(2), np.array([1., 0.]), np.zeros(2),
                        np.array([np.nan, 0.]), np.zeros(2)], memory)
  # Only an all-wrong group whose expected answer the agent has given right elsewhere.
  assert out[0].tolist() == [6, 6, 2] and out[1:] == [None] * 4
  assert GRPOConfig().self_imitation == 1.0  # on by default (RESULTS.md)
  off = GRPOConfig(self_imitation=0.0)
  assert replay.replays(off, ['n'], [np.zeros(2)], [np.zeros(2)], memory) == [None]


@pytest.mark.quick
def test_while_never_right_the_best_scored_answer_is_kept_until_a_right_one():
  """A checker that found `n` only with a stray letter after it (half the partial
  credit) replays that where its group scores less, and a right `n` then takes over."""
  memory, cfg = collections.OrderedDict(), GRPOConfig(self_imitation=1.0)
  nq, nx = np.array([6, 9, 2]), np.array([6, 8, 2])
  replay.remember_best(memory, 'n', np.array([0.0, 0.5]), np.zeros(2), [Y, nq])
  replay.remember_best(memory, 'n', np.array([0.5, 0.0]), np.zeros(2), [nx, Y])  # no better
  assert memory['n'].tokens.tolist() == nq.tolist() and not memory['n'].right
  out = replay.replays(cfg, ['n', 'n'], [np.zeros(2), np.array([0.5, 0.0])],
                       [np.zeros(2), np.zeros(2)], memory)
  assert out[0].tolist() == nq.tolist() and out[1] is None  # the second scored as much
  replay.remember_best(memory, 'n', np.array([0.0, 1.0]), np.array([0., 1.]), [Y, N])
  replay.remember_best(memory, 'n', np.array([0.5]), np.zeros(1), [nx])  # right stays
  best = memory['n']
  assert best.right and best.reward == 1.0 and best.tokens.tolist() == N.tolist()
  out = replay.replays(cfg, ['n'], [np.array([0.5, 0.5])], [np.zeros(2)], memory)
  assert out[0].tolist() == N.tolist()  # a right answer: whatever the group scored


@pytest.mark.quick
def test_the_memory_keeps_the_most_recent_expected_answers(monkeypatch):
  monkeypatch.setattr(replay, 'REPLAY_MEMORY', 2)
  memory = collections.OrderedDict()
  for answer in ('a', 'b', 'a', 'c'):
    replay.remember_best(memory, answer, np.ones(1), np.ones(1), [Y])
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
  assert list(imitating.learner.best_answers) == ['n'] and not grpo_only.learner.best_answers
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
  assert {e: (b.tokens.tolist(), b.right) for e, b in restored.learner.best_answers.items()} == {
      'n': (N.tolist(), True)}
  # A checkpoint from before wrong answers were kept holds right ones under another key.
  meta = dict(imitating.counters(), right_answers=[['n', N.tolist()]])
  del meta['best_answers']
  older = _agent(1.0)
  older.restore(imitating.train_state(), meta)
  assert {e: (b.tokens.tolist(), b.right) for e, b in older.learner.best_answers.items()} == {
      'n': (N.tolist(), True)}


@pytest.mark.quick
@pytest.mark.parametrize('key', ['answer', 'prompt'])
def test_keyed_by_prompt_an_answer_is_replayed_only_into_its_own_prompt(key):
  """Where a response is reasoning that ends in the answer, one problem's right response
  is wrong under another problem's prompt with the same answer: `self_imitation_key=
  'prompt'` replays it only into its own prompt; 'answer' into any prompt."""
  from flexmarl.train.learner import Learner
  learner = Learner(GRPOConfig(self_imitation_key=key), 8)

  def group(prompt, answer, right):
    served = ServedGroup('q', 0, 'a', 0, prompt, ['q_0', 'q_1'], [answer] * 2,
                         [np.zeros(2, np.float32)] * 2)
    return Group(served, np.full(2, right, np.float32), np.zeros(2, np.float32),
                 np.full(2, right, np.float32), 'n')

  learner.micro_batch([group([1, 9], N, 1.0)], 0)  # right on one prompt
  other = learner.micro_batch([group([1, 7], Y, 0.0)], 0)  # all wrong on another
  assert (other.tokens[-1] == (N if key == 'answer' else Y)).all()
  same = learner.micro_batch([group([1, 9], Y, 0.0)], 0)  # all wrong on the first
  assert (same.tokens[-1] == N).all()
