"""The optax optimizer an OptimizerConfig describes: the trainer steps it, and
flexmarl.train.sizing measures its state from shapes."""

from __future__ import annotations

import optax

from flexmarl.train.spec import OptimizerConfig


def learning_rate(cfg: OptimizerConfig) -> float | optax.Schedule:
  """The learning rate per optimizer step: a linear warm-up over `warmup_steps` (from
  1/warmup_steps of the rate), then constant or a cosine decay over `decay_steps`."""
  lr: float | optax.Schedule = cfg.learning_rate
  if cfg.decay_steps:
    lr = optax.cosine_decay_schedule(cfg.learning_rate, cfg.decay_steps, cfg.final_lr_fraction)
  if not cfg.warmup_steps:
    return lr
  warm = optax.linear_schedule(cfg.learning_rate / cfg.warmup_steps, cfg.learning_rate,
                               cfg.warmup_steps - 1)
  after = lr if callable(lr) else optax.constant_schedule(lr)
  return optax.join_schedules([warm, after], [cfg.warmup_steps])


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
  lr = learning_rate(cfg)
  return optax.chain(
      optax.clip_by_global_norm(cfg.max_grad_norm),
      optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay))
