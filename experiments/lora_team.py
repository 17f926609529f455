"""A team of LoRA adapters on a base trained here: the default experiment's router and
specialists (reverse, sort, add) as adapters on one frozen base, all four served by one
rollout instance.

Two runs. First the base: one full-parameter agent, `generalist`, is the router and
every specialist at once, so it learns the whole mix of task families (routing
prompts `...?` and task prompts `...=`). It is exported as an HF folder, which then is
every team agent's `model.checkpoint`: the team trains adapters only, the base stays
frozen, and one instance (`rollout.adapter_groups`) holds the base once and each agent's
adapter. Run from the repository root:

  export XLA_FLAGS=--xla_force_host_platform_device_count=8
  python -m flexmarl.main --config=experiments/lora_team.py:base --workdir=runs/lora_base
  python -m flexmarl.export runs/lora_base generalist runs/lora_base/hf
  python -m flexmarl.main --config=experiments/lora_team.py --workdir=runs/lora_team

`--config.agents.router.model.checkpoint=...` (and the same for each agent) points the
team at another base. Small variants (a few steps each, a smoke test):
`:base_runlocal` and `:runlocal`.
"""

import ml_collections

from flexmarl.config import agent_config, cluster_config, rollout_config

FAMILIES = ('reverse', 'sort', 'add')  # most frequent first (Zipf skew)
TEAM = {'reverse': 'reverser', 'sort': 'sorter', 'add': 'adder'}
BASE = 'runs/lora_base/hf'  # the export of the base run (see the docstring)


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  base = arg.startswith('base')
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.steps = 1500 if base else 600
  config.schedule = 'flexmarl'
  config.tokenizer = 'char'
  config.max_prompt_len = 8
  config.checkpoint_every = 250 if base else 200
  config.cluster = cluster_config()
  # The default experiment's task mix; answers: reverse 2 letters, sort 2 digits, add 1
  # digit, a route 1 digit (+ EOS; 3 tokens for all, as the agents of one instance
  # sample alike).
  config.workflow = dict(
      name='hierarchical_assistant', router='generalist' if base else 'router',
      specialists=[(f, 'generalist' if base else TEAM[f]) for f in FAMILIES], zipf=1.0,
      router_reward='routing',
      task_args={'reverse': {'length': 2, 'alphabet': 5}, 'sort': {'length': 2, 'max_digit': 4},
                 'add': {'max_operand': 4}})
  config.rollout = rollout_config(devices='separate', query_concurrency=24,
                                  max_step_queries=96)

  def agent(group_size: int, global_batch: int) -> ml_collections.ConfigDict:
    # GRPO and the optimizer at the library's defaults (no per-agent tuning). Adapters
    # too: at 1e-2 (a usual LoRA rate) the adder's adapter, wrong on most rows of the
    # base, took the entropy bonus to uniform answers within three updates.
    return agent_config(
        'tiny', group_size=group_size, global_batch=global_batch,
        micro_batch=global_batch // 2,
        sampling=dict(temperature=1.0, top_p=1.0, max_new_tokens=3))

  if base:
    # One agent sees every query twice (its route, then its answer): the team's batches
    # together.
    config.agents = dict(generalist=agent(group_size=8, global_batch=256))
  else:
    def adapter(group_size: int, global_batch: int):
      a = agent(group_size, global_batch)
      a.model.checkpoint = BASE
      a.model.lora = dict(rank=16, alpha=32.0)
      return a
    config.agents = dict(router=adapter(4, 96), reverser=adapter(8, 96),
                         sorter=adapter(8, 48), adder=adapter(8, 32))
    # One instance (on a device of its own) serves all four adapters over one base copy.
    config.rollout.adapter_groups = [['router', 'reverser', 'sorter', 'adder']]

  if arg.endswith('runlocal'):
    config.steps, config.checkpoint_every = 5, 5
  return ml_collections.ConfigDict(config)
