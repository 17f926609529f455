"""Your own team: a planner, a worker called twice in parallel, a judge. GRPO from scratch.

The workflow is a user's class outside the library, `experiments/team_of_three.py`
(`PlannerWorkersJudge`), named in `config.workflow.name` as `module:Class`. Run from the
repository root (the folder that holds `experiments/`, so the module imports):

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python -m flexmarl.main --config=experiments/planner_workers_judge.py --workdir=runs/pwj

Smoke run: `--config=experiments/planner_workers_judge.py:runlocal`.
Each agent trains on one device and rolls out on another (6 devices); on fewer, add
`--config.rollout.devices=shared` (3 devices).
"""

import ml_collections

from flexmarl.config import agent_config, cluster_config, rollout_config


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.steps = 600
  config.schedule = 'flexmarl'
  config.tokenizer = 'char'
  config.max_prompt_len = 10  # 'dbl:3,1?' and BOS
  config.checkpoint_every = 200
  config.cluster = cluster_config()  # backend=ray: docs/cluster.md
  config.workflow = dict(name='experiments.team_of_three:PlannerWorkersJudge',
                         planner='planner', worker='worker', judge='judge')
  # 8 queries fill every batch: per query 8 planner rows, 2 x 8 worker rows, 8 judge rows.
  config.rollout = rollout_config(devices='separate', query_concurrency=8,
                                  max_step_queries=32)

  def agent(global_batch: int) -> ml_collections.ConfigDict:
    # GRPO and the optimizer at the library's defaults (no per-agent tuning).
    return agent_config(
        'tiny', group_size=8, global_batch=global_batch, micro_batch=global_batch // 2,
        sampling=dict(temperature=1.0, top_p=1.0, max_new_tokens=2))  # 1 token + EOS

  config.agents = dict(planner=agent(64), worker=agent(128), judge=agent(64))

  if arg == 'runlocal':
    config.steps, config.checkpoint_every = 5, 5
  return ml_collections.ConfigDict(config)
