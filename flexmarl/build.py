"""Wiring: a checked TeamSpec and its Placement → agents → rollout engine → schedule →
the JointOrchestrator that runs them.

`build_team` makes the agents from `Factories`: how a trainer, a sampler, a checkpointer
and a training pool are made. The real run passes `local_factories` (trainers on JAX
meshes of this process, the samplers of the run's rollout backend, Orbax checkpoints);
the simulator passes simulated ones; a remote backend passes factories whose parts live
in other processes. Everything past the factories is the same code for all of them.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh

from flexmarl.agent import Agent
from flexmarl.config import AgentSpec, TeamSpec
from flexmarl.core.clock import Clock
from flexmarl.core.interfaces import Checkpointer, Trainer, Weights
from flexmarl.data.journal import Journal
from flexmarl.metrics import spans
from flexmarl.metrics.timeline import Timeline
from flexmarl.models import hf, peft, sharding, transformer
from flexmarl.models.tokenizer import TextTokenizer, per_agent
from flexmarl.models.transformer import ModelConfig
from flexmarl.orchestrator import JointOrchestrator
from flexmarl.placement import plan as placement_lib
from flexmarl.rollout import backends
from flexmarl.rollout.backends import MakeSampler, MakeShared
from flexmarl.rollout.balancer import Balancer, Limits
from flexmarl.rollout.engine import RolloutEngine
from flexmarl.rollout.pool import Instance, InstancePool, Retarget
from flexmarl.rollout.sampler import Sampler
from flexmarl.schedules import Schedule, make_schedule
from flexmarl.store.experience_store import ExperienceStore
from flexmarl.train import shared_base
from flexmarl.train.checkpoint import AgentCheckpointer
from flexmarl.train.engine import TrainingEngine
from flexmarl.train.step import StepCache
from flexmarl.train.trainer import AgentTrainer

@dataclasses.dataclass(frozen=True)
class Factories:
  """How the parts of a team are made.

  trainer(name, spec, mesh): the agent's trainer on `mesh` (its training
    devices), or, for a training pool (mesh None), with its state in host memory.
  sampler(name, spec, trainer): the agent's `MakeSampler`.
  checkpointer(name): where the agent's checkpoints go.
  training_pool(trainers, meshes): the engine that binds trainers to the pool's meshes
    (None: the backend runs no training pool).
  timeline(name): the span track of the agent's training devices (None: none).
  shared_sampler(names, trainers): the `MakeShared` of a `rollout.adapter_groups` group
    (None: the backend gives every agent instances of its own).
  retarget(name, spec): how the agent takes over another agent's rollout instance in
    place (None: a new sampler is made for it).
  """

  trainer: Callable[[str, AgentSpec, int, placement_lib.MeshPlacement | None], Trainer]
  sampler: Callable[[str, AgentSpec, Trainer], MakeSampler]
  checkpointer: Callable[[str], Checkpointer]
  training_pool: Callable[[Mapping[str, Trainer], Sequence[placement_lib.MeshPlacement]],
                          TrainingEngine] | None = None
  timeline: Callable[[str], Timeline | None] = lambda name: None
  shared_sampler: Callable[[Sequence[str], Mapping[str, Trainer]], MakeShared] | None = None
  retarget: Callable[[str, AgentSpec], Retarget | None] = lambda name, spec: None


def build_team(spec: TeamSpec, placement: placement_lib.Placement, factories: Factories,
               pad_ids: Mapping[str, int], clock: Clock,
               recorder: spans.SpanRecorder | None = None) -> dict[str, Agent]:
  """Every agent of `spec` on what `placement` gives it: a trainer (on its mesh, or
  taking turns on the training pool), its rollout instances serving version 0, a
  checkpointer. `pad_ids`: each agent's tokenizer's pad id."""
  if placement.pool and factories.training_pool is None:
    raise ValueError(f'the placement has a training pool of {len(placement.pool)} meshes, but '
                     'these factories have no training_pool factory (this backend runs every '
                     'agent on a mesh of its own): give each agent its own mesh '
                     '(config.training.pool_devices=0) or use a backend with a training pool.')
  trainers = {name: factories.trainer(name, a, None if placement.pool
                                      else placement.train[name])
              for name, a in spec.agents.items()}
  if placement.adapter_groups and factories.shared_sampler is None:
    raise ValueError(f'the placement shares instances between adapters '
                     f'{[list(g) for g in placement.adapter_groups]}, but this backend gives '
                     'every agent instances of its own: set config.rollout.adapter_groups=[].')
  engine = factories.training_pool(trainers, placement.pool) if placement.pool else None
  shared = {}  # each group's instances, made with its first agent
  for group in placement.adapter_groups:
    make_shared = factories.shared_sampler(group, {n: trainers[n] for n in group})
    weights = {n: Weights(trainers[n].params, 0) for n in group}
    shared[group] = [Instance(f'{"+".join(group)}/{j}', m.devices,
                              make_shared(m.devices, weights))
                     for j, m in enumerate(placement.rollout[group[0]])]
  agents = {}
  for name, a in spec.agents.items():
    make = factories.sampler(name, a, trainers[name])
    weights = Weights(trainers[name].params, 0)
    group = placement.group_of(name)
    instances = (list(shared[group]) if group else
                 [Instance(f'{name}/{j}', m.devices, make(m.devices, weights))
                  for j, m in enumerate(placement.rollout[name])])
    pool = InstancePool(name, instances, make, weights,
                        sticky=spec.rollout.sticky_conversations,
                        retarget=factories.retarget(name, a))
    agents[name] = Agent(a, trainers[name], pool, factories.checkpointer(name),
                         prompt_len=spec.max_prompt_len,
                         prompt_width_multiple=spec.prompt_width_multiple,
                         pad_id=pad_ids[name], clock=clock,
                         recorder=recorder, timeline=factories.timeline(name),
                         training_engine=engine)
  return agents


def agent_trainer(name: str, a: AgentSpec, where: Mesh | sharding.MeshLayout,
                  banned_ids: tuple[int, ...], steps: StepCache | None = None,
                  team_bases: dict | None = None) -> AgentTrainer:
  """An agent's trainer on mesh `where` (or, given a layout, with its state in host
  memory: a training pool's), started from `a.checkpoint` or a random init from
  `seed`; a LoRA agent's adapters over the base it shares with the agents of
  `team_bases` (this process's). The one recipe of a trainer, in this process or in a
  remote trainer group."""
  if a.model.lora.rank:  # adapters over the base shared by the agents of that base
    base = shared_base.shared({} if team_bases is None else team_bases, a.model, a.checkpoint,
                        a.random_base_seed)
    return AgentTrainer(name, a.model, a.optimizer, a.grpo, where, seed=a.seed, steps=steps,
                        init_params=peft.load_peft(a.adapter, a.model) if a.adapter else None,
                        banned_ids=banned_ids, base=base)
  init = None
  if a.checkpoint and isinstance(where, Mesh):  # read tensor by tensor straight onto the mesh
    init = hf.load_params(a.checkpoint, a.model,
                          sharding.param_shardings(transformer.abstract_model(a.model)[1], where))
  elif a.checkpoint:
    host = jax.sharding.SingleDeviceSharding(jax.devices('cpu')[0])
    init = jax.device_get(hf.load_params(a.checkpoint, a.model, jax.tree.map(
        lambda _: host, nnx.to_pure_dict(transformer.abstract_model(a.model)[1]))))
  return AgentTrainer(name, a.model, a.optimizer, a.grpo, where, seed=a.seed, steps=steps,
                      init_params=init, banned_ids=banned_ids)


def retarget_in_place(model: ModelConfig, tokenizer: TextTokenizer) -> Retarget:
  """How an agent of `model` takes over another agent's instance: in place when its
  sampler can (`Sampler.serve`: a vLLM engine of the same architecture, one weight
  sync), else a new sampler is made for it."""
  def retarget(sampler: Sampler, weights: Weights) -> bool:
    return sampler.serve(model, weights.params, weights.version, eos_id=tokenizer.stop_ids,
                         pad_id=tokenizer.pad_id, banned_ids=tokenizer.banned_ids)
  return retarget


def local_factories(spec: TeamSpec, tokenizers: Mapping[str, TextTokenizer], workdir: str,
                    devices: Sequence[jax.Device], recorder: spans.SpanRecorder) -> Factories:
  """The parts of a run in this process: trainers on JAX meshes of `devices` (sharing one
  `StepCache`), the samplers of `rollout.backend` (flexmarl.rollout.backends), Orbax
  checkpoints under `workdir`."""
  by_id = {d.id: d for d in devices}
  steps, team_bases = StepCache(), {}
  backend = backends.get(spec.rollout.backend)
  local = backends.Local(spec, tokenizers, workdir, by_id)

  def trainer(name: str, a: AgentSpec,
              mesh: placement_lib.MeshPlacement | None) -> AgentTrainer:
    where = a.layout if mesh is None else sharding.make_mesh(  # None: a pool trainer
        [by_id[d] for d in mesh.devices], a.mesh_shape, a.mesh_axes)
    return agent_trainer(name, a, where, tokenizers[name].banned_ids, steps, team_bases)

  def training_pool(trainers: Mapping[str, AgentTrainer],
                    meshes: Sequence[placement_lib.MeshPlacement]) -> TrainingEngine:
    return TrainingEngine(
        trainers, [(f'pool{i}', [by_id[d] for d in m.devices], m.shape)
                   for i, m in enumerate(meshes)],
        spec.training.host_budget_bytes,
        spec.training.storage_dir or os.path.join(workdir, 'swap'), recorder=recorder,
        clock=recorder.clock, states_per_mesh=spec.training.states_per_mesh)

  return Factories(trainer, lambda name, a, t: backend.sampler(local, name, t),
                   lambda name: AgentCheckpointer(workdir, name), training_pool,
                   lambda name: Timeline(recorder, f'train:{name}'),
                   (functools.partial(backend.shared_sampler, local)
                    if backend.serves_adapter_groups else None),
                   lambda name, a: retarget_in_place(a.model, tokenizers[name]))


def balance_group(spec: TeamSpec, a: AgentSpec) -> tuple:
  """The agents an instance of `a` may move between: those of one mesh shape and what
  the backend asks besides (`Backend.balance_key`: under vLLM, one architecture)."""
  return a.mesh_shape + backends.get(spec.rollout.backend).balance_key(a.model)


def rollout_engine(spec: TeamSpec, agents: Mapping[str, Agent],
                   tokenizers: Mapping[str, TextTokenizer], clock: Clock,
                   recorder: spans.SpanRecorder | None) -> RolloutEngine:
  """The team's rollout engine over the agents' instance pools, with the balancer when
  it is on (instances in this process only: moving a Ray worker would restart it).
  Instances move between agents of one mesh shape, and under vLLM of one architecture
  too: such a move is a weight sync into the running engine. Agents that share
  instances keep theirs: the balancer neither takes one from them nor gives them one."""
  r = spec.rollout

  def limits(n: str, a: AgentSpec) -> Limits:
    if spec.placement.group_of(n):  # pinned
      return Limits(a.instances, a.instances, balance_group(spec, a))
    return Limits(a.min_instances, a.max_instances, balance_group(spec, a))
  balancer = (Balancer({n: limits(n, a) for n, a in spec.agents.items()},
                       r.balance_threshold, r.balance_cooldown_s)
              if r.balance and not spec.cluster.on_ray else None)
  return RolloutEngine(
      {n: a.pool for n, a in agents.items()},
      {n: a.sampling for n, a in spec.agents.items()},
      {n: a.group_size for n, a in spec.agents.items()}, tokenizers, spec.seed,
      clock=clock, concurrency=r.query_concurrency,
      max_batch=r.max_batch, balancer=balancer, query_timeout_s=r.query_timeout_s,
      recorder=recorder, max_prompt_len=spec.max_prompt_len,
      context_overflow=r.context_overflow)


def build_orchestrator(spec: TeamSpec, workflow, tokenizer: TextTokenizer | Mapping[str, TextTokenizer],
                       workdir: str, *, clock: Clock,
                       factories: Callable[[spans.SpanRecorder], Factories] | None = None,
                       devices: Sequence[jax.Device] | None = None,
                       schedule: Schedule | None = None) -> JointOrchestrator:
  """The run over `workdir`: the placement checked against the workdir's and saved, the
  team made by `factories` (given the run's span recorder; default: `local_factories`
  on `devices`), its rollout engine, the experience store and the schedule."""
  tokenizers = per_agent(tokenizer, spec.agents)
  # Every generate call, micro-batch, optimizer step, weight sync and store write, as
  # a span: `WORKDIR/trace.json` (Perfetto) and utilization in the metrics.
  recorder = spans.SpanRecorder(clock)
  placement_lib.check_resume(spec.placement, workdir)
  placement_lib.save(spec.placement, workdir)
  if factories is None:
    made = local_factories(spec, tokenizers, workdir, devices or jax.devices(), recorder)
  else:
    made = factories(recorder)
  agents = build_team(spec, spec.placement, made, {n: t.pad_id for n, t in tokenizers.items()},
                      clock, recorder)
  journal = Journal(ExperienceStore.open(os.path.join(workdir, 'store'), agents=list(spec.agents)),
                    list(spec.agents), recorder)
  return JointOrchestrator(spec, workflow, agents, rollout_engine(spec, agents, tokenizers,
                                                                  clock, recorder),
                           journal, schedule or make_schedule(spec), workdir, clock, recorder)
