"""A simulated team: a paper setup (experiments/sim/*.py) → a TeamSpec, a placement and
`team.Agent`s whose trainers and rollout instances are simulated, so the real
`JointOrchestrator`, schedules, rollout engine, balancer and batch builders run in
simulated time.

Placement of a setup: each agent's training mesh takes `train_devices` consecutive
devices of the training pool (`cluster.train_nodes`); the rollout pool
(`cluster.rollout_nodes`) is split evenly by devices between the agents, each instance
`rollout_tp` devices. The balancer moves instances only between agents of the same
`rollout_tp` (it is the instance shape the spec's `mesh_shape` carries here; a
simulated trainer's speed comes from `train_devices`).

Costs come from the agent's `model` (flexmarl.sim.specs) on `cluster.accelerator` (at
`train_mfu`, default costs.TRAIN_MFU), or,
to calibrate against a measured machine, from explicit `rates`: {decode_step_s,
decode_token_s, prefill_token_s, train_token_s, optimizer_s, sync_s} and optionally
{call_s, micro_batch_s} (per generate call, per micro-batch; see
experiments/benchmarks/calibrate.py). An agent may give its own `global_batch` and
`micro_batch` (rows); else the setup's apply. `padded_batches` (setup, default False)
charges the padded shapes the embedded JAX sampler and trainer compute (see
SimSampler.padded_rows, SimTrainer.padded): set it to model this framework's own
backends, leave it off for engines that skip padding. `shared_cores` (setup, default 0:
devices independent) lets at most that many device operations run at once, for devices
that share a host's cores (flexmarl/sim/cores.py).
"""

from __future__ import annotations

import dataclasses
import inspect

import ml_collections

from flexmarl import placement as placement_lib
from flexmarl.clock import SimClock
from flexmarl.config import TeamSpec, agent_config, build_team_spec, rollout_config
from flexmarl.errors import ConfigError
from flexmarl.rollout.pool import Instance, InstancePool
from flexmarl.rollout.sampler import EmbeddedSampler
from flexmarl.sim import costs, specs
from flexmarl.sim.cores import SharedCores
from flexmarl.sim.instances import SimSampler
from flexmarl.sim.trainer import SimTrainer
from flexmarl.sim.workflow import RouterWorkflow
from flexmarl.team import Agent
from flexmarl.tokenizer import TextTokenizer

RATE_FIELDS = ('decode_step_s', 'decode_token_s', 'prefill_token_s', 'train_token_s',
               'optimizer_s', 'sync_s')
OPTIONAL_RATE_FIELDS = ('call_s', 'micro_batch_s')
# The fewest rows an embedded generate call computes (EmbeddedSampler's `min_batch`).
EMBEDDED_MIN_BATCH = inspect.signature(EmbeddedSampler).parameters['min_batch'].default


@dataclasses.dataclass(frozen=True)
class AgentCosts:
  decode: costs.DecodeRates
  train_token_s: float
  optimizer_s: float
  sync_s: float  # a weight update of one instance
  micro_batch_s: float = 0.0


def agent_costs(a: ml_collections.ConfigDict, accelerator: str,
                train_mfu: float = costs.TRAIN_MFU) -> AgentCosts:
  """An agent's rates: explicit `rates`, else from its model on the named accelerator."""
  rates = a.get('rates')
  if rates:
    missing = [f for f in RATE_FIELDS if f not in rates]
    if missing:
      raise ConfigError(f'config.agents.*.rates={dict(rates)} lacks {missing}; give all of '
                        f'{list(RATE_FIELDS)} (seconds), or drop rates to use the model.')
    stray = sorted(set(rates) - set(RATE_FIELDS) - set(OPTIONAL_RATE_FIELDS))
    if stray:
      raise ConfigError(f'config.agents.*.rates names unknown fields {stray}; known: '
                        f'{list(RATE_FIELDS + OPTIONAL_RATE_FIELDS)}.')
    return AgentCosts(costs.DecodeRates(rates.decode_step_s, rates.decode_token_s,
                                        rates.prefill_token_s, rates.get('call_s', 0.0)),
                      rates.train_token_s, rates.optimizer_s, rates.sync_s,
                      rates.get('micro_batch_s', 0.0))
  m, accel = specs.model(a.model), specs.accelerator(accelerator)
  return AgentCosts(costs.decode_rates(m, accel, a.rollout_tp),
                    costs.train_time(m, 1, a.train_devices, accel, train_mfu),
                    costs.optimizer_time(m, a.train_devices, accel),
                    costs.weight_sync_time(m, a.rollout_tp, accel))


def sim_placement(setup: ml_collections.ConfigDict) -> placement_lib.Placement:
  """Training meshes from the training pool, instances from an even split of the rollout
  pool (or `instances` per agent where the setup gives it)."""
  c, agents = setup.cluster, setup.agents
  train_ids = iter(range(c.train_nodes * c.devices_per_node))
  first_rollout = c.train_nodes * c.devices_per_node
  rollout_devices = c.rollout_nodes * c.devices_per_node
  if c.train_nodes + c.rollout_nodes > c.nodes:
    raise ConfigError(f'config.cluster: train_nodes={c.train_nodes} + rollout_nodes='
                      f'{c.rollout_nodes} exceed nodes={c.nodes}; shrink one of the pools.')
  share = rollout_devices // len(agents)
  train, rollout, next_rollout = {}, {}, first_rollout
  for name, a in agents.items():
    devs = tuple(next(train_ids, None) for _ in range(a.train_devices))
    if None in devs:
      raise ConfigError(f'config.agents.{name}.train_devices={a.train_devices}: the training '
                        f'pool ({c.train_nodes} nodes) is used up; add train_nodes or shrink '
                        'the meshes.')
    train[name] = placement_lib.MeshPlacement(devs, (1, a.train_devices))
    count = a.get('instances') or share // a.rollout_tp
    if count < 1 or next_rollout + count * a.rollout_tp > first_rollout + rollout_devices:
      raise ConfigError(f'config.agents.{name}: {count} rollout instances of {a.rollout_tp} '
                        f'devices do not fit the rollout pool ({rollout_devices} devices); '
                        'add rollout_nodes or lower instances / rollout_tp.')
    insts = []
    for _ in range(count):
      insts.append(placement_lib.MeshPlacement(
          tuple(range(next_rollout, next_rollout + a.rollout_tp)), (1, a.rollout_tp)))
      next_rollout += a.rollout_tp
    rollout[name] = tuple(insts)
  placement = placement_lib.Placement('separate', train, rollout)
  placement_lib.check(placement)
  return placement


def sim_workflow(setup: ml_collections.ConfigDict) -> RouterWorkflow:
  w = setup.workflow
  return RouterWorkflow(w.router, list(w.specialists), w.zipf,
                        setup.agents[w.router].prompt_tokens.to_dict(), w.get('mix'))


def sim_team_spec(setup: ml_collections.ConfigDict, schedule: str, balance: bool,
                  tokenizer: TextTokenizer) -> TeamSpec:
  """The TeamSpec the real orchestrator reads, for one schedule of a setup."""
  placement = sim_placement(setup)
  prompt_max = max(a.prompt_tokens['max'] for a in setup.agents.values())
  response_max = max(a.response_tokens['max'] for a in setup.agents.values())
  cfg = ml_collections.ConfigDict(dict(
      seed=setup.seed, steps=setup.steps, schedule=schedule, tokenizer='char',
      # The longest specialist prompt: BOS, the query and the router's answer.
      max_prompt_len=1 + prompt_max + response_max, checkpoint_every=setup.steps,
      rollout=rollout_config(
          devices='shared', query_concurrency=setup.get('query_concurrency')
          or setup.query_parallelism, max_step_queries=setup.get('max_step_queries', 100000),
          balance=balance, balance_threshold=float(setup.balance_threshold)),
      agents={name: agent_config(
          'tiny', group_size=a.group_size, global_batch=a.get('global_batch') or setup.global_batch,
          micro_batch=a.get('micro_batch') or setup.micro_batch, mesh_shape=(1, a.rollout_tp),
          sampling=dict(temperature=1.0, top_p=1.0, max_new_tokens=int(a.response_tokens['max'])),
          rollout=dict(instances=len(placement.rollout[name]),
                       min_instances=a.min_instances, max_instances=0, devices=()))
          for name, a in setup.agents.items()}))
  # The checks of the real config; the placement is the simulated cluster's.
  spec = build_team_spec(cfg, tokenizer.vocab_size,
                         range(sum(a.rollout_tp for a in setup.agents.values())),
                         sim_workflow(setup).agent_names())
  return dataclasses.replace(spec, placement=placement)


class NoCheckpoints:
  """The simulator keeps no checkpoints (it measures time; no state is real)."""

  def steps(self) -> list[int]:
    return []

  def wait(self) -> None:
    pass


def build_sim_team(spec: TeamSpec, setup: ml_collections.ConfigDict, clock: SimClock,
                   tokenizer: TextTokenizer, recorder=None) -> dict[str, Agent]:
  """`team.Agent`s of simulated trainers and instances, placed as `spec.placement` says.

  recorder: anything with SpanRecorder's `add`; tracks are 'train/AGENT' and
  'rollout/FIRST_DEVICE' (an instance keeps its track when it moves to another agent).
  """
  agents = {}
  padded = bool(setup.get('padded_batches', False))
  cores = SharedCores(setup.shared_cores) if setup.get('shared_cores') else None
  for name, a in spec.agents.items():
    s = setup.agents[name]
    c = agent_costs(s, setup.cluster.accelerator, setup.get('train_mfu', costs.TRAIN_MFU))

    def new(devices, version, name=name, s=s, c=c) -> SimSampler:
      return SimSampler(clock, c.decode, s.response_tokens.to_dict(), c.sync_s, agent=name,
                        vocab=tokenizer.vocab_size, version=version, recorder=recorder,
                        track=f'rollout/{devices[0]}' if recorder is not None else '',
                        padded_rows=EMBEDDED_MIN_BATCH if padded else 0, cores=cores)

    def make(devices, params, version, new=new) -> SimSampler:
      sampler = new(devices, version)
      sampler.update_weights(params, version)  # an adopted instance loads the agent's weights
      return sampler

    trainer = SimTrainer(name, clock, c.train_token_s, c.optimizer_s,
                         micro_batch_s=c.micro_batch_s, padded=padded, cores=cores,
                         recorder=recorder, track=f'train/{name}')
    instances = [Instance(f'{name}/{j}', m.devices, new(m.devices, 0))
                 for j, m in enumerate(spec.placement.rollout[name])]
    pool = InstancePool(name, instances, make, sticky=spec.rollout.sticky_conversations)
    pool.params = trainer.params
    agents[name] = Agent(a, trainer, pool, NoCheckpoints(), prompt_len=spec.max_prompt_len,
                         pad_id=tokenizer.pad_id, clock=clock)
  return agents
