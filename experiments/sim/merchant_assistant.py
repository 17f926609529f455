"""The paper's merchant-assistant workload: Qwen2.5-14B agents behind a router, skewed load.

  python -m flexmarl.simulate --config=experiments/sim/merchant_assistant.py

The team (a router and four specialists, Zipf 1.0) is assumed; the step times are the
paper's (FlexMARL, arXiv 2602.09578), including its two ablations.
"""

from experiments.sim import paper


def get_config(arg: str = ''):
  del arg
  team = paper.router_team('qwen2.5-14b', ['qwen2.5-14b'] * 4, zipf=1.0)
  return paper.paper_config(team, dict(flexmarl=126.1, sync_parallel=174.1, sync=914.4,
                                       flexmarl_no_pipeline=256.2, flexmarl_no_balance=152.2))
