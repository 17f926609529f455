"""One agent's training state and its two compiled steps.

`AgentTrainer` holds an agent's parameters and optimizer state on its mesh. It
accumulates gradients over micro-batches (`accumulate`) and applies one optimizer
step per global batch (`apply`), dividing by the batch's token count then. The
schedules decide *when* these run; the numbers do not depend on it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from flexmarl.models import sharding, transformer
from flexmarl.rollout.sampler import bucket, left_pad
from flexmarl.train import grpo


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  learning_rate: float = 3e-3
  b1: float = 0.9
  b2: float = 0.99
  weight_decay: float = 0.0
  max_grad_norm: float = 1.0
  decay_steps: int = 0  # cosine decay of the learning rate over this many updates (0: constant)
  final_lr_fraction: float = 0.1


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
  lr = cfg.learning_rate
  if cfg.decay_steps:
    lr = optax.cosine_decay_schedule(cfg.learning_rate, cfg.decay_steps, cfg.final_lr_fraction)
  return optax.chain(
      optax.clip_by_global_norm(cfg.max_grad_norm),
      optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay))


@dataclasses.dataclass
class TrainBatch:
  """Rows of one micro-batch, host-side. Prompts left-padded to P, responses
  right-padded to T, exactly as the sampler laid them out."""

  prompts: np.ndarray  # [B, P] int32
  prompt_mask: np.ndarray  # [B, P] bool
  responses: np.ndarray  # [B, T] int32
  response_mask: np.ndarray  # [B, T] bool
  behaviour_logprobs: np.ndarray  # [B, T] float32
  advantages: np.ndarray  # [B] float32

  @classmethod
  def from_rows(cls, prompts: list[list[int]], responses: list[np.ndarray],
                logprobs: list[np.ndarray], advantages: np.ndarray, *, prompt_len: int,
                response_len: int, pad_id: int, batch_multiple: int = 1) -> 'TrainBatch':
    """Pad `len(prompts)` rows to a power-of-two batch (padding rows are masked out).

    Prompt and response widths shrink to the longest row, rounded up to a multiple of
    4 (capped at `prompt_len` / `response_len`): short answers cost short steps, and
    the few distinct widths compile once each.
    """
    n = len(prompts)
    size = bucket(n, batch_multiple)
    prompt_len = min(prompt_len, _round_up(max(map(len, prompts)), 4))
    response_len = min(response_len, _round_up(max(map(len, responses)), 4))
    ids, pmask = left_pad(list(prompts) + [[]] * (size - n), prompt_len, pad_id)
    resp = np.full((size, response_len), pad_id, np.int32)
    rmask = np.zeros((size, response_len), bool)
    blp = np.zeros((size, response_len), np.float32)
    for i, (r, lp) in enumerate(zip(responses, logprobs)):
      resp[i, :len(r)], rmask[i, :len(r)], blp[i, :len(r)] = r, True, lp
    adv = np.zeros((size,), np.float32)
    adv[:n] = advantages
    return cls(ids, pmask, resp, rmask, blp, adv)

  @property
  def tokens(self) -> int:
    return int(self.response_mask.sum())

  @property
  def rows(self) -> int:
    """Real rows (padding rows have no response token)."""
    return int(self.response_mask.any(axis=1).sum())


def _round_up(n: int, multiple: int) -> int:
  return max(multiple, -(-n // multiple) * multiple)


def response_logprobs(graphdef, params, batch: dict, temperature: float):
  """Logprobs and entropies of the response tokens under `params`: [B, T] each."""
  model = nnx.merge(graphdef, params)
  response_len = batch['responses'].shape[1]
  tokens = jnp.concatenate([batch['prompts'], batch['responses']], 1)
  valid = jnp.concatenate([batch['prompt_mask'], batch['response_mask']], 1)
  positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
  # The logits that predict the response: from the last prompt position on.
  logits, _ = model(tokens, positions, valid, last=response_len + 1)
  resp_logits = logits[:, :-1]
  return grpo.token_logprobs(resp_logits, batch['responses'], temperature)


def loss_sum(params, ref_params, batch: dict, entropy_coef, *, graphdef, cfg: grpo.GRPOConfig):
  """Token-summed GRPO loss of one micro-batch, plus summed diagnostics."""
  mask = batch['response_mask']
  logp, entropy = response_logprobs(graphdef, params, batch, cfg.temperature)
  ref_logp = None
  if ref_params is not None:
    ref_logp, _ = response_logprobs(graphdef, ref_params, batch, cfg.temperature)
    ref_logp = jax.lax.stop_gradient(ref_logp)
  per_token = grpo.grpo_token_loss(logp, batch['behaviour_logprobs'], batch['advantages'],
                                   entropy, ref_logp, cfg, entropy_coef)
  ratio = jnp.exp(logp - batch['behaviour_logprobs'])
  stats = {
      'entropy': grpo.masked_sum(entropy, mask),
      'clipped': grpo.masked_sum(grpo.clipped_fraction_terms(ratio, cfg), mask),
      'ratio_dev': grpo.masked_sum(jnp.abs(ratio - 1.0), mask),
  }
  return grpo.masked_sum(per_token, mask), stats


class AgentTrainer:
  """Params + optimizer state of one agent on its mesh, with compiled steps."""

  def __init__(self, name: str, model_cfg: transformer.ModelConfig, opt_cfg: OptimizerConfig,
               grpo_cfg: grpo.GRPOConfig, mesh: Mesh, seed: int):
    self.name = name
    self.mesh = mesh
    self.grpo_cfg = grpo_cfg
    model = transformer.Decoder(model_cfg, nnx.Rngs(params=seed))
    self.graphdef, state = nnx.split(model)
    self.shardings = sharding.param_shardings(state, mesh)
    self.params = jax.device_put(nnx.to_pure_dict(state), self.shardings)
    self.tx = make_optimizer(opt_cfg)
    # Eager init keeps each moment on its parameter's sharding (jax.jit(tx.init) puts the
    # whole state on one device); scalars (step counts) land on the default device, so
    # move those onto the mesh.
    mesh_devices = set(mesh.devices.flat)
    self.opt_state = jax.tree.map(
        lambda x: x if x.sharding.device_set <= mesh_devices
        else jax.device_put(x, sharding.replicated(mesh)), self.tx.init(self.params))
    self.opt_shardings = jax.tree.map(lambda x: x.sharding, self.opt_state)
    # A frozen copy: the live params are replaced (not mutated) at every step.
    self.ref_params = jax.tree.map(jnp.copy, self.params) if grpo_cfg.kl_coef else None
    ref_shardings = self.shardings if grpo_cfg.kl_coef else None
    self.version = 0
    self._grads = None
    self._stats: list[dict] = []  # per micro-batch, on device until the step
    self._tokens = self._rows = 0
    self.batch_multiple = mesh.shape['data']
    batch_sharding = sharding.batch_sharding(mesh)

    def accumulate(params, ref_params, batch, acc, entropy_coef):
      (loss, stats), grads = jax.value_and_grad(
          functools.partial(loss_sum, graphdef=self.graphdef, cfg=grpo_cfg), has_aux=True)(
              params, ref_params, batch, entropy_coef)
      return jax.tree.map(jnp.add, acc, grads), dict(stats, loss=loss)

    def apply(params, opt_state, acc, divisor):
      grads = jax.tree.map(lambda g: g / divisor, acc)
      updates, opt_state = self.tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, optax.tree.norm(grads)

    self._accumulate = jax.jit(
        accumulate, in_shardings=(self.shardings, ref_shardings, batch_sharding, self.shardings, None),
        out_shardings=(self.shardings, None), donate_argnums=3)
    self._zeros = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p),
                          out_shardings=self.shardings)
    self._apply = jax.jit(
        apply, in_shardings=(self.shardings, self.opt_shardings, self.shardings, None),
        out_shardings=(self.shardings, self.opt_shardings, None),
        donate_argnums=(1, 2))  # not params: a sampler may still be serving them

  def accumulate(self, batch: TrainBatch) -> None:
    """Add one micro-batch's gradient (of the token-summed loss) to the accumulator."""
    if self._grads is None:
      self._grads = self._zeros(self.params)
    self._grads, stats = self._accumulate(
        self.params, self.ref_params, dataclasses.asdict(batch), self._grads,
        np.float32(grpo.entropy_coef_at(self.grpo_cfg, self.version)))
    self._stats.append(stats)
    self._tokens += batch.tokens
    self._rows += batch.rows

  def apply(self) -> dict[str, float]:
    """One optimizer step over everything accumulated; returns per-token stats."""
    return self.dispatch_apply()()

  def dispatch_apply(self) -> Callable[[], dict[str, float]]:
    """Start one optimizer step over everything accumulated, without waiting for it.

    `params` and `version` are the new ones at once (as arrays still being computed);
    the returned function waits for the step and gives its per-token stats. In between
    the caller may run other work, e.g. a rollout on other devices."""
    tokens = self._tokens
    if tokens == 0:
      raise RuntimeError(f'agent {self.name!r}: optimizer step with no accumulated tokens.')
    divisor = grpo.loss_divisor(self.grpo_cfg, tokens, self._rows)
    self.params, self.opt_state, grad_norm = self._apply(
        self.params, self.opt_state, self._grads, np.float32(divisor))
    pending = self._stats
    self._grads, self._stats, self._tokens, self._rows = None, [], 0, 0
    self.version += 1

    def result() -> dict[str, float]:
      stats, norm = jax.device_get((pending, grad_norm))
      out = {k: sum(float(s[k]) for s in stats) / tokens for k in stats[0]}
      return dict(out, grad_norm=float(norm), trained_tokens=tokens)
    return result

  def train_state(self) -> dict:
    """What a checkpoint holds."""
    return {'params': self.params, 'opt_state': self.opt_state}

  def load_train_state(self, state: dict, version: int) -> None:
    self.params = jax.device_put(state['params'], self.shardings)
    self.opt_state = jax.device_put(state['opt_state'], self.opt_shardings)
    self.version = version
