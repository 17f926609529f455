"""One rollout instance serving several LoRA agents of one base (`rollout.adapter_groups`).

A `SharedAdapterSampler` holds the base once (the device group's copy) and each agent's
adapter in a slot of its own. A batch may mix the agents' rows: row i is sampled with
its agent's adapter (`transformer.route_adapters`), so a row's sample and logprobs are
those a dedicated instance of its agent would draw. Each agent publishes into its own
slot and keeps its own version: a row's PRNG key comes from its agent's version, as on a
dedicated instance.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

import numpy as np
from flax import nnx

from flexmarl.core.interfaces import Weights
from flexmarl.models import lora
from flexmarl.rollout.sampler import EmbeddedSampler, PendingSamples, SamplingParams

# an agent's published params -> the same params on the instance's devices (its adapter
# beside the device group's copy of the shared base)
Place = Callable[[dict], dict]


@runtime_checkable
class AdapterSampler(Protocol):
  """A rollout instance of several agents' adapters (this module's, or one vLLM engine's,
  `vllm_sampler.VLLMSharedAdapters`): each agent has its own slot and version."""

  agents: tuple[str, ...]

  def version_of(self, agent: str) -> int: ...

  def update_adapter(self, agent: str, params: dict, version: int) -> None: ...

  def submit(self, prompts: list[list[int]], keys: np.ndarray, params: SamplingParams,
             agents: Sequence[str], limits: np.ndarray | None = None): ...

  def close(self) -> None: ...


class SharedAdapterSampler:
  """K agents' adapters over one base on one instance's devices."""

  def __init__(self, graphdef: nnx.GraphDef, adapters: lora.LoRAConfig,
               weights: Mapping[str, Weights], place: Mapping[str, Place], **embedded):
    """`weights`: each agent's params (base + adapter) and version, in slot order;
    `place`: how each agent's published params reach these devices; `embedded`: the
    `EmbeddedSampler` arguments (max_prompt_len, eos_id, pad_id, ...)."""
    self.agents = tuple(weights)
    self.lora, self.place = adapters, dict(place)
    self.versions = {a: w.version for a, w in weights.items()}
    placed = {a: self.place[a](w.params) for a, w in weights.items()}
    self._adapters = {a: lora.partition(p, adapters)[0] for a, p in placed.items()}
    self._base = lora.partition(placed[self.agents[0]], adapters)[1]
    self._stale = False
    self._sampler = EmbeddedSampler(graphdef, self._stacked(), adapters=len(self.agents),
                                    **embedded)

  def _stacked(self) -> dict:
    return lora.combine(lora.stack([self._adapters[a] for a in self.agents]), self._base)

  def version_of(self, agent: str) -> int:
    return self.versions[agent]

  def update_adapter(self, agent: str, params: dict, version: int) -> None:
    """Serve `agent`'s published `params` (its adapter; the base is frozen) as `version`
    from its next row on; the other slots are untouched."""
    self._adapters[agent] = lora.partition(self.place[agent](params), self.lora)[0]
    self.versions[agent] = version
    self._stale = True  # restacked once, at the next batch, however many agents publish

  def submit(self, prompts: list[list[int]], keys: np.ndarray, params: SamplingParams,
             agents: Sequence[str], limits: np.ndarray | None = None) -> PendingSamples:
    """Start generating; `agents` [B]: the agent of each row."""
    if self._stale:
      self._sampler.update_weights(self._stacked(), 0)
      self._stale = False
    rows = np.array([self.agents.index(a) for a in agents], np.int32)
    return self._sampler.submit(prompts, keys, params, limits, adapter_rows=rows)

  def close(self) -> None:
    self._sampler.close()
