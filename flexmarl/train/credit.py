"""Credit: how an agent's rows get their advantages, by name (`agents.NAME.grpo.advantage`).

An estimator turns the rewards of one GRPO group (the samples of one `generate` call) into
one advantage per sample. Estimators are the entries of ESTIMATORS; the config names one,
and the agent's Learner (train/learner.py) applies it to each group as it arrives, the one
place a row's advantage is computed (the ExperienceStore keeps it beside the reward). A new
estimator is a function and a decorator, in a file of its own, imported before the config
is read:

    @register_advantage('rank')
    def rank(rewards: np.ndarray, cfg) -> np.ndarray:
      return (np.argsort(np.argsort(rewards)) - (len(rewards) - 1) / 2).astype(np.float32)

Pure numpy: the config checks a name against the registry before anything compiles.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

# (a group's rewards, the agent's GRPOConfig) -> one advantage per sample
Estimator = Callable[[np.ndarray, Any], np.ndarray]
ESTIMATORS: dict[str, Estimator] = {}


def register_advantage(name: str) -> Callable[[Estimator], Estimator]:
  """Add an estimator under `name`; a name is registered once."""
  def add(estimator: Estimator) -> Estimator:
    if name in ESTIMATORS:
      raise ValueError(f'an advantage estimator {name!r} is registered already '
                       f'({ESTIMATORS[name].__module__}); give yours another name.')
    ESTIMATORS[name] = estimator
    return estimator
  return add


def group_advantages(rewards: np.ndarray, group_size: int, normalize_std: bool = True,
                     eps: float = 1e-6) -> np.ndarray:
  """(r - mean(group)) [/ (std(group) + eps)] for rewards laid out group after group."""
  r = np.asarray(rewards, np.float64).reshape(-1, group_size)
  adv = r - r.mean(axis=1, keepdims=True)
  if normalize_std:
    adv = adv / (r.std(axis=1, keepdims=True) + eps)
  return adv.reshape(-1).astype(np.float32)


@register_advantage('grpo')
def grpo(rewards: np.ndarray, cfg: Any) -> np.ndarray:
  """GRPO's group-relative advantage (Shao et al., 2024); with `normalize_std=False`,
  Dr. GRPO's (Liu et al., 2025: no division by the group's std)."""
  return group_advantages(rewards, len(rewards), cfg.normalize_std)
