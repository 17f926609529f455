"""The paper's category-assistant workload: 14B and 32B agents.

  python -m flexmarl.simulate --config=experiments/sim/category_assistant.py

Assumed team: a Qwen2.5-32B router that classifies the query's category and four
Qwen2.5-14B category specialists, milder skew (Zipf 0.8). The paper's step times
(FlexMARL 78.8 s, MARTI 112.8 s, MAS-RL 438.6 s; 124.1 s without the micro-batch
pipeline, 95.9 s without load balancing) are predicted with the parameters fitted on the
merchant assistant (experiments/sim/paper.py, FIT), not refitted.
"""

from experiments.sim import paper


def get_config(arg: str = ''):
  del arg
  team = paper.router_team('qwen2.5-32b', ['qwen2.5-14b'] * 4, zipf=0.8, router_response=128)
  return paper.paper_config(team, dict(flexmarl=78.8, colocated=112.8, agents_in_turn=438.6,
                                       flexmarl_no_pipeline=124.1, flexmarl_no_balance=95.9))
