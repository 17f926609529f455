"""Rollout instances of an agent, and the router that spreads its requests.

An `Instance` is one sampler on its devices with a queue: requests that reach it
while it is busy join its next batch (up to `max_batch` rows). An `InstancePool`
holds an agent's instances and the weights they serve; it routes each request to
the instance with the least outstanding work, counted in tokens (prompt + n ×
max_new_tokens), optionally keeping a conversation's calls on one instance. The
routing decision is a pure function (`least_loaded`).

An instance may serve several LoRA agents of one base (an `AdapterSampler`): it
is then in each of their pools, its queue mixes their requests, each agent publishes
into its own adapter slot, and each request is sampled at its own agent's version.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from flexmarl.core.interfaces import Weights
from flexmarl.data.records import ServedGroup
from flexmarl.data.sample_id import sample_id
from flexmarl.rollout.adapters import AdapterSampler
from flexmarl.rollout.sampler import PendingSamples, SampleBatch, Sampler, SamplingParams


@dataclasses.dataclass
class Request:
  """One `generate` call of a workflow: a GRPO group of `n` samples of one prompt."""

  index: int  # the query's position in the run's stream
  query_id: str
  call: int  # the call's index within its query
  agent: str
  prompt_ids: list[int]
  n: int
  cost: int  # tokens it may occupy: prompt + n × max_new_tokens
  future: asyncio.Future  # answered with the completions
  served: list[ServedGroup]  # the query's served groups, where this one is added
  enqueued: float = 0.0  # clock time the workflow asked (for queue-time metrics)
  max_new_tokens: int | None = None  # this call's cap (None: the agent's sampling cap)
  stop: tuple[str, ...] = ()  # stop strings: the answer ends at the first one

  @property
  def sample_ids(self) -> list[str]:
    return [sample_id(self.query_id, self.call, j) for j in range(self.n)]


# How many recent batches (and their requests' waits) an Instance keeps for inspection;
# older ones drop off, so a long run's memory stays flat (the trace has every batch).
RECENT = 4096


def least_loaded(outstanding: Sequence[int]) -> int:
  """The instance to route to: least outstanding tokens, lowest index on ties."""
  return int(np.argmin(outstanding))


class Instance:
  """One sampler on its devices: a queue and at most one batch in flight."""

  def __init__(self, name: str, devices: tuple[int, ...],
               sampler: Sampler | AdapterSampler):
    """`name`: the instance's slot (its first agent and index); it keeps it when it
    moves to another agent."""
    self.name, self.devices, self.sampler = name, devices, sampler
    self.queue: collections.deque[Request] = collections.deque()
    self.running: list[Request] = []
    self.pending: PendingSamples | None = None
    self.versions: list[int] = []  # the running batch's, one per request
    self.started = 0.0
    # (start, end) of its last RECENT batches; (agent, seconds queued) of the requests
    # they started
    self.busy: collections.deque[tuple[float, float]] = collections.deque(maxlen=RECENT)
    self.waits: collections.deque[tuple[str, float]] = collections.deque(maxlen=RECENT)

  @property
  def outstanding(self) -> int:
    return sum(r.cost for r in self.queue) + sum(r.cost for r in self.running)

  def outstanding_of(self, agent: str) -> int:
    """The tokens `agent`'s requests occupy here (all of them, but on a shared instance)."""
    return sum(r.cost for r in (*self.queue, *self.running) if r.agent == agent)

  @property
  def sampler(self) -> Sampler | AdapterSampler:
    return self._sampler

  @sampler.setter
  def sampler(self, sampler: Sampler | AdapterSampler) -> None:
    self._sampler = sampler
    # Does it serve several agents' adapters? Set once: a check against the protocol
    # costs ≈25 µs, and the rollout loop asks many times a step.
    self.shared = isinstance(sampler, AdapterSampler)

  def version_of(self, agent: str) -> int:
    """The version `agent`'s next rows here are sampled with."""
    return self.sampler.version_of(agent) if self.shared else self.sampler.version

  def serve(self, agent: str, weights: Weights) -> None:
    """Serve `agent`'s `weights` from the next batch on (on a shared instance, in its
    adapter slot only)."""
    if self.shared:
      self.sampler.update_adapter(agent, weights.params, weights.version)
    else:
      self.sampler.update_weights(weights.params, weights.version)

  @property
  def idle(self) -> bool:
    return self.pending is None and not self.queue

  def submit_next(self, keys: Callable[[Request, int], np.ndarray], sampling: SamplingParams,
                  max_batch: int, now: float) -> None:
    """Start the next batch: queued requests in arrival order, up to `max_batch` rows
    (at least one request). `keys(request, version)` gives its rows' PRNG keys."""
    if self.pending is not None or not self.queue:
      return
    batch = [self.queue.popleft()]
    rows = batch[0].n
    while self.queue and rows + self.queue[0].n <= max_batch:
      rows += self.queue[0].n
      batch.append(self.queue.popleft())
    self.versions = [self.version_of(r.agent) for r in batch]
    prompts = [r.prompt_ids for r in batch for _ in range(r.n)]
    all_keys = np.concatenate([keys(r, v) for r, v in zip(batch, self.versions)])
    limits = np.array([r.max_new_tokens or sampling.max_new_tokens
                       for r in batch for _ in range(r.n)], np.int32)
    self.running, self.started = batch, now
    self.waits.extend((r.agent, now - r.enqueued) for r in batch)
    if self.shared:
      self.pending = self.sampler.submit(prompts, all_keys, sampling,
                                         [r.agent for r in batch for _ in range(r.n)], limits)
    else:
      self.pending = self.sampler.submit(prompts, all_keys, sampling, limits=limits)

  def collect(self, now: float) -> tuple[list[Request], SampleBatch, list[int]]:
    """The finished batch: its requests, the samples (rows in request order), and the
    version each request was sampled with."""
    out = self.pending.result()
    batch, self.running, self.pending = self.running, [], None
    self.busy.append((self.started, now))
    return batch, out, self.versions


# (an instance's sampler, this agent's weights) -> whether the sampler now serves this
# agent, moved in place (else a new sampler must be made).
Retarget = Callable[[Sampler, Weights], bool]


class InstancePool:
  """An agent's rollout instances and the weights they serve (the agent's `WeightSink`).

  `make_sampler(devices, weights)` builds a sampler of this agent's model on `devices`
  serving `weights`, for an instance that joins the pool from another agent, unless
  `retarget` moves that instance's own sampler over (a vLLM engine between agents of
  one architecture: one weight sync instead of a new engine)."""

  def __init__(self, agent: str, instances: list[Instance],
               make_sampler: Callable[[tuple[int, ...], Weights], Sampler] | None,
               weights: Weights | None = None, sticky: bool = False,
               retarget: Retarget | None = None):
    self.agent, self.instances, self.make_sampler = agent, instances, make_sampler
    self.weights, self.sticky, self.retarget = weights, sticky, retarget
    self._conversation: dict[str, Instance] = {}

  @property
  def outstanding(self) -> int:
    """Tokens of this agent's requests on its instances (not those of agents it shares
    an instance with)."""
    return sum(i.outstanding_of(self.agent) for i in self.instances)

  def publish(self, weights: Weights) -> None:
    """Every instance serves `weights` from its next batch on."""
    self.weights = weights
    for inst in self.instances:
      inst.serve(self.agent, weights)

  def route(self, request: Request) -> Instance:
    """Queue `request` on the least-loaded instance (or its conversation's, if sticky)."""
    inst = self._conversation.get(request.query_id) if self.sticky else None
    if inst is None or inst not in self.instances:
      inst = self.instances[least_loaded([i.outstanding for i in self.instances])]
    if self.sticky:
      self._conversation[request.query_id] = inst
    inst.queue.append(request)
    return inst

  def forget(self, query_id: str) -> None:
    self._conversation.pop(query_id, None)

  def release(self) -> Instance | None:
    """Take out an instance for another agent: an idle one, else None (try later).
    Never the last one, nor one it shares with other agents."""
    idle = [i for i in self.instances if i.pending is None and not i.shared]
    if len(self.instances) < 2 or not idle:
      return None
    inst = min(idle, key=lambda i: i.outstanding)
    self.instances.remove(inst)
    queued, inst.queue = list(inst.queue), collections.deque()
    for r in queued:
      self.route(r)
    return inst

  def adopt(self, inst: Instance) -> None:
    """Serve this agent from `inst`: its sampler moved over with this agent's current
    weights (`retarget`), or a new one on its devices."""
    if self.retarget is None or not self.retarget(inst.sampler, self.weights):
      inst.sampler.close()
      inst.sampler = self.make_sampler(inst.devices, self.weights)
    self.instances.append(inst)
