"""Orbax checkpoints of each agent: params + optimizer state, and run metadata.

`WORKDIR/checkpoints/AGENT/` holds one `CheckpointManager`. Restores land on the
agent's current shardings (its mesh may differ from the one that saved).
`restore_latest` resumes a team from the newest step that every agent has intact,
falling back past a checkpoint with a missing or damaged file, and saying so.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp

from flexmarl.train import layer_stack

# The meta key that says how the state's arrays are laid out (absent: as the train state).
LAYOUT = '_layout'
LAYERS_STACKED = 'stacked-layers'  # layer_stack.stack: each layer dict as one stacked layer


def _target(x):
  """What Orbax restores `x`'s leaf into: the same sharding for device arrays (and for
  shapes that carry one), numpy for host memory."""
  if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None:
    return x
  on_device = isinstance(x, jax.Array) and x.sharding.memory_kind in (None, 'device')
  if on_device:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  return np.empty(x.shape, x.dtype)


def _place(value: np.ndarray, like):
  """A restored host array where `_target` would have put `like`'s leaf."""
  target = _target(like)
  if isinstance(target, jax.ShapeDtypeStruct):
    return jax.device_put(value, target.sharding)
  return np.asarray(value)


class CheckpointError(RuntimeError):
  """No checkpoint step is intact for every agent; the message says what to do."""


def saved_steps(workdir: str, agent: str) -> list[int]:
  """The steps `agent` has a checkpoint of in `workdir`, read off the folder names without
  opening a manager (which would create the folder of an agent that has none)."""
  folder = os.path.join(workdir, 'checkpoints', agent)
  return sorted(int(name) for name in (os.listdir(folder) if os.path.isdir(folder) else [])
                if name.isdigit())


class AgentCheckpointer:

  def __init__(self, workdir: str, agent: str, max_to_keep: int = 2):
    self.directory = os.path.abspath(os.path.join(workdir, 'checkpoints', agent))
    self.manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                                             create=True))

  def steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def save(self, step: int, train_state: dict, meta: dict) -> None:
    """Asynchronous: returns once the arrays are copied, writes in the background. The
    layers are stored stacked (`layer_stack`: far fewer arrays to write and read) where
    this process holds them whole."""
    if layer_stack.readable(train_state):
      train_state, meta = layer_stack.stack(train_state), {**meta, LAYOUT: LAYERS_STACKED}
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(train_state), meta=ocp.args.JsonSave(meta)))

  def restore(self, step: int, like: dict) -> tuple[dict, dict]:
    """Restore onto the shardings of `like` (a train state of the right structure): its
    device arrays' shardings, or numpy where `like` is in host memory. Checkpoints
    written before layers were stacked restore as they were saved."""
    meta = self.manager.restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore()))['meta']
    stacked = meta.pop(LAYOUT, None) == LAYERS_STACKED
    target = (layer_stack.stacked_target(like, _target) if stacked
              else jax.tree.map(_target, like))
    state = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target)))['state']
    return (layer_stack.unstack(state, like, _place) if stacked else state), meta

  def read(self, step: int) -> tuple[dict, dict]:
    """The state and meta of `step` as stored, in host memory, without a state to restore
    onto (to inspect a checkpoint); its layers split again where they were stacked."""
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
    meta = dict(out['meta'])
    stacked = meta.pop(LAYOUT, None) == LAYERS_STACKED
    state = jax.device_get(out['state'])
    return (layer_stack.split(state) if stacked else state), meta

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()


def restore_latest(checkpointers: Mapping[str, AgentCheckpointer], like_states: Mapping[str, dict]
                   ) -> tuple[int, dict[str, dict], dict[str, dict], list[str]]:
  """Restore the newest step that every agent has intact (metadata present, arrays readable).

  Returns (step, states, metas, warnings): step 0 with empty dicts when there is no
  checkpoint; `warnings` names each newer step skipped and why. Raises CheckpointError
  when checkpoints exist but none is intact for every agent.
  """
  common = set.intersection(*(set(c.steps()) for c in checkpointers.values()))
  partial = set.union(*(set(c.steps()) for c in checkpointers.values())) - common
  warnings = []
  if partial and common and max(partial) > max(common):
    missing = {n: sorted(partial - set(c.steps())) for n, c in checkpointers.items()}
    warnings.append(f'steps {sorted(s for s in partial if s > max(common))} are not saved for '
                    f'every agent (missing: { {n: m for n, m in missing.items() if m} }); '
                    f'resuming from an earlier step.')
  for step in sorted(common, reverse=True):
    states, metas = {}, {}
    try:
      for name, ckpt in checkpointers.items():
        where = os.path.join(ckpt.directory, str(step))
        states[name], metas[name] = ckpt.restore(step, like_states[name])
    except Exception as e:  # noqa: BLE001 — Orbax/TensorStore raise many kinds
      reason = str(e).split(' See full TensorStore details')[0][:300]
      warnings.append(f'checkpoint {where} is incomplete or damaged ({type(e).__name__}: '
                      f'{reason}); falling back to the previous complete checkpoint.')
      continue
    return step, states, metas, warnings
  if not common:
    return 0, {}, {}, warnings
  dirs = sorted(c.directory for c in checkpointers.values())
  raise CheckpointError(
      f'no checkpoint step is intact for every agent (steps {sorted(common)} in {dirs}):\n  '
      + '\n  '.join(warnings) + '\nFix: start over in a new --workdir (this one stays '
      'readable: metrics.jsonl, store/), or restore the damaged files from a backup to resume.')
