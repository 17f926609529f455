"""A planner rewarded only through later agents' results: `planner_workers_judge` where
the planner's reward is whether the team's final answer is right.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python -m flexmarl.main --config=experiments/planner_outcome.py --workdir=runs/po

Smoke run: `--config=experiments/planner_outcome.py:runlocal`. Each distinct plan the
planner samples is carried out (the worker on both digits, the judge on their results),
and each planner sample earns 1 when its plan's final answer is right: credit that
depends on two other agents still learning (`workflow.planner_reward='outcome'` of
`experiments/team_of_three.py`).
"""

import ml_collections

from experiments import planner_workers_judge


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  config = planner_workers_judge.get_config(arg)
  config.workflow.planner_reward = 'outcome'
  return config
