"""Simulated rollout instances: the sampler interface, answered by cost models in simulated time.

A `SimSampler` is one inference instance. A submitted batch waits for the batches and
weight syncs before it (the instance serves them in order), then takes
`costs.generation_time` of its response lengths; the pending it returns carries that
`finish_time`, so `SimClock.wait_any` jumps to it. Each row's response length is drawn
from the agent's lognormal length distribution seeded by the row's own key, so a row's
length never depends on its batch. The tokens are placeholders (ids >= 3, logprob -1):
the simulator counts time, not text.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

import numpy as np

from flexmarl.core.clock import SimClock, SimPending
from flexmarl.metrics import spans
from flexmarl.metrics.spans import SpanRecorder
from flexmarl.models.layout import bucket
from flexmarl.rollout.sampler import SampleBatch, SamplingParams
from flexmarl.sim.cores import SharedCores
from flexmarl.sim.costs import DecodeRates, generation_time
from flexmarl.sim.devices import CompileCache


def response_lengths(keys: np.ndarray, median: float, sigma: float, max_tokens: int) -> np.ndarray:
  """One lognormal length per row key (uint32[B, 2]), in [1, max_tokens]."""
  out = np.empty(len(keys), np.int32)
  for i, key in enumerate(np.asarray(keys, np.uint32)):
    draw = np.random.default_rng([int(k) for k in key]).lognormal(np.log(median), sigma)
    out[i] = min(max_tokens, max(1, int(round(draw))))
  return out


class SimSamples(SimPending):
  """A submitted batch: done at `finish_time`; `result()` is its SampleBatch."""

  def __init__(self, clock: SimClock, start_time: float, finish_time: float, version: int,
               value: SampleBatch):
    super().__init__(clock, finish_time, value)
    self.start_time = start_time
    self.version = version


class SimSampler:
  """One simulated instance serving `agent` at `rates`.

  response_tokens: {'median', 'sigma', 'max'} of the agent's response lengths (tokens).
  sync_s: seconds a weight update keeps the instance busy (costs.weight_sync_time).
  recorder/track: where its generate and weight-sync spans go (optional).
  padded_rows: 0 charges the rows' own lengths (an engine that drops finished rows);
  n > 0 charges as the embedded JAX sampler computes: the batch padded to a power of
  two of at least n rows, every row decoding until the longest ends.
  cores: a `SharedCores` the instance's work also waits for (devices on shared cores).
  compile: the team's `CompileCache` and this instance's key in it (model and shape): the
  first generate call of a key also compiles.
  """

  def __init__(self, clock: SimClock, rates: DecodeRates, response_tokens: Mapping[str, float],
               sync_s: float = 0.0, *, agent: str = '', vocab: int = 64, version: int = 0,
               recorder: SpanRecorder | None = None, track: str = '', padded_rows: int = 0,
               cores: SharedCores | None = None,
               compile: tuple[CompileCache, Hashable] | None = None):
    missing = {'median', 'sigma', 'max'} - set(response_tokens)
    if missing:
      raise ValueError(f'response_tokens={dict(response_tokens)} lacks {sorted(missing)}; give '
                       'median, sigma and max (tokens) of the lognormal response length.')
    if recorder is not None and not track:
      raise ValueError(f'SimSampler for agent {agent!r}: a recorder needs a track name, e.g. '
                       f"'rollout:{agent}/0'.")
    self.clock = clock
    self.rates = rates
    self.response_tokens = dict(response_tokens)
    self.sync_s = sync_s
    self.padded_rows, self.cores, self.compile = padded_rows, cores, compile
    self.agent = agent
    self.vocab = vocab
    self.version = version
    self.recorder = recorder
    self.track = track
    self.busy_until = clock.now()
    self.closed = False

  def _reserve(self, seconds: float, earliest: float = 0.0) -> tuple[float, float]:
    """The instance's next free interval of `seconds` from `earliest` on, in submission
    order."""
    if self.closed:
      raise RuntimeError(f'SimSampler {self.track or self.agent!r} is closed.')
    start = max(self.clock.now(), self.busy_until, earliest)
    if self.cores is not None:
      start, _ = self.cores.reserve(start, seconds)
    self.busy_until = start + seconds
    return start, self.busy_until

  def submit(self, prompts: list[list[int]], keys: np.ndarray, params: SamplingParams,
             limits: np.ndarray | None = None) -> SimSamples:
    keys = np.asarray(keys)
    if keys.shape != (len(prompts), 2):
      raise ValueError(f'keys has shape {keys.shape}; pass one uint32[2] key per prompt: '
                       f'({len(prompts)}, 2).')
    cap = min(int(self.response_tokens['max']), params.max_new_tokens)
    lengths = response_lengths(keys, self.response_tokens['median'],
                               self.response_tokens['sigma'], cap)
    if limits is not None:
      lengths = np.minimum(lengths, limits)
    prompt_tokens = sum(len(p) for p in prompts)
    charged = lengths
    if self.padded_rows and len(lengths):
      charged = np.full(bucket(max(len(lengths), self.padded_rows)), lengths.max())
    seconds = generation_time(charged, prompt_tokens, self.rates)
    if self.compile is not None:
      cache, key = self.compile
      seconds += cache.cost(key)
    start, finish = self._reserve(seconds)
    if self.recorder is not None:
      self.recorder.add(self.track, spans.GENERATE, start, finish, agent=self.agent,
                        version=self.version, tokens=int(lengths.sum()), rows=len(prompts))
    return SimSamples(self.clock, start, finish, self.version, self._batch(keys, lengths))

  def _batch(self, keys: np.ndarray, lengths: np.ndarray) -> SampleBatch:
    width = int(lengths.max()) if len(lengths) else 0
    valid = np.arange(width)[None, :] < lengths[:, None]
    seed = [int(k) for k in np.asarray(keys, np.uint32).reshape(-1)]
    ids = np.random.default_rng(seed).integers(3, self.vocab, (len(lengths), width), np.int32)
    return SampleBatch(np.where(valid, ids, 0).astype(np.int32),
                       np.where(valid, -1.0, 0.0).astype(np.float32), lengths)

  def update_weights(self, state: Any, version: int) -> None:
    """Takes `sync_s` after what is queued and once the weights are ready (a
    `SimTrainer`'s `params` say when); batches submitted later see `version`."""
    # The simulator moves no weights, it only charges their transfer time.
    ready = float(state['ready_s']) if isinstance(state, Mapping) and 'ready_s' in state else 0.0
    start, end = self._reserve(self.sync_s, ready)
    if self.recorder is not None:
      self.recorder.add(self.track, spans.WEIGHT_SYNC, start, end, agent=self.agent,
                        version=version)
    self.version = version

  def serve(self, model_cfg: Any, params: Any, version: int, **tokens: Any) -> bool:
    """False: a simulated instance that moves to another agent is made anew."""
    return False

  def close(self) -> None:
    self.closed = True
