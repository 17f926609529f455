"""Long runs: a solved agent stays solved (no optimizer step from a batch without
advantage signal), and what a run keeps (trace, per-step containers) stays
bounded."""

import concurrent.futures
import json
import os

import jax
import numpy as np
import pytest

from flexmarl.agent import Agent
from flexmarl.core.clock import SimClock
from flexmarl.data.groups import Group
from flexmarl.data.records import ServedGroup
from flexmarl.metrics import spans as sp
from flexmarl.metrics import utilization as ut
from flexmarl.metrics.spans import Span, TraceWriter, load_spans
from flexmarl.models import sharding
from flexmarl.models.transformer import ModelConfig
from flexmarl.rollout import pool as pool_lib
from flexmarl.rollout.pool import InstancePool
from flexmarl.rollout.sampler import SampleBatch
from flexmarl.rollout.spec import SamplingParams
from flexmarl.runtime import workdir
from flexmarl.spec.agent import AgentSpec, agent_config
from flexmarl.train import engine as engine_lib
from flexmarl.train import credit, grpo
from flexmarl.train.state import Transfer
from flexmarl.train.trainer import AgentTrainer, OptimizerConfig, TrainBatch

LR = 3e-3


def _trainer(entropy_coef: float) -> AgentTrainer:
  mesh = sharding.make_mesh(jax.devices()[:1], (1, 1))
  return AgentTrainer('a', ModelConfig(vocab_size=20), OptimizerConfig(learning_rate=LR),
                      # The bonus on every row: the mechanism as first found.
                      grpo.GRPOConfig(entropy_coef=entropy_coef, entropy_by_error=False), mesh,
                      seed=3)


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
  t = _trainer(entropy_coef)
  before = _host(t.params)
  t.accumulate(_batch(ZERO))
  stats = t.apply()
  assert 0 < stats['grad_norm'] < 5 * entropy_coef  # a gradient as small as the bonus ...
  assert 0.5 * LR < _max_move(before, _host(t.params)) < 1.5 * LR  # ... a full step
  assert stats['skipped_update'] == 0.0


def test_without_the_fix_momentum_moves_params_at_a_zero_gradient():
  """Why the fix skips the step instead of zeroing the entropy term: after one real
  update, Adam's momentum alone moves the parameters on a zero gradient."""
  t = _trainer(0.0)
  t.accumulate(_batch(SIGNAL))
  t.apply()
  before = _host(t.params)
  t.accumulate(_batch(ZERO))
  assert t.apply()['grad_norm'] == 0.0
  assert _max_move(before, _host(t.params)) > 0.3 * LR


def test_a_skipped_step_leaves_params_and_adam_state_unchanged():
  t = _trainer(0.1)
  t.accumulate(_batch(SIGNAL))
  assert t.apply()['skipped_update'] == 0.0
  params, opt_state = _host(t.params), _host(t.opt_state)
  for _ in range(3):  # a solved agent: every group agrees
    t.accumulate(_batch(ZERO[:4]))
    t.accumulate(_batch(ZERO[4:]))
    stats = t.dispatch_apply(step=False)()
    assert stats['skipped_update'] == 1.0 and stats['grad_norm'] == 0.0
    assert stats['trained_tokens'] == 24 and stats['entropy'] > 0  # still measured
  for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(_host(t.params))):
    np.testing.assert_array_equal(x, y)
  for x, y in zip(jax.tree.leaves(opt_state), jax.tree.leaves(_host(t.opt_state))):
    np.testing.assert_array_equal(x, y)
  assert t.state.grads is None
  t.accumulate(_batch(SIGNAL))  # the next batch starts from a zero accumulator
  assert t.apply()['skipped_update'] == 0.0
  assert _max_move(params, _host(t.params)) > 0.5 * LR


@pytest.mark.quick
def test_the_step_decision_by_hand():
  on, off = grpo.GRPOConfig(), grpo.GRPOConfig(skip_without_signal=False)
  never = grpo.GRPOConfig(unstick_after=0)
  assert on.skip_without_signal and (on.unstick_below, on.unstick_after) == (0.5, 5)
  zero = np.zeros(4)
  spread = np.array([0.5, -0.5, 0.5, -0.5])
  right, wrong, unknown = np.ones(4), np.zeros(4), np.full(4, np.nan)
  assert grpo.takes_step(on, [zero, spread], 0)  # a group with signal
  assert not grpo.takes_step(on, [zero, zero], 0)  # no signal: skip
  assert grpo.takes_step(off, [zero, zero], 0)
  # Stuck: no signal and mostly wrong, judged on the rows whose correctness is known.
  assert not grpo.stuck(on, [zero, spread], [wrong, wrong])
  assert not grpo.stuck(on, [zero, zero], [right, wrong])  # half right
  assert grpo.stuck(on, [zero, zero, zero], [right, wrong, wrong])
  assert not grpo.stuck(on, [zero, zero], [unknown, unknown])
  assert grpo.stuck(on, [zero, zero], [unknown, wrong])
  # Stuck batches step on the bonus alone only after `unstick_after` in a row.
  assert [grpo.takes_step(on, [zero], run) for run in range(1, 8)] == [False] * 4 + [True] * 3
  assert not grpo.takes_step(never, [zero], 100)


def test_a_long_trace_keeps_a_window_of_recent_steps_and_stays_valid(tmp_path):
  path = str(tmp_path / sp.TRACE_FILE)
  writer = TraceWriter(path, keep_steps=10)
  writer.write(Span('store:a', sp.STORE_WRITE, 0.0, 0.1, {}))  # names no step: kept
  sizes = []
  for step in range(1, 201):
    for track in ('train:a', 'rollout:a/0', 'rollout:a/1'):
      writer.write(Span(track, sp.GENERATE, step, step + 0.5, {'step': step}))
    sizes.append(os.path.getsize(path))
  assert max(sizes) < 1.6 * sizes[14]  # bounded by 1.5 windows' spans, after the first
  writer.close()
  events = json.loads(open(path).read())  # one valid JSON array, as Perfetto reads it
  steps = sorted({e['args']['step'] for e in events if e['ph'] == 'X' and e['args']})
  assert steps[-1] == 200 and 10 <= len(steps) <= 15 and steps == list(range(steps[0], 201))
  names = {e['args']['name'] for e in events if e['ph'] == 'M'}
  assert names >= {'train:a', 'rollout:a/0', 'rollout:a/1', 'store:a'}  # tracks still named
  spans = load_spans(path)
  assert {s.track for s in spans} == {'store:a', 'train:a', 'rollout:a/0', 'rollout:a/1'}
  # The utilization of the steps kept is that of the same spans never trimmed.
  full = [Span(t, sp.GENERATE, s, s + 0.5, {'step': s}) for s in steps
          for t in ('train:a', 'rollout:a/0', 'rollout:a/1')]
  assert ut.step_report([s for s in spans if s.step]) == ut.step_report(full)
  # A resumed run keeps the window and appends.
  writer = TraceWriter(path, resume_step=195, keep_steps=10)
  writer.write(Span('train:a', sp.GENERATE, 196.0, 196.5, {'step': 196}))
  writer.close()
  kept = [s.step for s in load_spans(path) if s.step]
  assert max(kept) == 196 and kept.count(196) == 1 and min(kept) == steps[0]


def test_the_trace_window_is_checked():
  with pytest.raises(ValueError, match='keep_steps=-1'):
    TraceWriter('unused.json', keep_steps=-1)


class _Immediate:
  """A sampler whose every batch is done at once: one token per row."""

  version = 0

  def submit(self, prompts, keys, params, limits=None):
    future = concurrent.futures.Future()
    future.set_result(SampleBatch(np.ones((len(prompts), 1), np.int32),
                                  np.zeros((len(prompts), 1), np.float32),
                                  np.ones(len(prompts), np.int32)))
    return future


def test_an_instance_keeps_only_its_recent_batches(monkeypatch):
  monkeypatch.setattr(pool_lib, 'RECENT', 8)
  inst = pool_lib.Instance('a/0', (0,), _Immediate())
  for i in range(50):  # a long run: one batch of one request per step
    inst.queue.append(pool_lib.Request(i, f'q{i}', 0, 'a', [1], 2, 4, future=None, served=[],
                                       enqueued=float(i)))
    inst.submit_next(lambda r, v: np.zeros((r.n, 2), np.uint32), SamplingParams(), 4,
                     now=i + 0.25)
    inst.collect(now=i + 0.5)
  assert len(inst.busy) == len(inst.waits) == 8
  assert list(inst.busy)[-1] == (49.25, 49.5) and list(inst.waits)[0] == ('a', 0.25)


def test_the_training_pool_keeps_only_its_recent_swaps(monkeypatch):
  monkeypatch.setattr(engine_lib, 'RECENT_SWAPS', 5)
  engine = engine_lib.TrainingEngine({'a': None}, [], clock=SimClock())
  for i in range(20):  # a long run: a swap per step
    engine._record('a', 'pool0', sp.SWAP_IN, Transfer('host', 'mesh', 100 + i, 0.5), 0.0, 0.5,
                   0.0)
  assert [s['bytes'] for s in engine.log] == list(range(115, 120))
  assert engine.step_stats('a')['swaps'] == 20  # the per-step sums still count every swap


def test_an_agent_skips_the_step_of_a_batch_without_signal_and_still_advances_its_version():
  spec = AgentSpec.from_config('a', agent_config('tiny', group_size=4, global_batch=8,
                                                 micro_batch=8), 20)
  trainer = _trainer(0.1)
  agent = Agent(spec, trainer, InstancePool('a', [], make_sampler=None), checkpointer=None,
                prompt_len=5, pad_id=0)

  def groups(correct: float, rewards: list[float]) -> list[Group]:
    out = []
    for q in range(2):
      # One version stale, so the served-logprob check (it needs a real sampler) skips it.
      served = ServedGroup(f'q{q}', 0, 'a', agent.version - 1, [1, 5, 6],
                           [f'q{q}_0_{j}' for j in range(4)], [np.array([4, 7, 2])] * 4,
                           [np.full(3, np.log(0.5), np.float32)] * 4)
      r = np.array(rewards, np.float32)
      out.append(Group(served, r, credit.group_advantages(r, 4), np.full(4, correct)))
    return out

  before = _host(trainer.params)
  solved = groups(1.0, [1.0] * 4)
  assert agent.update(solved, [solved])()['skipped_update'] == 1.0 and agent.version == 1
  assert _max_move(before, _host(trainer.params)) == 0.0
  stuck = groups(0.0, [0.0] * 4)  # all wrong and alike: no signal either, skipped
  assert agent.update(stuck, [stuck])()['skipped_update'] == 1.0 and agent.version == 2
  assert _max_move(before, _host(trainer.params)) == 0.0
  mixed = groups(0.5, [1.0, 0.0, 1.0, 0.0])  # a signal: a step
  assert agent.update(mixed, [mixed])()['skipped_update'] == 0.0 and agent.version == 3
  assert _max_move(before, _host(trainer.params)) > 0.5 * LR


def test_agreeing_groups_are_pushed_against_the_last_batchs_mean_which_a_checkpoint_keeps():
  """`zero_spread_baseline`: once an earlier batch set the mean, an agreeing wrong group
  changes the update (GRPO alone gives it nothing: a twin agent without the option
  differs only from then on); the mean's rewards travel in the checkpoint's counters, so
  a resumed agent computes the same."""
  def agent_with(weight: float) -> Agent:
    spec = AgentSpec.from_config('a', agent_config(
        'tiny', group_size=4, global_batch=8, micro_batch=8,
        grpo=dict(zero_spread_baseline=weight)), 20)
    return Agent(spec, _trainer(0.0), InstancePool('a', [], make_sampler=None),
                 checkpointer=None, prompt_len=5, pad_id=0)

  def group(agent: Agent, q: int, rewards: list[float]) -> Group:
    served = ServedGroup(f'q{q}', 0, 'a', agent.version - 1, [1, 5, 6],
                         [f'q{q}_0_{j}' for j in range(4)], [np.array([4, 7, 2 + q])] * 4,
                         [np.full(3, np.log(0.5), np.float32)] * 4)
    r = np.array(rewards, np.float32)
    return Group(served, r, credit.group_advantages(r, 4), r)

  agent, grpo_only = agent_with(1.0), agent_with(0.0)
  for step, rewards in enumerate(([1.0] * 4, [0.0] * 4)):  # all right, then all wrong
    for a in (agent, grpo_only):
      batch = [group(a, 2 * step, rewards), group(a, 2 * step + 1, [1.0, 0.0, 1.0, 0.0])]
      a.update(batch, [batch])()
    moved = _max_move(_host(grpo_only.trainer.params), _host(agent.trainer.params))
    if step == 0:  # no earlier batch: no mean to compare with, GRPO's update
      assert moved == 0.0
      assert list(agent.counters()['rewards']) == [1.0] * 4 + [1.0, 0.0, 1.0, 0.0]
  assert moved > 0.5 * LR  # the agreeing wrong group pushed against the mean 0.75
  resumed = agent_with(1.0)
  resumed.restore(agent.train_state(), agent.counters())
  assert list(resumed.learner.rewards) == list(agent.learner.rewards) == [0.0] * 4 + [1.0, 0.0, 1.0, 0.0]


def test_a_run_from_before_these_fields_resumes_with_them():
  old = {'steps': 10, 'agents': {'a': {'grpo': {'entropy_coef': 0.1}}}}
  new = {'steps': 10, 'trace_steps': 1000,
         'agents': {'a': {'grpo': {'entropy_coef': 0.1, 'skip_without_signal': True,
                                   'entropy_by_error': True}}}}
  refused, harmless = workdir.diff_configs(old, new)
  assert not refused and set(harmless) == {'trace_steps', 'agents.a.grpo.skip_without_signal',
                                           'agents.a.grpo.entropy_by_error'}
