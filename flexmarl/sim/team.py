"""A simulated team: a paper setup (experiments/sim/*.py) → a TeamSpec, a placement and
`agent.Agent`s whose trainers and rollout instances are simulated, so the real
`JointOrchestrator`, schedules, rollout engine, balancer and batch builders run in
simulated time.

Placements of a setup: `sim.placement`.
The balancer moves instances only between agents of the same `rollout_tp` (it is the
instance shape the spec's `mesh_shape` carries here).

Costs come from the agent's `model` (flexmarl.sim.specs) on `cluster.accelerator` (at
`train_mfu`, default costs.TRAIN_MFU, times `train_recompute`, default 1: the training
FLOPs over the 6N per token of forward and backward), or, to calibrate against a
measured machine, from explicit `rates`: {decode_step_s, decode_token_s,
prefill_token_s, train_token_s, optimizer_s, sync_s} and optionally {call_s,
micro_batch_s} (per generate call, per micro-batch; see
experiments/benchmarks/calibrate.py) and {load_s, offload_s} (a colocated trainer's phase
changes), with `state_bytes` (what a swap moves) for a training pool. An agent may give
its own `global_batch` and `micro_batch` (rows); else the setup's apply. `padded_batches` (setup, default False)
charges the padded shapes the embedded JAX sampler and trainer compute (see
SimSampler.padded_rows, SimTrainer.padded): set it to model this framework's own
backends, leave it off for engines that skip padding. `shared_cores` (setup, default 0:
devices independent) lets at most that many device operations run at once, for devices
that share a host's cores (flexmarl/sim/cores.py). `train_devices_per_row` (setup,
default 0: no limit): the most devices one row of a micro-batch keeps busy in training
(data parallelism over rows; a trainer on more devices than micro-batch rows x this
runs no faster). `decode_step_overhead_s` (setup, default 0): latency of a decode step
beyond reading the weights (costs.decode_rates). `links` (setup): the bandwidths of
a device's link to host memory and of storage (`host_bytes_per_s_per_device`,
`storage_bytes_per_s`), for swaps and colocated phase changes; `overlapped_swaps`
(setup, default False: swaps block the orchestrator, as this framework's do) lets
swaps overlap everything but the mesh's own work (sim.trainer); `compile_s` (setup):
{train, rollout} seconds of a first call per model and mesh shape.
"""

from __future__ import annotations

import dataclasses
import inspect

import ml_collections

from flexmarl.build import Factories
from flexmarl.config import TeamSpec, agent_config, build_team_spec, rollout_config
from flexmarl.core.clock import SimClock
from flexmarl.core.errors import ConfigError
from flexmarl.models import sharding
from flexmarl.models.tokenizer import TextTokenizer
from flexmarl.placement import plan as placement_lib
from flexmarl.rollout.sampler import EmbeddedSampler
from flexmarl.sim import costs, specs
from flexmarl.sim.cores import SharedCores
from flexmarl.sim.devices import CompileCache, DeviceGroup
from flexmarl.sim.instances import SimSampler
from flexmarl.sim.placement import pool_meshes, sim_placement, train_tracks
from flexmarl.sim.trainer import Link, SimMesh, SimTrainer
from flexmarl.sim.workflow import RouterWorkflow
from flexmarl.train.engine import TrainingEngine
from flexmarl.train.pool_meshes import inline

RATE_FIELDS = ('decode_step_s', 'decode_token_s', 'prefill_token_s', 'train_token_s',
               'optimizer_s', 'sync_s')
OPTIONAL_RATE_FIELDS = ('call_s', 'micro_batch_s', 'load_s', 'offload_s')
# The fewest rows an embedded generate call computes (EmbeddedSampler's `min_batch`).
EMBEDDED_MIN_BATCH = inspect.signature(EmbeddedSampler).parameters['min_batch'].default


@dataclasses.dataclass(frozen=True)
class AgentCosts:
  decode: costs.DecodeRates
  train_token_s: float
  optimizer_s: float
  sync_s: float  # a weight update of one instance
  micro_batch_s: float = 0.0


def agent_costs(a: ml_collections.ConfigDict, accelerator: str, train_devices: int,
                train_mfu: float = costs.TRAIN_MFU, train_recompute: float = 1.0,
                decode_step_overhead_s: float = 0.0) -> AgentCosts:
  """An agent's rates: explicit `rates`, else from its model on the named accelerator,
  training on a mesh of `train_devices`."""
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
  if train_recompute < 1:
    raise ConfigError(f'config.train_recompute={train_recompute}: it multiplies the 6N '
                      'FLOPs per token of forward and backward, so it is at least 1.')
  m, accel = specs.model(a.model), specs.accelerator(accelerator)
  return AgentCosts(costs.decode_rates(m, accel, a.rollout_tp, decode_step_overhead_s),
                    train_recompute * costs.train_time(m, 1, train_devices, accel, train_mfu),
                    costs.optimizer_time(m, train_devices, accel),
                    costs.weight_sync_time(m, a.rollout_tp, accel))


def host_link(setup: ml_collections.ConfigDict) -> float:
  """Bytes/s one device moves to or from host memory (`links`, default costs')."""
  return setup.get('links', {}).get('host_bytes_per_s_per_device',
                                    costs.HOST_BYTES_PER_S_PER_DEVICE)


def colocated_costs(model: specs.ModelSpec, devices: int, tp: int, host_bytes_per_s: float
                    ) -> tuple[float, float, float]:
  """A colocated agent's phase changes over its `devices`, each moving bytes over every
  device's host link at once: (load, offload, instance reload) seconds. Load: offload
  the instances' bf16 weights and load the train state; offload: the train state back
  to host; reload: an instance of `tp` devices takes its (new) weights back from host."""
  state, weights = costs.train_state_bytes(model), costs.param_bytes(model)
  return (costs.transfer_time(weights + state, devices * host_bytes_per_s),
          costs.transfer_time(state, devices * host_bytes_per_s),
          costs.transfer_time(weights, tp * host_bytes_per_s))


def sim_workflow(setup: ml_collections.ConfigDict) -> RouterWorkflow:
  w = setup.workflow
  return RouterWorkflow(w.router, list(w.specialists), w.zipf,
                        setup.agents[w.router].prompt_tokens.to_dict(), w.get('mix'))


def sim_team_spec(setup: ml_collections.ConfigDict, schedule: str, balance: bool,
                  tokenizer: TextTokenizer, colocated: bool = False,
                  whole_batches: bool = False) -> TeamSpec:
  """The TeamSpec the real orchestrator reads, for one schedule of a setup.
  whole_batches: every agent's micro-batch is its global batch, so that under a
  pipelined schedule its trainer starts only once its whole batch is there (the
  paper's ablation without the micro-batch pipeline)."""
  placement = sim_placement(setup, colocated)
  global_batch = {name: a.get('global_batch') or setup.global_batch
                  for name, a in setup.agents.items()}
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
          'tiny', group_size=a.group_size, global_batch=global_batch[name],
          micro_batch=(global_batch[name] if whole_batches
                       else a.get('micro_batch') or setup.micro_batch),
          mesh_shape=(1, a.rollout_tp),
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

  directory = ''

  def steps(self) -> list[int]:
    return []

  def wait(self) -> None:
    pass


def storage_link(setup: ml_collections.ConfigDict, clock: SimClock, recorder=None
                 ) -> Link | None:
  """The link that writes released states to storage (track 'link/storage'), or None
  when the setup gives no storage bandwidth; then nothing may go to storage."""
  rate = setup.get('links', {}).get('storage_bytes_per_s', 0.0)
  if setup.get('host_budget_bytes') and not rate > 0:
    raise ConfigError(f'config.host_budget_bytes={setup.host_budget_bytes} sends states to '
                      f'storage, but config.links.storage_bytes_per_s={rate}; give it > 0 '
                      '(bytes/s), or drop the host budget.')
  return Link(DeviceGroup(clock, 'link/storage', recorder=recorder), rate) if rate > 0 else None


def build_pool_engine(placement: placement_lib.Placement, setup: ml_collections.ConfigDict,
                      clock: SimClock, trainers: dict[str, SimTrainer],
                      groups: dict[str, DeviceGroup], recorder=None) -> TrainingEngine:
  """The real training engine over the simulated pool: each mesh its compute group
  ('train/MESH') and its host link ('link/MESH', the host bandwidth of a device times
  the mesh's devices). Storage paths only name where a state went: nothing is written."""
  host = host_link(setup)
  meshes = {m.name: SimMesh(groups[f'train/{m.name}'],
                            Link(DeviceGroup(clock, f'link/{m.name}', recorder=recorder),
                                 len(m.devices) * host))
            for m in pool_meshes(placement)}
  return TrainingEngine(trainers, pool_meshes(placement),
                        int(setup.get('host_budget_bytes', 0)), storage_dir='storage',
                        recorder=recorder, clock=clock,
                        make_mesh=lambda mesh, layout: meshes[mesh.name], make_executor=inline)


def sim_factories(spec: TeamSpec, setup: ml_collections.ConfigDict, clock: SimClock,
                  tokenizer: TextTokenizer, recorder=None) -> Factories:
  """The simulated parts of a team, for `flexmarl.build.build_team`: trainers and
  instances that take simulated time, placed as `spec.placement` says (colocated when
  its mode is 'shared'; a training pool when it has one); no checkpoints.

  recorder: anything with SpanRecorder's `add`; tracks are `train_tracks` and
  'rollout/FIRST_DEVICE' (an instance keeps its track when it moves to another agent).
  """
  placement = spec.placement
  colocated = placement.mode == 'shared'
  padded = bool(setup.get('padded_batches', False))
  cores = SharedCores(setup.shared_cores) if setup.get('shared_cores') else None
  compile_s = setup.get('compile_s', {})
  train_compiled = CompileCache(compile_s.get('train', 0.0))
  rollout_compiled = CompileCache(compile_s.get('rollout', 0.0))
  host = host_link(setup)
  groups = {t: DeviceGroup(clock, t, cores, recorder) for t in train_tracks(placement)}
  storage = storage_link(setup, clock, recorder) if placement.pool else None
  served: set[tuple[int, ...]] = set()  # devices that have held an instance

  def agent_rates(name: str) -> tuple[AgentCosts, float, float, float, int]:
    """The agent's costs, its trainer's load and offload seconds (colocated), its
    instances' weight-sync seconds, and its training devices."""
    s = setup.agents[name]
    devices = placement.train[name].shape[-1]
    if setup.get('train_devices_per_row'):  # data parallel over a micro-batch's rows
      devices = min(devices, spec.agents[name].micro_batch * setup.train_devices_per_row)
    c = agent_costs(s, setup.cluster.accelerator, devices, setup.get('train_mfu', costs.TRAIN_MFU),
                    setup.get('train_recompute', 1.0), setup.get('decode_step_overhead_s', 0.0))
    load_s = offload_s = 0.0
    sync_s = c.sync_s
    if colocated and s.get('rates'):
      load_s, offload_s = s.rates.get('load_s', 0.0), s.rates.get('offload_s', 0.0)
    elif colocated:
      load_s, offload_s, sync_s = colocated_costs(specs.model(s.model), devices, s.rollout_tp,
                                                  host)
    return c, load_s, offload_s, sync_s, devices

  def trainer(name, a, mesh) -> SimTrainer:
    s = setup.agents[name]
    c, load_s, offload_s, _, devices = agent_rates(name)
    group = groups[f'train/{name}'] if mesh is not None else None
    state = s.get('state_bytes') or (costs.train_state_bytes(specs.model(s.model))
                                     if placement.pool else 0)
    return SimTrainer(name, clock, c.train_token_s, c.optimizer_s, group=group,
                      micro_batch_s=c.micro_batch_s, padded=padded, load_s=load_s,
                      offload_s=offload_s, compile=(train_compiled, (s.get('model'), devices)),
                      layout=sharding.layout(placement.train[name].shape),
                      state_bytes=state, storage=storage,
                      overlapped_swaps=bool(setup.get('overlapped_swaps', False)))

  def sampler(name, a, trainer):
    s = setup.agents[name]
    c, _, _, sync_s, _ = agent_rates(name)

    def make(devices, weights) -> SimSampler:
      sampler = SimSampler(clock, c.decode, s.response_tokens.to_dict(), sync_s, agent=name,
                           vocab=tokenizer.vocab_size, version=weights.version,
                           recorder=recorder,
                           track=f'rollout/{devices[0]}' if recorder is not None else '',
                           padded_rows=EMBEDDED_MIN_BATCH if padded else 0, cores=cores,
                           compile=(rollout_compiled, (s.get('model'), s.rollout_tp)))
      if devices in served:  # moved here from another agent: it loads this one's weights
        sampler.update_weights(weights.params, weights.version)
      served.add(devices)
      return sampler
    return make

  def training_pool(trainers, meshes) -> TrainingEngine:
    return build_pool_engine(placement, setup, clock, trainers, groups, recorder)

  return Factories(trainer, sampler, lambda name: NoCheckpoints(), training_pool)
