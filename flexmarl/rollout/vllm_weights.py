"""Trainer params straight into a running vLLM model's own tensors (the fast weight sync).

vLLM keeps a Llama/Qwen2 model with fused projections (q|k|v in `qkv_proj`, gate|up in
`gate_up_proj`). On CPU, once loaded, every linear layer's weight is repacked into a GEMM
handle (oneDNN or sgl-kernel) and the plain tensor dropped; the LM head keeps its
tensor and gets a handle too (`dispatch_cpu_unquantized_gemm`). vLLM's layer-wise
`reload_weights` rebuilds all of that through the full loader (≈12 s for a 0.5B model
on two CPU cores), and its kernel-format reload (`is_checkpoint_format=False`) copies
into tensors that on CPU no longer exist. Here instead:

- `kernel_weights` converts our params into the fused layout on the device: one
  concatenation per fused projection; linear weights stay [in, out], the layout the GEMM
  handle is made from (`create_onednn_mm(weight.t())`), so nothing is transposed;
- `install` (inside the vLLM worker) copies each tensor into its parameter in place; a
  layer whose weight lives in a GEMM handle gets the new weight and its own quant method
  makes the handle again (the step vLLM's loader ends with), which packs a copy;
- `describe` and `mismatch` say up front whether an engine's model is one this covers
  (names, shapes, unquantized layers, eager mode); when not, the caller falls back to
  the full reload.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flexmarl.models import hf, lora
from flexmarl.models.transformer import ModelConfig

# The quant methods whose weights are plain tensors (or one GEMM handle made from them).
PLAIN_METHODS = ('UnquantizedLinearMethod', 'UnquantizedEmbeddingMethod')


def kernel_weights(cfg: ModelConfig, params: dict) -> Iterator[tuple[str, jax.Array]]:
  """(vLLM parameter name, array) for every parameter, in the layout vLLM keeps: fused
  q|k|v and gate|up, linear weights as [in, out], embeddings [vocab, hidden]. A LoRA
  model's adapters are merged into its weights."""
  params = lora.merged(params, cfg.lora)
  flat = lambda w: w.reshape(w.shape[0], -1)  # [hidden, heads, head_dim] → [hidden, heads·head_dim]
  yield 'model.embed_tokens.weight', params['embed']
  yield 'model.norm.weight', params['norm']['scale']
  if not cfg.tie_embeddings:
    yield 'lm_head.weight', params['lm_head'].T
  for i in range(cfg.layers):
    block, name = params['blocks'][i], f'model.layers.{i}.'
    attn, mlp = block['attn'], block['mlp']
    yield name + 'input_layernorm.weight', block['attn_norm']['scale']
    yield name + 'post_attention_layernorm.weight', block['mlp_norm']['scale']
    yield name + 'self_attn.qkv_proj.weight', jnp.concatenate(
        [flat(attn['q']), flat(attn['k']), flat(attn['v'])], axis=1)
    if cfg.qkv_bias:
      yield name + 'self_attn.qkv_proj.bias', jnp.concatenate(
          [attn[f'{p}_bias'].reshape(-1) for p in 'qkv'])
    yield name + 'self_attn.o_proj.weight', attn['o'].reshape(-1, attn['o'].shape[-1])
    yield name + 'mlp.gate_up_proj.weight', jnp.concatenate([mlp['gate'], mlp['up']], axis=1)
    yield name + 'mlp.down_proj.weight', mlp['down']


def host_weights(cfg: ModelConfig, params: dict, dtype: str) -> Iterator[tuple[str, np.ndarray]]:
  """`kernel_weights` cast to `dtype`, one host array at a time (on a single CPU device
  each shares its device buffer)."""
  for name, value in kernel_weights(cfg, params):
    yield name, np.asarray(value.astype(dtype))


def kernel_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """The shape of every array `kernel_weights` yields for `cfg` (nothing computed)."""
  abstract = hf.abstract_params(cfg)[1]
  shapes = jax.eval_shape(lambda p: dict(kernel_weights(cfg, p)), nnx.to_pure_dict(abstract))
  return {name: tuple(s.shape) for name, s in shapes.items()}


def mismatch(ours: Mapping[str, tuple[int, ...]], engine: Mapping[str, tuple[int, ...]],
             problems: Iterable[str] = ()) -> str | None:
  """Why our arrays cannot be copied into the engine's parameters (None: they can).
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


def describe(worker) -> tuple[dict[str, tuple[int, ...]], list[str]]:
  """Runs inside the vLLM worker: (name → the shape `install` takes, reasons to refuse).
  Linear weights are [in, out]; an embedding's rows are its real vocabulary (vLLM pads
  them to a multiple of 64 and keeps the padding at zero)."""
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
      shapes[name] = (module.input_size_per_partition, module.output_size_per_partition)
    elif _is_embedding(module):
      shapes[name] = (module.org_vocab_size,) + tuple(param.shape[1:])
    else:
      shapes[name] = tuple(param.shape)
  return shapes, problems


def install(worker, weights: Iterable[tuple[str, 'torch.Tensor']]) -> None:  # noqa: F821
  """Runs inside the vLLM worker: every (name, tensor) of `host_weights` into its
  parameter, checked beforehand by `describe`/`mismatch`. A weight that lives in a GEMM
  handle becomes the layer's weight and its quant method packs a new handle from it (as
  at load); every other tensor is copied in place. Handles made from a copied tensor
  (the LM head's, tied or not) are made again at the end. Our tensors may share JAX's
  buffers: none is kept past this call."""
  import torch
  model = worker.model_runner.get_model()
  copied = set()
  for name, tensor in weights:
    module_name, _, attr = name.rpartition('.')
    module = model.get_submodule(module_name)
    if _is_linear(module) and attr == 'weight':
      tensor = tensor.t()  # [out, in], as vLLM's loader leaves it
      if hasattr(module, 'cpu_linear'):
        module.weight = torch.nn.Parameter(tensor, requires_grad=False)
        module.quant_method.process_weights_after_loading(module)
        if module.weight.data_ptr() == tensor.data_ptr():  # the handle kept the tensor
          module.weight = torch.nn.Parameter(tensor.clone(), requires_grad=False)
        continue
    param = getattr(module, attr)
    param.data[:tensor.shape[0]].copy_(tensor)  # an embedding's padded rows stay zero
    copied.add(param)
  for module in model.modules():
    if (hasattr(module, 'cpu_linear') and not _is_linear(module)
        and any(p in copied for p in module.parameters(recurse=False))):
      module.quant_method.process_weights_after_loading(module)
