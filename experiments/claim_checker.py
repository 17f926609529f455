"""An imbalanced yes/no verifier: a checker says y or n to claimed sums, most of them right.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python -m flexmarl.main --config=experiments/claim_checker.py --workdir=runs/checker

Smoke run: `--config=experiments/claim_checker.py:runlocal`.

A claim is `a+b=c?` with digits a, b in 0..2; it is right with probability
`right_share` (0.75), otherwise c is off by one or two. The checker answers `y` or `n`;
reward 1 for the right verdict (per-position partial credit otherwise, as the built-in
tasks give, so that a policy from random weights finds the one-letter answer). Saying `y` to everything scores 0.75: what a verifier
that learned nothing scores when most answers it sees are right, as in a solver/verifier
team once the solver is good. Its skill is told apart from that constant by its
balanced accuracy (the mean of its accuracy on right and on wrong claims: 0.5 for any
constant, `balanced_above_constant` in the metrics), which the robustness suite judges.

The workflow lives in this file (`experiments.claim_checker:ClaimChecker`), the way a
user writes one (docs/workflows.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import ml_collections
import numpy as np

from flexmarl import tasks
from flexmarl.config import agent_config, cluster_config, rollout_config
from flexmarl.workflows.base import AgentClient, Episode, Query

MAX_OPERAND = 2


class ClaimChecker:

  def __init__(self, checker: str = 'checker', right_share: float = 0.75):
    if not 0 < right_share < 1:
      raise ValueError(f'workflow.right_share={right_share!r}: give a share of right '
                       'claims strictly between 0 and 1.')
    self.checker, self.right_share = checker, float(right_share)

  def agent_names(self) -> Sequence[str]:
    return [self.checker]

  def make_query(self, rng: np.random.Generator, query_id: str) -> Query:
    a, b = (int(v) for v in rng.integers(0, MAX_OPERAND + 1, size=2))
    right = bool(rng.random() < self.right_share)
    claim = a + b if right else a + b + int(rng.choice([-2, -1, 1, 2]))
    return Query(query_id, f'{a}+{b}={claim}?', 'y' if right else 'n', 'check')

  async def run(self, query: Query, agents: Mapping[str, AgentClient]) -> Episode:
    episode = Episode()
    for c in await agents[self.checker].generate(query.prompt):
      episode.score(c, tasks.partial_credit(c.text, query.answer),
                    correct=c.text == query.answer, expected=query.answer)
    return episode


def best_constant_accuracy(right_share: float = 0.75) -> dict[str, float]:
  """The checker's best constant answer (`y`) is right on the right claims."""
  return {'checker': max(right_share, 1 - right_share)}


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.steps = 400
  config.schedule = 'flexmarl'
  config.tokenizer = 'char'
  config.max_prompt_len = 10  # '2+1=3?' and BOS
  config.checkpoint_every = 100
  config.cluster = cluster_config()
  config.workflow = dict(name='experiments.claim_checker:ClaimChecker', checker='checker',
                         right_share=0.75)
  config.rollout = rollout_config(devices='shared', query_concurrency=8, max_step_queries=32)
  # GRPO and the optimizer at the library's defaults (no per-agent tuning).
  config.agents = dict(checker=agent_config(
      'tiny', group_size=4, global_batch=64, micro_batch=32,
      sampling=dict(temperature=1.0, top_p=1.0, max_new_tokens=2)))  # y/n + EOS
  if arg == 'runlocal':
    config.steps, config.checkpoint_every = 5, 5
  return config
