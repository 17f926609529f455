"""Experiment config → checked, typed team spec.

Experiments are ml_collections ConfigDicts (`experiments/*.py: get_config()`). Each
part's spec lives with its part and checks its own fields (flexmarl.spec.agent,
flexmarl.rollout.spec, flexmarl.train.spec); this module composes them and checks what
spans parts, `rollout.backend` against the backend registry among them (`team_spec`: no
devices needed), then places the team on the devices there are (`place_team`);
`build_team_spec` does both. Every field is checked before anything is compiled or
written; a bad one raises `ConfigError` naming the field, the bad value and the fix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections

from flexmarl.core.errors import ConfigError
from flexmarl.data.sample_id import parse_sample_id
from flexmarl.models import source
from flexmarl.models.layout import PROMPT_WIDTH_MULTIPLE
from flexmarl.placement import plan as placement_lib
from flexmarl.placement import fit as placement_fit
from flexmarl.rollout import backends
from flexmarl.rollout.spec import RolloutSpec, rollout_config
from flexmarl.runtime import compile_cache
from flexmarl.runtime.workdir import config_values, flatten
from flexmarl.spec.agent import AgentSpec, agent_config
from flexmarl.spec.cluster import ClusterSpec, cluster_config
from flexmarl.spec.team import TeamSpec
from flexmarl.spec.validate import check_finite, fail, one_of, whole_number
from flexmarl.train import shared_base, sizing
from flexmarl.train.spec import TrainingSpec, training_config

ON_POLICY_SCHEDULES = ('sync', 'sync_parallel', 'flexmarl')  # staleness 0, same parameters
SCHEDULES = (*ON_POLICY_SCHEDULES, 'async:k')
# config.placement: 'fit' fits the team to the devices there are when they are too few
# for the layout asked for (see placement_fit.fit); 'strict' refuses instead.
PLACEMENT_POLICIES = ('fit', 'strict')

__all__ = ['ConfigError', 'AgentSpec', 'TeamSpec', 'RolloutSpec', 'TrainingSpec',
           'agent_config', 'rollout_config', 'training_config', 'cluster_config',
           'build_team_spec', 'team_spec', 'place_team', 'parse_schedule']


def parse_schedule(value: str) -> tuple[str, int]:
  """`config.schedule` → (schedule, max staleness): 'flexmarl' → ('flexmarl', 0),
  'async:2' → ('async', 2)."""
  if value in ON_POLICY_SCHEDULES:
    return value, 0
  name, _, k = str(value).partition(':')
  if name == 'async':
    if not k.isdigit() or int(k) < 1:
      fail('schedule', value, 'write async:k with a whole number k >= 1, the most versions '
           'a trained row may lag behind the parameters it updates (async:1, async:2, ...); '
           'for staleness 0 use flexmarl.')
    return 'async', int(k)
  fail('schedule', value, f'choose one of {list(SCHEDULES)}.')


def tokenizer_paths(config: ml_collections.ConfigDict) -> dict[str, str]:
  """Each agent's tokenizer: its own `agents.NAME.tokenizer`; else the one its
  `model.checkpoint` carries (a GGUF file's, an HF folder's tokenizer.json), so an agent of
  another model family speaks through its own; else the team's `config.tokenizer`."""
  def path(agent: ml_collections.ConfigDict) -> str:
    checkpoint = agent.get('model', {}).get('checkpoint', '')
    if agent.get('tokenizer'):
      return agent.tokenizer
    return checkpoint if checkpoint and source.carries_tokenizer(checkpoint) else config.tokenizer
  return {name: path(a) for name, a in config.agents.items()}


def default_values(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """Dotted field → the value it takes where a config leaves it out, for the sections
  every config has (each agent's, rollout, training, cluster): what a run saved before a
  field existed ran with (flexmarl.runtime.workdir.diff_configs)."""
  sections = {'rollout': rollout_config(), 'training': training_config(),
              'cluster': cluster_config(),
              **{f'agents.{name}': agent_config() for name in config.agents}}
  return {k: v for prefix, section in sections.items()
          for k, v in flatten(config_values(section), f'{prefix}.').items()}


def agent_spec(config: ml_collections.ConfigDict, name: str, vocab_size: int) -> AgentSpec:
  """One agent's checked spec from a whole experiment config (e.g. a run's saved one)."""
  if name not in config.agents:
    fail('agents', sorted(config.agents), f'has no agent {name!r}; name one of these.')
  return AgentSpec.from_config(name, config.agents[name], vocab_size,
                               shared_base.agent_seed(config.seed, list(config.agents).index(name)))


def _vocab(config: ml_collections.ConfigDict, vocab_size: int | Mapping[str, int]
           ) -> Mapping[str, int]:
  return (vocab_size if isinstance(vocab_size, Mapping)
          else dict.fromkeys(config.agents, vocab_size))


def _adapter_hosts(agents: Mapping[str, AgentSpec], groups: Sequence[Sequence[str]]
                   ) -> dict[str, str]:
  """Each agent of a `rollout.adapter_groups` group but its first, mapped to that first
  agent, whose instances serve the group. A group one instance cannot serve (not LoRA
  agents of one base, or unlike models, meshes, sampling or instances) is refused."""
  order = list(agents)
  seen: dict[str, int] = {}
  hosts = {}
  for i, group in enumerate(groups):
    f = f'rollout.adapter_groups[{i}]'
    unknown = [n for n in group if n not in agents]
    if unknown:
      fail(f, list(group), f'agents {unknown} are not in config.agents ({order}).')
    if len(group) < 2 or len(set(group)) != len(group):
      fail(f, list(group), 'give two or more distinct agents (an agent alone has its own '
           'instances already).')
    for n in group:
      if n in seen:
        fail(f, list(group), f'agent {n!r} is in group {seen[n]} too; list it in one group.')
      seen[n] = i
    members = list(group)  # the first is the host
    first = agents[members[0]]
    key = lambda n: agents[n].base_key
    for n in members:
      a = agents[n]
      if not a.model.lora.rank:
        fail(f'agents.{n}.model.lora.rank', 0, f'{f} serves LoRA adapters over one base; '
             f'give {n} a lora (rank > 0), or take it out of the group.')
    for n in members[1:]:
      a, why = agents[n], ''
      if a.model != first.model:
        why = f'model: {a.model} vs {first.model}'
      elif key(n) != key(members[0]):
        why = ('base: ' + ('the same model.checkpoint' if a.checkpoint or first.checkpoint
                           else 'the same model.base_seed (-1 draws each agent its own base)'))
      elif (a.mesh_shape, a.mesh_axes) != (first.mesh_shape, first.mesh_axes):
        why = f'mesh_shape: {a.mesh_shape} vs {first.mesh_shape}'
      elif a.sampling != first.sampling:
        why = f'sampling: {a.sampling} vs {first.sampling}'
      elif (a.instances, a.instance_devices) != (first.instances, first.instance_devices):
        why = 'rollout.instances and rollout.devices'
      if why:
        fail(f, list(group), f'one instance serves agents {members[0]!r} and {n!r} only if '
             f'they have the same {why}; make them alike, or put them in different groups.')
      hosts[n] = members[0]
  return hosts


def _check_pool_fits(training: TrainingSpec, agents: Mapping[str, AgentSpec]) -> None:
  """Each agent's mesh, and its state in the host budget, fit the training pool."""
  if not training.pool_devices:
    return
  sizing.check_pool(training.pool_devices, {n: a.layout for n, a in agents.items()})
  if training.host_budget_bytes:
    sizing.check_host_budget(training.host_budget_bytes, _state_bytes(agents),
                             'training.host_budget_gb', unit=1e9)


def _state_bytes(agents: Mapping[str, AgentSpec]) -> dict[str, int]:
  return {n: sizing.state_nbytes(a.model, a.optimizer, a.grpo) for n, a in agents.items()}


def build_team_spec(config: ml_collections.ConfigDict, vocab_size: int | Mapping[str, int],
                    device_ids: Sequence[int], workflow_agents: Sequence[str]) -> TeamSpec:
  """`team_spec`, then `place_team` on `device_ids`: the whole config checked and placed."""
  return place_team(team_spec(config, vocab_size, workflow_agents), device_ids)


def team_spec(config: ml_collections.ConfigDict, vocab_size: int | Mapping[str, int],
              workflow_agents: Sequence[str]) -> TeamSpec:
  """Check every field of the config, each section read once, and no device needed;
  raise ConfigError on the first bad field. `vocab_size`: the tokenizer's, or each
  agent's tokenizer's. The spec's placement is None until `place_team`."""
  check_finite(config)
  schedule, max_staleness = parse_schedule(config.schedule)
  whole_number('seed', config.seed, 0)
  whole_number('steps', config.steps, 1)
  if whole_number('max_prompt_len', config.max_prompt_len, 1) < 2:
    fail('max_prompt_len', config.max_prompt_len, 'must be >= 2 (BOS and one token).')
  if not config.agents:
    fail('agents', {}, 'define at least one agent (see flexmarl.config.agent_config).')
  for name in workflow_agents:
    if name not in config.agents:
      fail('workflow', name, f'the workflow calls agent {name!r}, which config.agents does '
           f'not define (defined: {sorted(config.agents)}); add it or rename it.')
  vocab = _vocab(config, vocab_size)
  agents = {n: AgentSpec.from_config(n, a, vocab[n], shared_base.agent_seed(config.seed, i))
            for i, (n, a) in enumerate(config.agents.items())}
  rollout = RolloutSpec.from_config(config.rollout)
  one_of('rollout.backend', rollout.backend, list(backends.REGISTRY))
  backend = backends.get(rollout.backend)
  if rollout.adapter_groups and not backend.serves_adapter_groups:
    fail('rollout.adapter_groups', [list(g) for g in rollout.adapter_groups],
         f'rollout.backend={rollout.backend!r} gives every agent instances of its own: set '
         'rollout.adapter_groups=[] or use a backend that shares them '
         f'{[n for n, b in backends.REGISTRY.items() if b.serves_adapter_groups]}.')
  _adapter_hosts(agents, rollout.adapter_groups)
  backend.check(rollout, agents, config.max_prompt_len)
  training = TrainingSpec.from_config(config.get('training'))
  _check_pool_fits(training, agents)
  policy = config.get('placement', 'fit')
  if policy not in PLACEMENT_POLICIES:
    fail('placement', policy, "choose 'fit' (fit the team to the devices there are) or "
         "'strict' (refuse a config that needs more devices than there are).")
  whole_number('checkpoint_every', config.checkpoint_every, 1)
  trace_steps = whole_number('trace_steps', config.get('trace_steps', TeamSpec.trace_steps), 0,
                             '0 keeps every step')
  keep = whole_number('store_keep_steps', config.get('store_keep_steps', 0), 0,
                      '0 keeps every row')
  if 0 < keep < config.checkpoint_every:
    fail('store_keep_steps', keep, f'give 0 (keep every row) or at least checkpoint_every='
         f'{config.checkpoint_every}: a resume from the previous checkpoint serves the rows '
         'of up to checkpoint_every steps again and finds them in the store.')
  cache_dir = config.get('compile_cache_dir', compile_cache.DEFAULT_DIR)
  if not isinstance(cache_dir, str):
    fail('compile_cache_dir', cache_dir, "give a folder for compiled steps (default "
         f"{compile_cache.DEFAULT_DIR!r}), or '' to compile every run afresh.")
  eval_every = whole_number('eval_every', config.get('eval_every', 0), 0, '0: no evaluation')
  width = whole_number('prompt_width_multiple',
                       config.get('prompt_width_multiple', PROMPT_WIDTH_MULTIPLE), 1)
  cluster = ClusterSpec.from_config(config.get('cluster'))
  if cluster.on_ray and rollout.adapter_groups:
    fail('rollout.adapter_groups', [list(g) for g in rollout.adapter_groups],
         'shared adapter instances run in one process only; under Ray every agent has '
         'instances of its own: set rollout.adapter_groups=[] or --config.cluster.backend=local.')
  return TeamSpec(seed=config.seed, steps=config.steps, schedule=schedule,
                  max_staleness=max_staleness, max_prompt_len=config.max_prompt_len,
                  tokenizer=config.tokenizer, agents=agents, rollout=rollout,
                  checkpoint_every=config.checkpoint_every, training=training,
                  trace_steps=trace_steps, store_keep_steps=keep, cluster=cluster,
                  compile_cache_dir=cache_dir, eval_every=eval_every, placement_policy=policy,
                  prompt_width_multiple=width)


def place_team(spec: TeamSpec, device_ids: Sequence[int]) -> TeamSpec:
  """The spec with its agents placed on `device_ids` (placement_fit.fit): fitted to fewer
  devices under the 'fit' policy, refused under 'strict'; a fitted spec's rollout and
  training fields say what runs."""
  agents, rollout, training = spec.agents, spec.rollout, spec.training
  hosts = _adapter_hosts(agents, rollout.adapter_groups)
  placement = placement_fit.fit(
      {n: placement_lib.AgentDemand(a.mesh_shape, a.instances, a.train_devices,
                                    a.instance_devices, hosts.get(n, ''))
       for n, a in agents.items()},
      rollout.devices, device_ids, training.pool_devices, list(training.mesh_shapes),
      strict=spec.placement_policy == 'strict', state_bytes=lambda: _state_bytes(agents))
  if placement.fitted:  # the spec says what runs: the fitted fields
    rollout = dataclasses.replace(rollout, devices=placement.mode)
    training = dataclasses.replace(training, pool_devices=placement.fitted.changes.get(
        'training.pool_devices', training.pool_devices))
  if spec.cluster.on_ray and placement.pool:
    fail('cluster.backend', 'ray', f'the placement has a training pool ({len(placement.pool)} '
         'meshes shared by the agents); under Ray every agent trains on a mesh of its own: give '
         'the run enough devices (config.cluster.devices), set config.training.pool_devices=0, '
         'or use --config.cluster.backend=local.')
  return dataclasses.replace(spec, rollout=rollout, training=training, placement=placement)


def check_prompt_lengths(requests: Sequence[tuple[str, str, Sequence[str]]], tokenizers,
                         max_prompt_len: int) -> None:
  """Every prompt of a dry run (agent, prompt, sample_ids) encodes, with the agent's
  tokenizer (`tokenizers`: one, or a mapping per agent), and fits `max_prompt_len`.

  Prompts that embed an earlier answer are measured with that answer empty, so they
  can be longer in the run: leave room for `max_new_tokens` there."""
  longest = (0, '', '')
  for agent, prompt, ids in requests:
    query = parse_sample_id(ids[0]).query_id if ids else '?'
    try:
      tokenizer = tokenizers[agent] if isinstance(tokenizers, Mapping) else tokenizers
      n = len(tokenizer.encode_prompt(prompt))
    except ValueError as e:
      raise ConfigError(f'query {query}, agent {agent!r}: {e}') from None
    longest = max(longest, (n, agent, prompt), key=lambda x: x[0])
  n, agent, prompt = longest
  if n > max_prompt_len:
    fail('max_prompt_len', max_prompt_len,
         f'agent {agent!r} is asked {prompt!r}, {n} tokens with BOS; set max_prompt_len >= {n} '
         '(more if prompts embed earlier answers).')
