"""Trainer params straight into a running vLLM model's own tensors (the fast weight sync).

vLLM keeps a Llama/Qwen2 model with fused projections (q|k|v in `qkv_proj`, gate|up in
`gate_up_proj`). On CPU, once loaded, every linear layer's weight is repacked into a GEMM
handle (oneDNN or sgl-kernel) and the plain tensor dropped; the LM head keeps its
tensor and gets a handle too (`dispatch_cpu_unquantized_gemm`). vLLM's layer-wise
`reload_weights` rebuilds all of that through the full loader (≈7–12 s for a 0.5B
model on two CPU cores), and its kernel-format reload (`is_checkpoint_format=False`)
copies into tensors that on CPU no longer exist. Here instead:

- `kernel_weights` names, for every vLLM parameter, the parts of our params it is made
  of, as views: no copy, no transpose (our [in, out] matrices seen as [out, in]);
- `install` (inside the vLLM worker) copies the parts into each parameter in place; for
  a layer whose weight lives in a GEMM handle, the weight (fused parts assembled in a
  scratch buffer reused from layer to layer) is handed to the layer's own quant method,
  which packs a new handle from it as at load;
- `describe` and `mismatch` say up front whether an engine's model is one this covers
  (names, shapes, unquantized layers, eager mode); when not, the caller falls back to
  the full reload.

What a sync still costs is vLLM's own repack into new handles (fresh memory each time,
so page faults too) and assembling the fused weights (`experiments/benchmarks/vllm_sync.py`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import jax
import numpy as np
from flax import nnx

from flexmarl.models import hf, lora, transformer
from flexmarl.models.transformer import ModelConfig

# The quant methods whose weights are plain tensors (or one GEMM handle made from them).
PLAIN_METHODS = ('UnquantizedLinearMethod', 'UnquantizedEmbeddingMethod')

Parts = list  # arrays stacked along axis 0 make the parameter


def kernel_weights(cfg: ModelConfig, params: dict) -> Iterator[tuple[str, Parts]]:
  """(vLLM parameter name, its parts) for every parameter: arrays that, stacked along
  axis 0, make it in vLLM's layout ([out, in] weights, q|k|v and gate|up fused, an
  embedding's real rows). Only reshapes and transposes: on host arrays, all views."""
  rows = lambda w: w.reshape(w.shape[0], -1).T  # ours [in, ...] → [out, in]
  yield 'model.embed_tokens.weight', [params['embed']]
  yield 'model.norm.weight', [params['norm']['scale']]
  if not cfg.tie_embeddings:
    yield 'lm_head.weight', [params['lm_head'].T]
  for i in range(cfg.layers):
    block, name = params['blocks'][i], f'model.layers.{i}.'
    attn, mlp = block['attn'], block['mlp']
    yield name + 'input_layernorm.weight', [block['attn_norm']['scale']]
    yield name + 'post_attention_layernorm.weight', [block['mlp_norm']['scale']]
    yield name + 'self_attn.qkv_proj.weight', [rows(attn[p]) for p in 'qkv']
    if cfg.qkv_bias:
      yield name + 'self_attn.qkv_proj.bias', [attn[f'{p}_bias'].reshape(-1) for p in 'qkv']
    yield name + 'self_attn.o_proj.weight', [attn['o'].reshape(-1, attn['o'].shape[-1]).T]
    yield name + 'mlp.gate_up_proj.weight', [mlp['gate'].T, mlp['up'].T]
    yield name + 'mlp.down_proj.weight', [mlp['down'].T]


def host_weights(cfg: ModelConfig, params: dict) -> Iterator[tuple[str, Parts]]:
  """`kernel_weights` of host arrays (a LoRA model's adapters merged first); on a single
  CPU device each shares its JAX buffer."""
  host = jax.tree.map(np.asarray, lora.merged(params, cfg.lora))
  return kernel_weights(cfg, host)


def _stacked(parts: Parts) -> tuple[int, ...]:
  return (sum(p.shape[0] for p in parts),) + tuple(parts[0].shape[1:])


def kernel_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """The shape of every parameter `kernel_weights` makes for `cfg` (nothing computed)."""
  abstract = nnx.to_pure_dict(transformer.abstract_model(cfg)[1])
  parts = jax.eval_shape(lambda p: dict(kernel_weights(cfg, p)), abstract)
  return {name: _stacked(p) for name, p in parts.items()}


def mismatch(ours: Mapping[str, tuple[int, ...]], engine: Mapping[str, tuple[int, ...]],
             problems: Iterable[str] = ()) -> str | None:
  """Why our params cannot be copied into the engine's parameters (None: they can).
  `engine`: what `describe` found; `problems`: its reasons to refuse."""
  problems = list(problems)
  if problems:
    return '; '.join(problems)
  missing, extra = sorted(set(engine) - set(ours)), sorted(set(ours) - set(engine))
  if missing or extra:
    return (f'the names differ (vLLM has {missing[:3]} that we lack, we have {extra[:3]} '
            'that vLLM lacks)')
  wrong = [f'{n}: ours {ours[n]}, vLLM {engine[n]}' for n in ours if ours[n] != engine[n]]
  return f'the shapes differ ({"; ".join(wrong[:3])})' if wrong else None


# --- inside the vLLM worker ------------------------------------------------------


def _is_linear(module) -> bool:
  from vllm.model_executor.layers.linear import LinearBase
  return isinstance(module, LinearBase)


def _is_embedding(module) -> bool:
  from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
  return isinstance(module, VocabParallelEmbedding)


def _is_lm_head(module) -> bool:
  from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
  return isinstance(module, ParallelLMHead)


def describe(worker) -> tuple[dict[str, tuple[int, ...]], list[str]]:
  """Runs inside the vLLM worker: (name → the shape `install` fills, reasons to refuse).
  A linear weight is [out, in] even where its tensor was dropped for a GEMM handle; an
  embedding's rows are its real vocabulary (vLLM pads them to a multiple of 64 and keeps
  the padding at zero)."""
  from vllm.platforms import current_platform
  model = worker.model_runner.get_model()
  problems = []
  if worker.model_config.quantization:
    problems.append(f'the model is quantized ({worker.model_config.quantization})')
  if current_platform.is_cpu() and not worker.model_config.enforce_eager:
    problems.append('the engine compiles its graph (enforce_eager=False), which may hold '
                    'on to the GEMM handles')
  if current_platform.is_zen_cpu():
    problems.append('zentorch GEMM handles may share the weight tensor')
  if worker.parallel_config.world_size > 1:
    problems.append(f'the engine is sharded over {worker.parallel_config.world_size} workers')
  shapes = {}
  for name, param in model.named_parameters():  # a tied LM head: under the embedding's name
    module = model.get_submodule(name.rpartition('.')[0])
    method = type(getattr(module, 'quant_method', None)).__name__
    if hasattr(module, 'quant_method') and method not in PLAIN_METHODS:
      problems.append(f'{name} is served by {method}')
    if _is_linear(module) and name.endswith('.weight'):
      shapes[name] = (module.output_size_per_partition, module.input_size_per_partition)
    elif _is_embedding(module):
      shapes[name] = (module.org_vocab_size,) + tuple(param.shape[1:])
    else:
      shapes[name] = tuple(param.shape)
  return shapes, problems


def install(worker, weights: Iterable[tuple[str, Parts]]) -> None:
  """Runs inside the vLLM worker: the parts of every parameter (`host_weights`, checked
  by `describe`/`mismatch`) into the model. A weight that lives in a GEMM handle becomes
  the layer's weight and its quant method packs a new handle from it (as at load); every
  other parameter is copied in place. The LM head's handle (tied or not) is made again
  at the end; the one vLLM also makes for the input embedding is left: the embedding
  looks rows up and never calls it. Our arrays may share JAX's buffers: none is
  kept past this call."""
  import torch
  model = worker.model_runner.get_model()
  dtype = worker.model_config.dtype
  scratch: dict[tuple, torch.Tensor] = {}  # [in, out] buffers, one per shape, reused
  copied = set()
  for name, parts in weights:
    module_name, _, attr = name.rpartition('.')
    module = model.get_submodule(module_name)
    parts = [to_torch(p) for p in parts]
    if _is_linear(module) and attr == 'weight' and hasattr(module, 'cpu_linear'):
      module.weight = torch.nn.Parameter(_assembled(parts, dtype, scratch), requires_grad=False)
      module.quant_method.process_weights_after_loading(module)
      if any(module.weight.data_ptr() == t.data_ptr() for t in [*parts, *scratch.values()]):
        module.weight = torch.nn.Parameter(module.weight.clone(), requires_grad=False)
      continue
    param = getattr(module, attr)
    start = 0
    for part in parts:  # an embedding's padded rows stay zero
      param.data[start:start + part.shape[0]].copy_(part)
      start += part.shape[0]
    copied.add(param)
  for module in model.modules():  # the input embedding's handle is never called: not remade
    if (_is_lm_head(module) and hasattr(module, 'cpu_linear')
        and any(p in copied for p in module.parameters(recurse=False))):
      module.quant_method.process_weights_after_loading(module)


def to_torch(array: np.ndarray):
  """Shares `array`'s memory. It may be a read-only view of a JAX buffer: only read
  from, so torch's warning about non-writable arrays is silenced."""
  import warnings

  import torch
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', UserWarning)
    if array.dtype.name == 'bfloat16':  # numpy has no bfloat16; reinterpret the bits
      return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _assembled(parts: list, dtype, scratch: dict):
  """The [out, in] weight of `parts`: the one part itself when it needs no cast, else
  the parts copied (and cast) into a scratch [in, out] buffer, seen as [out, in] — the
  layout a GEMM handle is made from (`create_onednn_mm(weight.t())`)."""
  import torch
  if len(parts) == 1 and parts[0].dtype == dtype:
    return parts[0]
  rows, cols = sum(p.shape[0] for p in parts), parts[0].shape[1]
  key = (cols, rows, dtype)
  if key not in scratch:
    scratch[key] = torch.empty(cols, rows, dtype=dtype)
  weight = scratch[key].t()
  start = 0
  for part in parts:
    weight[start:start + part.shape[0]].copy_(part)
    start += part.shape[0]
  return weight
