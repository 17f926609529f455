"""Silent groups (`grpo.silent`): a group that adds nothing to the gradient is counted in
its batch, not run through the model, and the update is the one the whole batch gives."""

import os

import numpy as np
import pytest

from flexmarl.data.groups import BatchBuilder, Group, cut_micro_batches
from flexmarl.data.records import ServedGroup
from flexmarl.metrics.writer import read_metrics
from flexmarl.run import train
from flexmarl.train import grpo
from flexmarl.train.spec import GRPOConfig
from test_admission import STEPS, OwnerRouted, _config, _params


def _group(i: int, advantages, correct=(1.0, 1.0)) -> Group:
  served = ServedGroup(f'q{i}', 0, 'a', 0, [1], [f'q{i}_{j}' for j in range(2)],
                       [np.array([1])] * 2, [np.zeros(1)] * 2)
  return Group(served, np.zeros(2, np.float32), np.asarray(advantages, np.float32),
               np.asarray(correct, np.float32))


@pytest.mark.quick
def test_what_is_silent():
  off = GRPOConfig(entropy_coef=0.0, kl_coef=0.0)
  assert grpo.silent(off, np.zeros(4), np.ones(4), replays=True)  # solved
  assert not grpo.silent(off, np.array([1.0, -1.0]), np.array([1.0, 0.0]), replays=True)
  assert not grpo.silent(off, np.zeros(2), np.zeros(2), replays=True)  # may get a replay
  assert grpo.silent(off, np.zeros(2), np.zeros(2), replays=False)
  for other in (dict(entropy_coef=0.01), dict(kl_coef=0.1), dict(zero_spread_baseline=0.5)):
    cfg = GRPOConfig(**dict(dict(entropy_coef=0.0, kl_coef=0.0), **other))
    assert not grpo.silent(cfg, np.zeros(4), np.ones(4), replays=False), other


@pytest.mark.quick
def test_micro_batches_are_cut_from_the_groups_that_are_not_silent():
  groups = [_group(i, [0, 0] if i in (1, 2, 5) else [1, -1]) for i in range(7)]
  silent = lambda g: not g.advantages.any()
  cut = [[int(g.served.query_id[1:]) for g in m]
         for m in cut_micro_batches(groups, 2, silent)]
  assert cut == [[0, 1, 2, 3], [4, 5, 6]]  # silent groups ride with the next loud ones
  builder = BatchBuilder(14, 2, silent=silent)
  for g in groups[:4]:
    builder.add(g)
  assert [len(m) for m in builder.micro_batches()] == [4]
  for g in groups[4:6]:
    builder.add(g)
  assert builder.micro_batches() == []  # one loud group so far: not yet complete
  builder.add(groups[6])
  assert [len(m) for m in builder.micro_batches()] == [3]


def test_same_parameters_as_running_every_row(tmp_path, monkeypatch):
  """The team of test_admission (no entropy bonus, no KL, no replay) trains to the same
  parameters whether silent groups are run through the model or only counted."""
  skipped = str(tmp_path / 'skipped')
  train(_config('flexmarl', 8), skipped, OwnerRouted(), log=lambda *_: None)
  lines = [l for l in read_metrics(os.path.join(skipped, 'metrics.jsonl'))
           if l['agent'] != 'team' and l.get('updated')]
  assert sum(l['trained_tokens'] - l['run_tokens'] for l in lines) > 0  # some were silent
  every = str(tmp_path / 'every')
  monkeypatch.setattr(grpo, 'silent', lambda *_: False)
  train(_config('flexmarl', 8), every, OwnerRouted(), log=lambda *_: None)
  for agent in ('router', 'adder', 'doubler'):
    for x, y in zip(_params(skipped, agent), _params(every, agent), strict=True):
      assert np.abs(x - y).max() <= 1e-5, agent
  assert STEPS == max(l['step'] for l in lines)
