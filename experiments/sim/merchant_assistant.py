"""The paper's merchant-assistant workload: Qwen2.5-14B agents behind a router, skewed load.

  python -m flexmarl.simulate --config=experiments/sim/merchant_assistant.py

The team (a router and four specialists, Zipf 1.0) is assumed; the step times are the
paper's (FlexMARL, arXiv 2602.09578), including its two ablations: MARTI is simulated as
`colocated`, MAS-RL as `agents_in_turn`. The unpublished workload parameters were fitted
on these five figures (experiments/sim/paper.py, FIT).
"""

from experiments.sim import paper


def get_config(arg: str = ''):
  del arg
  team = paper.router_team('qwen2.5-14b', ['qwen2.5-14b'] * 4, zipf=1.0)
  return paper.paper_config(team, dict(flexmarl=126.1, colocated=174.1, agents_in_turn=914.4,
                                       flexmarl_no_pipeline=256.2, flexmarl_no_balance=152.2))
