"""The paper's scalability mixes: 5 x 32B, 3 x 32B + 7 x 14B, 15 x 14B agents.

  python -m flexmarl.simulate --config=experiments/sim/scalability.py:3x32b+7x14b

Each mix is a router (the first, largest model) and specialists (Zipf 1.0), as in the
merchant assistant; the team shape is assumed, the model mixes are the paper's.
"""

from experiments.sim import paper

MIXES = {
    '5x32b': ['qwen2.5-32b'] * 5,
    '3x32b+7x14b': ['qwen2.5-32b'] * 3 + ['qwen2.5-14b'] * 7,
    '15x14b': ['qwen2.5-14b'] * 15,
}


def get_config(arg: str = '15x14b'):
  mix = arg or '15x14b'
  if mix not in MIXES:
    raise ValueError(f'scalability.py:{mix}: unknown mix; use one of {sorted(MIXES)}.')
  models = MIXES[mix]
  return paper.paper_config(paper.router_team(models[0], models[1:], zipf=1.0))
