"""The paper's category-assistant workload, predicted with the merchant fit.

  python -m flexmarl.simulate --config=experiments/sim/category_assistant.py

The paper publishes the step times (FlexMARL 78.8 s, MARTI 112.8 s, MAS-RL 438.6 s;
124.1 s without the micro-batch pipeline, 95.9 s without load balancing) but not the
team. Its shape is an assumption (`TEAM`) read off a published ratio, not fitted to
these times: MAS-RL trains the agents one after another, so its step over MARTI's
grows with the number of agents; on the merchant team of 5 it is 914.4 / 174.1 = 5.25,
about 1.05 per agent, and here 438.6 / 112.8 = 3.89, about 4 agents: a router and three
Qwen2.5-14B specialists (no 32B agent: every figure is lighter than the merchant's).
Every other parameter is the merchant's (experiments/sim/paper.py, FIT), not refitted.
"""

from experiments.sim import paper

# Assumed from MAS-RL / MARTI = 3.89 (see above): agents in the team, all Qwen2.5-14B.
TEAM = dict(agents=4, model='qwen2.5-14b', zipf=0.8)


def get_config(arg: str = ''):
  del arg
  specialists = [TEAM['model']] * (TEAM['agents'] - 1)
  team = paper.router_team(TEAM['model'], specialists, zipf=TEAM['zipf'])
  return paper.paper_config(team, dict(flexmarl=78.8, colocated=112.8, agents_in_turn=438.6,
                                       flexmarl_no_pipeline=124.1, flexmarl_no_balance=95.9))
