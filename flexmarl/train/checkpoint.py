"""Orbax checkpoints of each agent: params + optimizer state, and run metadata.

`WORKDIR/checkpoints/AGENT/` holds one `CheckpointManager`. Restores land on the
agent's current shardings (its mesh may differ from the one that saved).
"""

from __future__ import annotations

import os

import jax
import numpy as np
import orbax.checkpoint as ocp


def _target(x):
  on_device = isinstance(x, jax.Array) and x.sharding.memory_kind in (None, 'device')
  if on_device:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  return np.empty(x.shape, x.dtype)


class AgentCheckpointer:

  def __init__(self, workdir: str, agent: str, max_to_keep: int = 2):
    self.directory = os.path.abspath(os.path.join(workdir, 'checkpoints', agent))
    self.manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                                             create=True))

  def steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def save(self, step: int, train_state: dict, meta: dict) -> None:
    """Asynchronous: returns once the arrays are copied, writes in the background."""
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(train_state), meta=ocp.args.JsonSave(meta)))

  def restore(self, step: int, like: dict) -> tuple[dict, dict]:
    """Restore onto the shardings of `like` (a train state of the right structure): its
    device arrays' shardings, or numpy where `like` is in host memory."""
    target = jax.tree.map(_target, like)
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
    return out['state'], out['meta']

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()
