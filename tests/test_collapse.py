"""Collapse onto one answer, told: `grpo.collapsed` sees a batch whose sampled answers are
nearly all one answer where the right answers differ; after `collapse_after` such
batches in a row the run says so."""

import math
import os

import numpy as np
import pytest

from experiments import claim_checker
from flexmarl.metrics.stall import StallWatch
from flexmarl.metrics.writer import read_metrics
from flexmarl.run import train
from flexmarl.train import grpo
from flexmarl.train.spec import GRPOConfig
from flexmarl.workflows.base import Episode, Query
from flexmarl.workflows.tasks import partial_credit

Y, N = np.array([5, 1]), np.array([6, 1])  # two answers' token ids


@pytest.mark.quick
def test_collapsed_is_one_answer_where_the_right_ones_differ():
  cfg = GRPOConfig()
  assert (cfg.collapse_share, cfg.collapse_after) == (0.9, 3)
  assert grpo.mode_share([Y, Y, N, Y]) == 0.75 and math.isnan(grpo.mode_share([]))
  mixed = ['y'] * 15 + ['n'] * 5  # right answers: 75% y
  assert grpo.collapsed(cfg, [Y] * 20, mixed)
  assert grpo.collapsed(cfg, [Y] * 18 + [N] * 2, mixed)  # 90% alike
  assert not grpo.collapsed(cfg, [Y] * 17 + [N] * 3, mixed)  # 85%: still differing
  assert not grpo.collapsed(cfg, [Y] * 20, ['y'] * 20)  # one right answer: solved
  assert not grpo.collapsed(cfg, [Y] * 20, ['y'] * 19 + ['n'])  # 95% of them y
  assert not grpo.collapsed(cfg, [Y] * 20, [None] * 20)  # no expected answers: unknown
  assert not grpo.collapsed(GRPOConfig(collapse_after=0), [Y] * 20, mixed)  # off


def test_the_watch_says_once_when_an_agent_collapses():
  cfg, watch = GRPOConfig(), StallWatch()
  line = dict(accuracy=0.75, zero_spread=0.5, entropy=0.001, entropy_bonus=0.0)
  assert watch.lines('c', 5, dict(line, collapse_run=2), cfg) == []
  said, = watch.lines('c', 6, dict(line, collapse_run=3), cfg)
  assert "warning: step 6: agent 'c' has collapsed onto one answer: in 3 batches" in said
  assert watch.lines('c', 7, dict(line, collapse_run=4), cfg) == []
  assert watch.lines('c', 8, dict(line, collapse_run=3), GRPOConfig(collapse_after=0)) == []


FORCED_STEPS, STEPS = 40, 60
QUERIES_PER_STEP = 16  # 64 rows / groups of 4


class ForcedDigitJudge:
  """`d?` → `y` for digits below 7, else `n` (a constant `y` scores 0.7). The first
  FORCED_STEPS steps' queries pay `y` whatever the digit and give no expected answer
  (so nothing is counted there): the judge is driven onto one answer. From scratch, on
  the defaults, it learns this task (balanced accuracy 1.0 by update 60, RESULTS.md)."""

  def agent_names(self):
    return ['checker']

  def make_query(self, rng, query_id):
    d = int(rng.integers(10))
    return Query(query_id, f'{d}?', 'y' if d < 7 else 'n', 'digit')

  async def run(self, query, agents):
    episode, forced = Episode(), int(query.query_id[1:]) < FORCED_STEPS * QUERIES_PER_STEP
    for c in await agents['checker'].generate(query.prompt):
      episode.score(c, partial_credit(c.text, 'y' if forced else query.answer),
                    correct=c.text == query.answer, expected=None if forced else query.answer)
    return episode


def test_a_forced_collapse_is_counted_and_said(tmp_path):
  """Driven onto `y` (entropy below 0.05 nats/token), then the real task: every batch
  after the forcing counts as collapsed, the run says so once `collapse_after` batches
  in a row have, and the agent stays no better than the constant (what the warning
  tells the user to act on)."""
  config = claim_checker.get_config()
  config.steps = config.checkpoint_every = STEPS
  logged = []
  train(config, str(tmp_path), workflow=ForcedDigitJudge(), log=logged.append)
  lines = [l for l in read_metrics(os.path.join(tmp_path, 'metrics.jsonl'))
           if l['agent'] == 'checker' and l.get('updated')]
  forced = [l for l in lines if l['step'] <= FORCED_STEPS]
  assert forced[-1]['entropy'] < 0.05 and {l['collapse_run'] for l in forced} == {0}
  after = [l for l in lines if l['step'] > FORCED_STEPS]
  assert max(l['collapse_run'] for l in after) >= 3
  said = [line for line in logged if "agent 'checker' has collapsed onto one answer" in line]
  assert said and all(line.startswith('warning: step ') for line in said)
  balanced = [l.get('balanced_above_constant', math.nan) for l in after]
  assert np.nanmax(balanced) < 0.1
