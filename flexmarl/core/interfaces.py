"""The interfaces the parts of a team meet at, declared once.

An `Agent` (flexmarl.agent) drives a `Trainer`, saves through a `Checkpointer` and
publishes its `Weights` to a `WeightSink` (its rollout instances). The real run, the
simulator and a remote backend each bring their own implementations, made by the
factories they hand to `flexmarl.build.build_team`; the rest of the run does not notice
which. (The rollout side's interface, `Sampler`, is declared in flexmarl.rollout.sampler.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

Stats = dict[str, float]
# What a checkpoint holds of one agent: the pytree of a trainer in this process, or a
# `RemoteState` token for a trainer whose state stays in its worker processes. Only the
# checkpointer made for that trainer reads it.
TrainState = Any


@dataclasses.dataclass(frozen=True)
class RemoteState:
  """The train state of agent `agent`, kept by its remote trainer group: its ranks save and
  restore it themselves (`flexmarl.cluster.remote.RemoteCheckpointer`)."""

  agent: str


@dataclasses.dataclass(frozen=True)
class Weights:
  """One published policy: an agent's parameters and their version (the number of
  updates that made them). The only record of what an agent's instances serve."""

  params: Any
  version: int


class WeightSink(Protocol):
  """Receives an agent's published weights: every instance serves them from its next
  batch on (an `InstancePool`; a remote worker group)."""

  def publish(self, weights: Weights) -> None:
    ...


class Trainer(Protocol):
  """One agent's training state and its steps: gradients accumulate over micro-batches,
  then one optimizer step. Work is dispatched, not awaited; `dispatch_apply` returns a
  function that waits and gives the step's per-token stats. A trainer counts no
  versions: its agent does."""

  name: str
  batch_multiple: int  # rows of a micro-batch are padded to a multiple of this

  @property
  def params(self) -> Any:
    """The current parameters (of the last optimizer step dispatched)."""

  def accumulate(self, batch: Any, update: int) -> Any:
    """Add one micro-batch's gradient; `update` is the number of updates before this
    one (schedules such as the entropy bonus's depend on it). Returns its stats."""

  def dispatch_apply(self, step: bool = True) -> Callable[[], Stats]:
    """Start one optimizer step over everything accumulated (`step=False`: drop it
    without a step, see `train.grpo.takes_step`)."""

  def train_state(self) -> TrainState:
    """What a checkpoint holds."""

  def load_train_state(self, state: TrainState) -> None:
    """Take a restored train state."""

  def reset(self) -> None:
    """Back to the starting weights with a fresh optimizer (an agent collapsed onto one
    answer, `train.collapse.collapsed`)."""


class Checkpointer(Protocol):
  """Saves and restores one agent's train state with the run's metadata."""

  directory: str  # where its checkpoints live (named in messages)

  def steps(self) -> list[int]:
    """The steps saved, intact or not."""

  def save(self, step: int, train_state: TrainState, meta: dict) -> None:
    """Save asynchronously; `wait` waits."""

  def restore(self, step: int, like: TrainState) -> tuple[TrainState, dict]:
    """The state (shaped and placed like `like`) and metadata saved at `step`."""

  def wait(self) -> None:
    """Until every save has finished."""
