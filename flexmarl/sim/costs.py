"""Cost models of the simulator: how long a generate call, a training micro-batch, a swap
and a weight sync take. Pure functions of sizes and rates; every constant says where it
comes from. Rates can be derived from an `Accelerator` (planning a cluster) or fitted to
measured throughputs (`rates_from_throughput`, to calibrate against a real machine).

Generation. One decode step of a batch reads every weight once (memory bound) and does
2·N FLOPs per sequence still running, so a step with b running sequences costs
`step_s + b·token_s`. Summed over the steps of a batch whose responses have lengths
L_1..L_B (a sequence leaves the batch when it ends), that is
  max(L)·step_s + sum(L)·token_s,
plus the prefill of the prompts at `prefill_token_s` per prompt token. KV-cache reads
and scheduling overheads are left out (they grow with context; calibrate if they matter).

Training. A token costs 6·N FLOPs forward and backward (Kaplan et al. 2020, "Scaling
Laws for Neural Language Models", C ≈ 6N per token), run at `mfu` of the mesh's peak.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from flexmarl.sim.specs import QWEN25_32B, Accelerator, ModelSpec

BF16_BYTES = 2
# What an idle agent's train state holds and a swap moves: bf16 weights, fp32 master
# weights, Adam's two fp32 moments (gradients are not kept between steps). The usual
# mixed-precision Adam layout (Rajbhandari et al. 2020, ZeRO: 16 bytes/param with grads).
TRAIN_STATE_BYTES_PER_PARAM = 2 + 4 + 4 + 4

# Assumed efficiencies, to be calibrated on the target hardware. Published dense-LLM
# training reaches 30-55 % MFU (PaLM 46.2 %, Chowdhery et al. 2022); RL micro-batches are
# short and padded, so the low end is taken.
TRAIN_MFU = 0.35
PREFILL_MFU = 0.35
# Decode is memory bound: inference engines read weights at a large fraction of HBM peak;
# the per-sequence compute of decode runs far below peak (small matmuls).
DECODE_HBM_EFFICIENCY = 0.7
DECODE_MFU = 0.2
# The paper: swapping a 32B agent's state in or out takes about 11 s (hidden behind rollout).
# The effective bandwidth that gives (per trainer), and per device assuming, as the paper's
# setups suggest but do not say, that the trainer was one node's 16 devices: 2.6 GB/s each.
PAPER_SWAP_S_32B = 11.0
SWAP_BYTES_PER_S = QWEN25_32B.params * TRAIN_STATE_BYTES_PER_PARAM / PAPER_SWAP_S_32B
PAPER_SWAP_DEVICES = 16
HOST_BYTES_PER_S_PER_DEVICE = SWAP_BYTES_PER_S / PAPER_SWAP_DEVICES


@dataclasses.dataclass(frozen=True)
class DecodeRates:
  """An inference instance's speed: seconds per decode step (weights read once), extra
  seconds per running sequence per step, seconds per prompt token of prefill, and
  seconds per generate call whatever its size (launch, padded prefill, fetching the
  result: negligible for large models, most of the cost for tiny ones)."""

  step_s: float
  token_s: float
  prefill_token_s: float
  call_s: float = 0.0

  def __post_init__(self):
    for field in dataclasses.fields(self):
      if getattr(self, field.name) < 0:
        raise ValueError(f'DecodeRates.{field.name}={getattr(self, field.name)} is negative; '
                         'rates are seconds and must be >= 0.')


def param_bytes(m: ModelSpec, dtype_bytes: int = BF16_BYTES) -> int:
  return m.params * dtype_bytes


def train_state_bytes(m: ModelSpec) -> int:
  return m.params * TRAIN_STATE_BYTES_PER_PARAM


def decode_rates(m: ModelSpec, accel: Accelerator, tp: int, step_overhead_s: float = 0.0
                 ) -> DecodeRates:
  """Rates of an instance of `m` tensor-parallel over `tp` devices of `accel`.
  step_overhead_s: a decode step's latency beyond reading the weights (kernel launches,
  the tensor-parallel all-reduces of every layer); not derived, to be measured or fitted."""
  if tp < 1 or step_overhead_s < 0:
    raise ValueError(f'tp={tp}, step_overhead_s={step_overhead_s}: an instance needs at '
                     'least one device, and an overhead is >= 0 seconds.')
  return DecodeRates(
      step_s=step_overhead_s + param_bytes(m) / (tp * accel.hbm_bytes_per_s
                                                 * DECODE_HBM_EFFICIENCY),
      token_s=2 * m.params / (tp * accel.peak_flops * DECODE_MFU),
      prefill_token_s=2 * m.params / (tp * accel.peak_flops * PREFILL_MFU))


def rates_from_throughput(tokens_per_s_1: float, tokens_per_s_b: float, b: int,
                          prefill_token_s: float = 0.0) -> DecodeRates:
  """Rates that reproduce two measured decode throughputs: at batch 1 and at batch b."""
  if b < 2 or not 0 < tokens_per_s_1 < tokens_per_s_b:
    raise ValueError(f'rates_from_throughput needs b >= 2 and 0 < tokens_per_s_1 < '
                     f'tokens_per_s_b (got b={b}, {tokens_per_s_1}, {tokens_per_s_b}): a larger '
                     'batch must decode more tokens per second.')
  t1, tb = 1 / tokens_per_s_1, b / tokens_per_s_b  # seconds per decode step
  token_s = (tb - t1) / (b - 1)
  return DecodeRates(t1 - token_s, token_s, prefill_token_s)


def generation_time(lengths: Sequence[int], prompt_tokens: int, rates: DecodeRates) -> float:
  """Seconds for one instance to serve a batch: the call, prefill, then decode until the
  longest ends."""
  if not len(lengths):
    return 0.0
  return (rates.call_s + max(lengths) * rates.step_s + sum(lengths) * rates.token_s
          + prompt_tokens * rates.prefill_token_s)


def decode_throughput(batch: int, rates: DecodeRates) -> float:
  """Tokens/s of a batch of equally long responses (prefill left out)."""
  return batch / (rates.step_s + batch * rates.token_s)


def train_flops(m: ModelSpec, tokens: int) -> float:
  return 6.0 * m.params * tokens


def train_time(m: ModelSpec, tokens: int, devices: int, accel: Accelerator,
               mfu: float = TRAIN_MFU) -> float:
  """Seconds of forward + backward over `tokens` on a mesh of `devices`."""
  if devices < 1 or not 0 < mfu <= 1:
    raise ValueError(f'train_time: devices={devices}, mfu={mfu}; need devices >= 1 and '
                     '0 < mfu <= 1.')
  return train_flops(m, tokens) / (devices * accel.peak_flops * mfu)


def optimizer_time(m: ModelSpec, devices: int, accel: Accelerator) -> float:
  """Seconds of one Adam step sharded over `devices`: memory bound, it reads and writes the
  whole train state once (gradients included), at the decode HBM efficiency."""
  nbytes = 2 * (train_state_bytes(m) + param_bytes(m))
  return nbytes / (devices * accel.hbm_bytes_per_s * DECODE_HBM_EFFICIENCY)


def transfer_time(nbytes: float, bytes_per_s: float, latency_s: float = 0.0) -> float:
  if bytes_per_s <= 0:
    raise ValueError(f'bytes_per_s={bytes_per_s}: a link needs a positive bandwidth.')
  return latency_s + nbytes / bytes_per_s


def swap_time(m: ModelSpec, bytes_per_s: float = SWAP_BYTES_PER_S) -> float:
  """Seconds to move an agent's train state between its mesh and host memory (one way)."""
  return transfer_time(train_state_bytes(m), bytes_per_s)


def weight_sync_time(m: ModelSpec, tp: int, accel: Accelerator) -> float:
  """Seconds to send new bf16 weights to an instance over its `tp` devices' NICs."""
  return transfer_time(param_bytes(m), tp * accel.network_bytes_per_s)
