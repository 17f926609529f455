"""What the simulator knows about models and accelerators, with where each figure comes from.

Model shapes are the published Hugging Face configs (config.json of Qwen/Qwen2.5-14B and
Qwen/Qwen2.5-32B); parameter counts are computed from them, and equal the tensor sizes
of the published safetensors (14,770,033,664 and 32,763,876,352; the model cards round
them to 14.7B and 32.5B).

The paper runs on 48 nodes x 16 accelerators of 64 GB without naming the part. A node of
eight dual-die Ascend 910C packages is 16 dies of 64 GB each, so `ASCEND_910C_DIE` models
one die with half a package's published figures. Swap it for another `Accelerator` to
plan for other hardware.
"""

from __future__ import annotations

import dataclasses

GB = 1e9


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A decoder-only transformer (Qwen2 layout: QKV bias, SwiGLU, RMSNorm)."""

  name: str
  layers: int
  hidden: int
  intermediate: int
  heads: int
  kv_heads: int
  vocab: int
  tied_embeddings: bool = False

  @property
  def head_dim(self) -> int:
    return self.hidden // self.heads

  @property
  def params(self) -> int:
    kv = self.kv_heads * self.head_dim
    attention = 2 * self.hidden * self.hidden + 2 * self.hidden * kv + self.hidden + 2 * kv
    mlp = 3 * self.hidden * self.intermediate
    layer = attention + mlp + 2 * self.hidden  # two RMSNorm scales
    embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
    return self.layers * layer + embeddings + self.hidden  # final norm

  def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
    """KV-cache bytes one token of context holds (keys and values, every layer)."""
    return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


# huggingface.co/Qwen/Qwen2.5-14B/blob/main/config.json
QWEN25_14B = ModelSpec('Qwen2.5-14B', layers=48, hidden=5120, intermediate=13824, heads=40,
                       kv_heads=8, vocab=152064)
# huggingface.co/Qwen/Qwen2.5-32B/blob/main/config.json
QWEN25_32B = ModelSpec('Qwen2.5-32B', layers=64, hidden=5120, intermediate=27648, heads=40,
                       kv_heads=8, vocab=152064)
MODELS = {'qwen2.5-14b': QWEN25_14B, 'qwen2.5-32b': QWEN25_32B}


@dataclasses.dataclass(frozen=True)
class Accelerator:
  name: str
  memory_bytes: float      # device memory
  peak_flops: float        # dense BF16 FLOP/s
  hbm_bytes_per_s: float   # device memory bandwidth
  network_bytes_per_s: float  # scale-out NIC bandwidth per device, one direction


ASCEND_910C_DIE = Accelerator(
    'ascend-910c-die',
    memory_bytes=64 * GB,  # the paper: accelerators of 64 GB (a 910C package holds 128 GB)
    # 780 TFLOPS BF16 and 3.2 TB/s HBM2E per 910C package (TechPowerUp, 2025-04-21), halved:
    peak_flops=780e12 / 2,
    hbm_bytes_per_s=3.2e12 / 2,
    # RoCE v2 2 x 100 Gb/s per Ascend 910 chip (Hot Chips 2019), taken as the per-die NIC share.
    network_bytes_per_s=200e9 / 8,
)
ACCELERATORS = {ASCEND_910C_DIE.name: ASCEND_910C_DIE}


def model(name: str) -> ModelSpec:
  if name not in MODELS:
    raise ValueError(f'model={name!r} is unknown to the simulator; use one of {sorted(MODELS)} '
                     'or add its config to flexmarl/sim/specs.py.')
  return MODELS[name]


def accelerator(name: str) -> Accelerator:
  if name not in ACCELERATORS:
    raise ValueError(f'accelerator={name!r} is unknown to the simulator; use one of '
                     f'{sorted(ACCELERATORS)} or add it to flexmarl/sim/specs.py.')
  return ACCELERATORS[name]
