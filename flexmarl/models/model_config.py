"""The architecture of one policy (`ModelConfig`), its dtypes and the named sizes.

Kept apart from the decoder's code: configs are read, checked and compared (a LoRA
team's shared base, a resumed workdir) by parts that never build a model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flexmarl.models.lora import LoRAConfig
from flexmarl.models.rope import ROPE_SCALING_TYPES

DTYPES = ('float32', 'bfloat16', 'float16')


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of one policy. Defaults are the ≈100k-parameter test size."""

  vocab_size: int = 64
  hidden: int = 64
  layers: int = 2
  heads: int = 4
  kv_heads: int = 2
  head_dim: int = 16
  mlp: int = 128
  rope_theta: float = 10000.0
  # HF `rope_scaling` as sorted (key, value) pairs (hashable); () for plain RoPE.
  # Supported types: 'linear' and 'llama3' (see `rope_frequencies`).
  rope_scaling: tuple[tuple[str, Any], ...] = ()
  norm_eps: float = 1e-6
  qkv_bias: bool = True  # Qwen2 has q/k/v biases; Llama does not.
  tie_embeddings: bool = True
  dtype: str = 'float32'
  # Run the layers as one `lax.scan` over their stacked weights: a program compiles in a
  # time that does not grow with depth (a 30-layer model's train step and sampler in
  # seconds, not minutes), for a copy of the blocks' weights per call (`stacked_layers`).
  scan_layers: bool = False
  # Keep only each layer's input for the backward and recompute the rest (gradient
  # checkpointing): a train step's activation memory falls from every layer's insides to
  # one layer's, for one more forward pass of each layer. For long prompts (turns of a
  # conversation) on a large model; the sampler is unchanged. Needs `scan_layers`: the
  # unrolled program measured only 10 % less (tests/test_scan_layers.py), the scan 50-80 %
  # (3 to 12 layers).
  remat: bool = False
  # The frozen base's weights in this dtype ('': `dtype`), e.g. 'bfloat16' under fp32
  # adapters and compute: half the memory of the largest tensors for a rounding of the
  # base (LoRA agents only; a full agent trains its weights in `dtype`).
  base_dtype: str = ''
  lora: LoRAConfig = LoRAConfig()  # adapters on a frozen base (rank 0: none)

  def __post_init__(self):
    if self.heads % self.kv_heads:
      raise ValueError(
          f'model.heads={self.heads} is not a multiple of model.kv_heads='
          f'{self.kv_heads}: grouped-query attention shares each KV head among '
          'a whole number of query heads. Pick kv_heads dividing heads.')
    if self.remat and not self.scan_layers:
      raise ValueError('model.remat=True needs model.scan_layers=True: it recomputes the '
                       'scanned layer; set both.')
    scaling = dict(self.rope_scaling)
    kind = scaling.get('rope_type', scaling.get('type', 'default'))
    if kind not in ROPE_SCALING_TYPES:
      raise ValueError(
          f'model.rope_scaling type {kind!r} is not supported (supported: '
          f'{list(ROPE_SCALING_TYPES)}); use a checkpoint without it or add its '
          'frequencies to flexmarl.models.rope.rope_frequencies.')
    for name, value, allowed in (('dtype', self.dtype, DTYPES),
                                 ('base_dtype', self.base_dtype, ('',) + DTYPES)):
      if value not in allowed:
        raise ValueError(f'model.{name}={value!r} is not a dtype here; choose one of '
                         f'{list(allowed)}.')
    if self.base_dtype not in ('', self.dtype) and not self.lora.rank:
      raise ValueError(
          f'model.base_dtype={self.base_dtype!r} differs from model.dtype={self.dtype!r} '
          'but the model has no adapters (model.lora.rank=0): a full-parameter agent '
          'trains its base in model.dtype. Set base_dtype to \'\' or give it adapters.')

  @property
  def weights_dtype(self) -> str:
    """The dtype of the base's weights (the adapters' and the compute's: `dtype`)."""
    return self.base_dtype or self.dtype

  @property
  def without_adapters(self) -> ModelConfig:
    """The model a LoRA model's frozen base is: no adapters, its weights in
    `weights_dtype` (what a shared base is keyed by, loaded as and sized as)."""
    return dataclasses.replace(self, lora=LoRAConfig(), dtype=self.weights_dtype,
                               base_dtype='')


# Named sizes, from the test size up to the Qwen2.5-0.5B shape.
PRESETS: dict[str, dict[str, Any]] = {
    'tiny': dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, mlp=128),
    'small': dict(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, mlp=256),
    'base': dict(hidden=256, layers=4, heads=8, kv_heads=4, head_dim=32, mlp=768),
    'qwen2.5-0.5b': dict(vocab_size=151936, hidden=896, layers=24, heads=14,
                         kv_heads=2, head_dim=64, mlp=4864, rope_theta=1e6,
                         norm_eps=1e-6, tie_embeddings=True),
}
