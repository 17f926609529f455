"""Rollout backends by name (`config.rollout.backend`), each one registered entry.

A `Backend` answers everything the rest of the run asks of a backend: what the config
must hold for it (an installed extra, its own config section, agents it can serve), the
GPU memory its instances take, how it makes an agent's instances in this process
(`flexmarl.build.local_factories`) and in a Ray rollout worker
(`flexmarl.cluster.workers`), whether one instance serves a `rollout.adapter_groups`
group, and between which agents the balancer may move an instance. A new backend
(SGLang, a remote OpenAI-compatible server) is one subclass and one `register` call;
nothing else looks at the name.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import os
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from flexmarl.core.errors import ConfigError
from flexmarl.core.interfaces import Weights
from flexmarl.models import sharding, transformer
from flexmarl.models.tokenizer import TextTokenizer
from flexmarl.models.transformer import ModelConfig
from flexmarl.rollout import vllm_check
from flexmarl.rollout.adapters import AdapterSampler, SharedAdapterSampler
from flexmarl.rollout.sampler import EmbeddedSampler, Sampler, compile_generate
from flexmarl.rollout.spec import RolloutSpec, engine_config
from flexmarl.spec.agent import AgentSpec
from flexmarl.spec.team import TeamSpec
from flexmarl.spec.validate import fail
from flexmarl.train.sizing import param_count
from flexmarl.train.trainer import AgentTrainer

# (devices, weights) -> a sampler of one agent's model on those devices serving them.
MakeSampler = Callable[[tuple[int, ...], Weights], Sampler]
# (devices, each agent's weights) -> one sampler serving a group's adapters there.
MakeShared = Callable[[tuple[int, ...], Mapping[str, Weights]], AdapterSampler]
# What a backend's instances hold at least (see gpu_memory.check_fits): in JAX's share,
# (devices, what, bytes spread over those devices) each; per engine with a share of its
# own, its name -> bytes.
Memory = tuple[list[tuple[tuple[int, ...], str, int]], dict[str, int]]


@dataclasses.dataclass(frozen=True)
class Local:
  """What the samplers of a run in this process are made from. `compiled`: each model's
  sampling loop, shared by the instances of agents of that model, so that an instance
  moving between such agents does not compile again."""

  spec: TeamSpec
  tokenizers: Mapping[str, TextTokenizer]
  workdir: str
  by_id: Mapping[int, jax.Device]
  compiled: dict = dataclasses.field(default_factory=dict)

  def mesh(self, devices: tuple[int, ...], a: AgentSpec) -> jax.sharding.Mesh:
    return sharding.make_mesh([self.by_id[d] for d in devices], a.mesh_shape, a.mesh_axes)


class Backend(abc.ABC):
  """One rollout backend. The defaults suit a backend that starts nothing beside JAX and
  gives every agent instances of its own; `sampler` it must give."""

  name: str
  serves_adapter_groups = False  # one instance serves a rollout.adapter_groups group

  def check(self, rollout: RolloutSpec, agents: Mapping[str, AgentSpec],
            max_prompt_len: int) -> None:
    """Refuse with the config (ConfigError naming the field and the fix) what this
    backend cannot run: a missing extra, its config section, agents it cannot serve."""

  def engine_demand(self, spec: TeamSpec) -> tuple[int, float | None]:
    """The engines the run starts on the first GPU beside JAX, each asking for its own
    fraction of its memory, and the fraction the config sets (None: unset); read by
    `gpu_memory.plan` before JAX starts, so from the spec alone."""
    return 0, None

  def memory(self, spec: TeamSpec) -> Memory:
    """What the instances of `spec`'s placement hold at least, from shapes alone."""
    return [], {}

  def balance_key(self, model: ModelConfig) -> tuple:
    """What agents must share, beyond their mesh shape, for an instance to move between
    them (`build.balance_group`)."""
    return ()

  @abc.abstractmethod
  def sampler(self, local: Local, name: str, trainer: AgentTrainer) -> MakeSampler:
    """Agent `name`'s instances in this process; `trainer`: its trainer there."""

  def shared_sampler(self, local: Local, names: Sequence[str],
                     trainers: Mapping[str, AgentTrainer]) -> MakeShared:
    """The instances of adapter group `names` (only if `serves_adapter_groups`)."""
    raise NotImplementedError(f'rollout.backend={self.name!r} serves no adapter groups')

  def worker_sampler(self, spec: TeamSpec, name: str, tokenizer: TextTokenizer, workdir: str,
                     devices: tuple[int, ...], weights: Weights) -> Sampler:
    """One instance of agent `name` in a Ray rollout worker, on the worker's first
    len(devices) local devices."""
    raise NotImplementedError(f'rollout.backend={self.name!r} runs in no Ray worker')


REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
  """Make `backend` a value of `rollout.backend`."""
  REGISTRY[backend.name] = backend
  return backend


def get(name: str) -> Backend:
  """The backend `rollout.backend=name` (a checked config names a registered one)."""
  return REGISTRY[name]


def _sampling_args(spec: TeamSpec, tokenizer: TextTokenizer) -> dict:
  """The EmbeddedSampler arguments every embedded instance of the run shares."""
  return dict(max_prompt_len=spec.max_prompt_len,
              prompt_width_multiple=spec.prompt_width_multiple, eos_id=tokenizer.stop_ids,
              pad_id=tokenizer.pad_id, banned_ids=tokenizer.banned_ids)


class Embedded(Backend):
  """The JAX sampler (`EmbeddedSampler`): runs anywhere JAX runs, needs no extra."""

  name = 'embedded'
  serves_adapter_groups = True

  def memory(self, spec: TeamSpec) -> Memory:
    """An instance off its trainer's devices holds its own copy of the weights."""
    p, held = spec.placement, []
    for name, insts in p.rollout.items():
      model = spec.agents[name].model
      nbytes = param_count(model) * jnp.dtype(model.dtype).itemsize
      held += [(m.devices, f'{name}/{j} weights', nbytes) for j, m in enumerate(insts)
               if m.devices != p.train[name].devices]
    return held, {}

  def sampler(self, local: Local, name: str, trainer: AgentTrainer) -> MakeSampler:
    """Instances in the trainer's layout; on the trainer's own devices they serve the
    published arrays as they are."""
    spec, a = local.spec, local.spec.agents[name]
    generate_fn = local.compiled.setdefault(a.model, compile_generate(trainer.graphdef))
    train_devices = () if spec.placement.pool else spec.placement.train[name].devices
    args = _sampling_args(spec, local.tokenizers[name])

    def make(devices: tuple[int, ...], weights: Weights) -> Sampler:
      place = (None if tuple(devices) == tuple(train_devices)
               else functools.partial(trainer.place, mesh=local.mesh(devices, a)))
      return EmbeddedSampler(trainer.graphdef, weights.params, **args,
                             batch_multiple=trainer.batch_multiple, version=weights.version,
                             place=place, generate_fn=generate_fn)
    return make

  def shared_sampler(self, local: Local, names: Sequence[str],
                     trainers: Mapping[str, AgentTrainer]) -> MakeShared:
    """One copy of the base per instance's device group (the one the group's trainers
    share there) and each agent's adapter."""
    a, first = local.spec.agents[names[0]], trainers[names[0]]
    generate_fn = local.compiled.setdefault(a.model, compile_generate(first.graphdef))
    args = _sampling_args(local.spec, local.tokenizers[names[0]])

    def make(devices: tuple[int, ...], weights: Mapping[str, Weights]) -> AdapterSampler:
      mesh = local.mesh(devices, a)
      return SharedAdapterSampler(
          first.graphdef, a.model.lora, weights,
          {n: functools.partial(trainers[n].place, mesh=mesh) for n in names}, **args,
          batch_multiple=first.batch_multiple, generate_fn=generate_fn)
    return make

  def worker_sampler(self, spec: TeamSpec, name: str, tokenizer: TextTokenizer, workdir: str,
                     devices: tuple[int, ...], weights: Weights) -> Sampler:
    a = spec.agents[name]
    graphdef, abstract = transformer.abstract_model(a.model)
    mesh = sharding.make_mesh(jax.local_devices()[:len(devices)], a.mesh_shape, a.mesh_axes)
    return EmbeddedSampler(
        graphdef, weights.params, **_sampling_args(spec, tokenizer),
        batch_multiple=sharding.layout_of(mesh).batch_multiple, version=weights.version,
        place=functools.partial(jax.device_put, device=sharding.param_shardings(abstract, mesh)))


class VLLM(Backend):
  """A vLLM engine per instance (the vllm extra, imported only when this backend is
  used), started from an export of the weights under the workdir and synced in place
  after every update; a group's adapters share one engine of their base."""

  name = 'vllm'
  serves_adapter_groups = True

  def check(self, rollout: RolloutSpec, agents: Mapping[str, AgentSpec],
            max_prompt_len: int) -> None:
    """vLLM imports (a broken install is refused with the line that mends it), the
    `rollout.vllm` engine arguments, and what an engine would refuse to start or serve."""
    try:
      vllm_check.import_vllm()
    except vllm_check.VLLMInstallError as e:
      fail('rollout.backend', self.name, str(e))
    try:
      max_model_len = engine_config(**rollout.vllm).max_model_len
    except (TypeError, ValueError) as e:
      raise ConfigError(f'config.rollout.vllm: {e}') from None
    sizes = vllm_check.cpu_head_sizes()
    top_rank = max(vllm_check.lora_ranks())
    for name, a in agents.items():
      f = f'agents.{name}'
      if a.model.lora.rank > top_rank:
        fail(f'{f}.model.lora.rank', a.model.lora.rank,
             f'vLLM serves LoRA adapters of rank up to {top_rank}; give a lower rank, or use '
             'rollout.backend=embedded.')
      if sizes is not None and a.model.head_dim not in sizes:
        fail(f'{f}.model.head_dim', a.model.head_dim,
             f'vLLM on CPU serves attention head sizes {sizes}; give the model one of them '
             f'(model.head_dim, or a model.checkpoint with such heads), or use '
             'rollout.backend=embedded.')
      if a.model.qkv_bias and a.model.heads * a.model.head_dim != a.model.hidden:
        fail(f'{f}.model.head_dim', a.model.head_dim,
             f'a model with q/k/v biases is served as Qwen2, which vLLM builds with head_dim = '
             f'hidden / heads = {a.model.hidden // a.model.heads}; give model.head_dim='
             f'{a.model.hidden // a.model.heads} (or heads and hidden that make it), '
             'model.qkv_bias=False (served as Llama, which keeps head_dim), or use '
             'rollout.backend=embedded.')
      if a.sampling.top_p < 1:
        fail(f'{f}.sampling.top_p', a.sampling.top_p, 'the vLLM backend reports the logprobs '
             'the trainer uses only without top-p; set top_p=1.0 or use '
             'rollout.backend=embedded.')
      if max_prompt_len + a.sampling.max_new_tokens > max_model_len:
        fail('rollout.vllm.max_model_len', max_model_len,
             f'agent {name!r} needs max_prompt_len + max_new_tokens = {max_prompt_len} + '
             f'{a.sampling.max_new_tokens} tokens; raise max_model_len to at least '
             f'{max_prompt_len + a.sampling.max_new_tokens}.')

  def engine_demand(self, spec: TeamSpec) -> tuple[int, float | None]:
    """An engine per instance; a group's agents share their first agent's."""
    served_with = {n for group in spec.rollout.adapter_groups for n in group[1:]}
    engines = sum(a.instances for n, a in spec.agents.items() if n not in served_with)
    return engines, spec.rollout.vllm.get('gpu_memory_utilization')

  def memory(self, spec: TeamSpec) -> Memory:
    """Each engine: its weights and the KV cache of one longest sequence."""
    e = engine_config(**spec.rollout.vllm)
    itemsize = jnp.dtype(e.dtype).itemsize
    engines = {}
    for name, insts in spec.placement.rollout.items():
      m = spec.agents[name].model
      kv = 2 * m.layers * m.kv_heads * m.head_dim * e.max_model_len * itemsize
      for j in range(len(insts)):
        engines[f'{name}/{j}'] = param_count(m) * itemsize + kv
    return [], engines

  def balance_key(self, model: ModelConfig) -> tuple:
    """One architecture: a move is then one weight sync into the running engine."""
    from flexmarl.rollout import vllm_engine  # the optional extra
    return (vllm_engine.engine_model(model),)

  def sampler(self, local: Local, name: str, trainer: AgentTrainer) -> MakeSampler:
    """Engines made as in a Ray worker: from the published weights alone."""
    return functools.partial(self.worker_sampler, local.spec, name, local.tokenizers[name],
                             local.workdir)

  def shared_sampler(self, local: Local, names: Sequence[str],
                     trainers: Mapping[str, AgentTrainer]) -> MakeShared:
    """One engine of the base with every agent's adapter loaded."""
    from flexmarl.rollout import vllm_sampler  # the optional extra
    spec, tokenizer = local.spec, local.tokenizers[names[0]]

    def make(devices: tuple[int, ...], weights: Mapping[str, Weights]) -> AdapterSampler:
      return vllm_sampler.VLLMSharedAdapters(
          spec.agents[names[0]].model, weights, workdir=self._folder(local.workdir, names,
                                                                     devices),
          eos_id=tokenizer.stop_ids, pad_id=tokenizer.pad_id, banned_ids=tokenizer.banned_ids,
          engine=engine_config(**spec.rollout.vllm))
    return make

  def worker_sampler(self, spec: TeamSpec, name: str, tokenizer: TextTokenizer, workdir: str,
                     devices: tuple[int, ...], weights: Weights) -> Sampler:
    from flexmarl.rollout import vllm_sampler  # the optional extra
    return vllm_sampler.VLLMSampler(
        spec.agents[name].model, weights.params,
        workdir=self._folder(workdir, [name], devices), eos_id=tokenizer.stop_ids,
        pad_id=tokenizer.pad_id, banned_ids=tokenizer.banned_ids,
        engine=engine_config(**spec.rollout.vllm), version=weights.version)

  @staticmethod
  def _folder(workdir: str, names: Sequence[str], devices: tuple[int, ...]) -> str:
    """Where the engine's exported weights go."""
    return os.path.join(workdir, 'vllm', '+'.join(names), '-'.join(map(str, devices)))


register(Embedded())
register(VLLM())
