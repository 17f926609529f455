"""The paper's category-assistant workload: 14B and 32B agents.

  python -m flexmarl.simulate --config=experiments/sim/category_assistant.py

Assumed team: a Qwen2.5-32B router that classifies the query's category and four
Qwen2.5-14B category specialists, milder skew (Zipf 0.8). The paper's step times for
this workload are not recorded here yet (`paper.step_time_s` is empty).
"""

from experiments.sim import paper


def get_config(arg: str = ''):
  del arg
  team = paper.router_team('qwen2.5-32b', ['qwen2.5-14b'] * 4, zipf=0.8, router_response=128)
  return paper.paper_config(team)
