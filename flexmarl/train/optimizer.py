"""The optax optimizer an OptimizerConfig describes: the trainer steps it, and
flexmarl.train.sizing measures its state from shapes."""

from __future__ import annotations

import optax

from flexmarl.train.spec import OptimizerConfig


def make_optimizer(cfg: OptimizerConfig) -> optax.GradientTransformation:
  lr = cfg.learning_rate
  if cfg.decay_steps:
    lr = optax.cosine_decay_schedule(cfg.learning_rate, cfg.decay_steps, cfg.final_lr_fraction)
  return optax.chain(
      optax.clip_by_global_norm(cfg.max_grad_norm),
      optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay))
