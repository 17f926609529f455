"""One agent's training state and its compiled steps.

`AgentTrainer` holds an agent's state (`train.state.AgentState`) and trains it on the
mesh it is bound to, with steps compiled once per layout (`train.step`). It
accumulates gradients over micro-batches (`accumulate`) and applies one optimizer
step per global batch (`apply`), dividing by the batch's token count then. The
schedules decide *when* these run; the numbers do not depend on it.

"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from flexmarl.models import lora, sharding, transformer
from flexmarl.train import grpo
from flexmarl.train import state as state_lib
from flexmarl.train.batch import TrainBatch
from flexmarl.train.loss import loss_sum
from flexmarl.train.optimizer import make_optimizer
from flexmarl.train.shared_base import SharedBase
from flexmarl.train.spec import OptimizerConfig
from flexmarl.train.state import AgentState, InStorage, OnHost, OnMesh, Transfer
from flexmarl.train.step import StepCache, Steps, build_steps


class AgentTrainer:
  """One agent's training state and its compiled steps, bound to a mesh while it trains.

  Built on a `Mesh`, it is bound there from the start and, never released, behaves as a
  trainer pinned to its mesh. Built on a `MeshLayout`, its state starts in host memory.
  `bind(mesh)` moves the state onto any mesh of its layout (steps come from the shared
  `StepCache`); `release(to)` moves it off to host memory or storage, so the mesh can
  serve another agent. A half-accumulated batch moves with the state.
  """

  def __init__(self, name: str, model_cfg: transformer.ModelConfig, opt_cfg: OptimizerConfig,
               grpo_cfg: grpo.GRPOConfig, mesh: Mesh | sharding.MeshLayout, seed: int,
               steps: StepCache | None = None, init_params: dict | None = None,
               banned_ids: tuple[int, ...] = (), base: SharedBase | None = None):
    """`init_params`: starting weights (e.g. from an HF checkpoint, already on the
    mesh's shardings); by default a random initialisation from `seed`. A LoRA model
    (`model_cfg.lora.rank` > 0) trains only its adapters, which `init_params` may leave
    out (a base checkpoint): they start fresh from `seed`. Its frozen base is held
    apart from its state: `base`, shared with the other agents of that base, or
    (None) a base of its own split from the initial params; the state (moves, swaps,
    checkpoints) holds the adapters only. `banned_ids`: tokens the sampler never
    draws, left out of the trained distribution too."""
    self.name = name
    self.grpo_cfg = grpo_cfg
    self.layout = mesh if isinstance(mesh, sharding.MeshLayout) else sharding.layout_of(mesh)
    self.batch_multiple = self.layout.batch_multiple
    self.tx = make_optimizer(opt_cfg)
    if init_params is None and base is None:
      model = transformer.Decoder(model_cfg, nnx.Rngs(params=seed))
      self.graphdef, nnx_state = nnx.split(model)
      params = jax.device_get(nnx.to_pure_dict(nnx_state))
    else:  # a pretrained model: its structure only, no second copy of the weights
      self.graphdef, nnx_state = transformer.abstract_model(model_cfg)
      params = init_params or {}
      if model_cfg.lora.rank and not lora.partition(params, model_cfg.lora)[0]:
        params = lora.combine(jax.device_get(transformer.fresh_adapters(model_cfg, seed)), params)
    partition = functools.partial(lora.partition, lora=model_cfg.lora)
    self._partition = partition
    self.base: SharedBase | None = None
    if model_cfg.lora.rank:
      params, frozen = partition(params)
      self.base = base if base is not None else SharedBase.holding(frozen)
    shapes = nnx.to_pure_dict(nnx_state)

    def build() -> Steps:
      loss = functools.partial(loss_sum, graphdef=self.graphdef, cfg=grpo_cfg,
                               banned_ids=tuple(banned_ids))
      specs = sharding.param_specs(nnx_state, self.layout.abstract())
      abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), shapes)
      return build_steps(loss, self.tx, abstract, specs, self.layout, bool(grpo_cfg.kl_coef),
                         partition, lora.combine)
    self._steps = (StepCache() if steps is None else steps).get(
        (model_cfg, opt_cfg, grpo_cfg, self.layout, tuple(banned_ids)), build)
    # The starting weights (host arrays; a LoRA agent's adapters): what `reset` restores,
    # kept only where the collapse reset is on.
    self._start = (jax.device_get(partition(params)[0])
                   if grpo_cfg.collapse_after and grpo_cfg.collapse_resets else None)
    self.state = AgentState(
        params=params, opt_state=jax.device_get(self.tx.init(partition(params)[0])),
        rng=np.asarray(jax.random.key_data(jax.random.key(seed))), location=OnHost(),
        # A frozen copy for the KL term: the live params are replaced at every step.
        ref_params=jax.tree.map(np.copy, params) if grpo_cfg.kl_coef else None)
    self.mesh: Mesh | None = None
    self._stats: list[dict] = []  # per micro-batch, on device until the step
    self._tokens = self._rows = 0  # of the batch accumulated so far (silent rows included)
    self._run_tokens = 0  # of them, run through the model
    self._coef = 0.0  # the entropy coefficient this batch's gradient uses
    self._incoming: tuple[OnMesh, AgentState, concurrent.futures.Future] | None = None
    self._targets: dict[Mesh, OnMesh] = {}
    if isinstance(mesh, Mesh):
      self.bind(mesh)

  # -- where the state lives ------------------------------------------------------------

  @property
  def params(self):
    """The full params: the state's, or a LoRA agent's adapters over its base (the copy
    on the mesh it is bound to, else in host memory)."""
    return self._with_base(self.state.params)

  @property
  def opt_state(self):
    return self.state.opt_state

  @property
  def ref_params(self):
    return None if self.state.ref_params is None else self._with_base(self.state.ref_params)

  def _with_base(self, adapters):
    if self.base is None:
      return adapters
    if self.mesh is None:
      return lora.combine(adapters, self.base.host())
    return lora.combine(adapters, self.base.on(
        self.mesh, self._partition(self.shardings_on(self.mesh))[1]))

  def place(self, params: dict, mesh: Mesh) -> dict:
    """Published `params` on `mesh` (a rollout instance's devices, this layout): a copy,
    but of a LoRA agent's adapters only, beside that device group's shared base."""
    shardings = self.shardings_on(mesh)
    if self.base is None:
      return jax.device_put(params, shardings)
    to_adapters, to_base = self._partition(shardings)
    return lora.combine(jax.device_put(self._partition(params)[0], to_adapters),
                        self.base.on(mesh, to_base))

  @property
  def shardings(self):
    return self._bound().shardings['params']

  @property
  def opt_shardings(self):
    return self._bound().shardings['opt_state']

  def _bound(self) -> OnMesh:
    if self.mesh is None:
      raise RuntimeError(f'agent {self.name!r} is not bound to a mesh (its state is in '
                         f'{state_lib.kind(self.state.location)}): call bind(mesh) first.')
    return self.state.location

  def shardings_on(self, mesh: Mesh):
    """Where the params would live on `mesh` (any mesh of this layout, bound or not)."""
    return self._steps.shardings(mesh)['params']

  def _target(self, mesh: Mesh) -> OnMesh:
    """The state's place on `mesh`, built once per mesh: a swap compares and copies to
    the same objects each time (building ~100 shardings per swap costs as much as a small
    state's copy)."""
    if mesh not in self._targets:
      shardings = self._steps.shardings(mesh)
      if self.base is not None:  # the state holds adapters only
        shardings = dict(shardings, params=self._partition(shardings['params'])[0])
      self._targets[mesh] = OnMesh(mesh, shardings)
    return self._targets[mesh]

  def prefetch(self, mesh: Mesh, executor: concurrent.futures.Executor) -> None:
    """Start moving the state onto `mesh` on `executor`; the next `bind(mesh)` takes it."""
    target = self._target(mesh)
    self._incoming = (target, self.state, state_lib.prefetch(self.state, target, executor))

  def bind(self, mesh: Mesh) -> Transfer:
    """Move the state onto `mesh` (a mesh of this agent's layout) to train there; a no-op
    (0 bytes) when it is bound there already."""
    if self.mesh is mesh:
      return Transfer('mesh', 'mesh', 0, 0.0)
    if self.mesh is not None:
      raise RuntimeError(f'agent {self.name!r} is bound to another mesh; release it first.')
    target, incoming = self._target(mesh), self._incoming
    self._incoming = None
    if incoming and incoming[0] == target and incoming[1] is self.state:
      self.state, transfer = incoming[2].result()
    else:
      self.state, transfer = state_lib.move(self.state, target)
    self.mesh = mesh
    return transfer

  def release(self, to: OnHost | InStorage = OnHost()) -> Transfer:
    """Move the state off its mesh, leaving the mesh free for another agent (or, not
    bound, from host memory to storage)."""
    self._stats = jax.device_get(self._stats)
    self.state, transfer = state_lib.move(self.state, to)
    self.mesh = None
    return transfer

  def unbind(self) -> None:
    """Leave the mesh, the state staying on its devices: another agent trains there
    meanwhile, and a `bind` back onto it moves nothing."""
    self.mesh = None

  # -- training -------------------------------------------------------------------------

  def accumulate(self, batch: TrainBatch, update: int = 0) -> dict:
    """Add one micro-batch's gradient (of the token-summed loss) to the accumulator;
    returns its summed stats (device arrays, ready once the micro-batch is computed).
    `update`: the agent's updates so far (a fixed entropy bonus anneals over them)."""
    self._bound()
    coef = grpo.entropy_coef_at(self.grpo_cfg, update)
    with jax.set_mesh(self.mesh):
      grads = self.state.grads
      if grads is None:
        grads = self._steps.zeros(self.params)
      grads, stats = self._steps.accumulate(
          self.params, self.ref_params,
          sharding.global_batch(batch.device_arrays(), self.mesh), grads, np.float32(coef))
    self.state = dataclasses.replace(self.state, grads=grads)
    self._stats.append(stats)
    self._tokens += batch.tokens
    self._run_tokens += batch.tokens
    self._rows += batch.rows
    self._coef = coef
    return stats

  def count_silent(self, tokens: int, rows: int) -> None:
    """Count rows of the batch that add nothing to the gradient (`grpo.silent`) and
    were not run: they weigh in the loss's divisor as if they had been."""
    self._tokens += tokens
    self._rows += rows

  def apply(self) -> dict[str, float]:
    """One optimizer step over everything accumulated; returns per-token stats."""
    return self.dispatch_apply()()

  def dispatch_apply(self, step: bool = True) -> Callable[[], dict[str, float]]:
    """Start one optimizer step over everything accumulated, without waiting for it.

    `params` are the new ones at once (as arrays still being computed);
    the returned function waits for the step and gives its per-token stats. In between
    the caller may run other work, e.g. a rollout on other devices. `step=False`
    (`grpo.takes_step` says so for a batch without advantage signal) drops the
    accumulated gradient instead: no Adam update, no parameter change; stats say
    `skipped_update` 1 (stats: `entropy_coef`, the coefficient this batch's gradient used;
    `entropy_bonus`, its mean over the tokens after `grpo.entropy_weights`)."""
    tokens = self._tokens
    if tokens == 0:
      raise RuntimeError(f'agent {self.name!r}: optimizer step with no accumulated tokens.')
    self._bound()
    grad_norm = np.float32(0.0)  # a skipped step applies no gradient
    if step:
      divisor = grpo.loss_divisor(self.grpo_cfg, tokens, self._rows)
      with jax.set_mesh(self.mesh):
        grads = self.state.grads  # None: every row was silent, the gradient is 0
        grads = self._steps.zeros(self.params) if grads is None else grads
        params, opt_state, grad_norm = self._steps.update(
            self.params, self.opt_state, grads, np.float32(divisor))
      if self.base is not None:
        params = self._partition(params)[0]
      self.state = dataclasses.replace(self.state, params=params, opt_state=opt_state)
    self.state = dataclasses.replace(self.state, grads=None)
    pending, coef, run_tokens = self._stats, self._coef, self._run_tokens
    self._stats, self._tokens, self._rows, self._run_tokens = [], 0, 0, 0

    def result() -> dict[str, float]:
      stats, norm = jax.device_get((pending, grad_norm))
      # Per token of the rows run (a silent row's loss terms are 0, its entropy unknown).
      out = {k: sum(float(s[k]) for s in stats) / run_tokens for k in stats[0]} if stats else {}
      return dict(out, grad_norm=float(norm), trained_tokens=tokens, run_tokens=run_tokens,
                  skipped_update=float(not step), entropy_coef=coef)
    return result

  # -- checkpoints ----------------------------------------------------------------------

  def train_state(self) -> dict:
    """What a checkpoint holds (a stored state is read into host memory for it)."""
    state = self.state
    if isinstance(state.location, InStorage):
      state, _ = state_lib.move(state, OnHost())
    return {'params': state.params, 'opt_state': state.opt_state}

  def reset(self) -> None:
    """Back to the starting weights and a fresh optimizer state, kept where the state
    lives now (what was accumulated is dropped)."""
    if self._start is None:
      raise RuntimeError(f'agent {self.name!r}: reset with the collapse reset off '
                         '(grpo.collapse_after or collapse_resets is 0).')
    self.load_train_state({'params': self._start, 'opt_state': self.tx.init(self._start)})

  def load_train_state(self, state: dict) -> None:
    """Take a restored state, kept where this agent's state lives now."""
    fresh = dataclasses.replace(self.state, params=state['params'],
                                opt_state=state['opt_state'], grads=None)
    self.state, _ = state_lib.put(fresh, self.state.location)
    self._stats, self._tokens, self._rows, self._run_tokens = [], 0, 0, 0
