"""vLLM LoRA: how long a publish takes for a LoRA agent (its adapter reloaded in place)
against a full-parameter agent of the same model (its weights copied in place).

  PYTHONPATH=. python experiments/benchmarks/vllm_lora_sync.py [--preset=base] [--ranks=16,64]

In-process vLLM engines (CPU, fp32, random weights), one per rank and one without
adapters; each takes `--rounds` publishes of the same params and the median
`last_sync_s` is printed with the adapter's size. A LoRA publish writes the PEFT folder
and reloads it under the same id (`VLLMSampler.update_weights`); the base is not synced.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import jax
import numpy as np
from flax import nnx

from flexmarl.models import lora
from flexmarl.models.transformer import PRESETS, Decoder, ModelConfig
from flexmarl.rollout.sampler import SamplingParams
from flexmarl.rollout.vllm_sampler import VLLMEngineConfig, VLLMSampler


def model(preset: str, rank: int) -> ModelConfig:
  """The preset with heads of 32 (vLLM on CPU) and heads x 32 = hidden (vLLM's Qwen2)."""
  sizes = PRESETS[preset]
  return ModelConfig(**dict(sizes, vocab_size=512, heads=sizes['hidden'] // 32,
                            kv_heads=2, head_dim=32),
                     lora=lora.LoRAConfig(rank=rank, alpha=2.0 * rank))


def publish_seconds(cfg: ModelConfig, rounds: int) -> tuple[float, int]:
  """(median seconds of a publish, bytes it moves: the adapter, or the whole model)."""
  params = nnx.to_pure_dict(nnx.state(Decoder(cfg, nnx.Rngs(params=0))))
  moved = lora.partition(params, cfg.lora)[0]
  with tempfile.TemporaryDirectory() as workdir:
    sampler = VLLMSampler(cfg, params, workdir=workdir, eos_id=1, pad_id=0,
                          engine=VLLMEngineConfig(max_model_len=64, kv_cache_bytes=64 << 20))
    sampler.submit([[2, 3, 4]], np.zeros((1, 2), np.uint32),
                   SamplingParams(1.0, 1.0, 4)).result()  # the adapter loaded once
    times = []
    for version in range(1, rounds + 1):
      sampler.update_weights(params, version)
      times.append(sampler.last_sync_s)
    sampler.close()
  return statistics.median(times), sum(x.nbytes for x in jax.tree.leaves(moved))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--preset', default='base', choices=[p for p in PRESETS if 'qwen' not in p])
  parser.add_argument('--ranks', default='16,64')
  parser.add_argument('--rounds', type=int, default=5)
  args = parser.parse_args()
  for rank in [0] + [int(r) for r in args.ranks.split(',')]:
    cfg = model(args.preset, rank)
    seconds, nbytes = publish_seconds(cfg, args.rounds)
    what = f'LoRA rank {rank:3d}' if rank else 'full weights'
    print(f'{args.preset} {what}: publish {seconds * 1e3:7.1f} ms (median of {args.rounds}), '
          f'moves {nbytes / 1e6:7.2f} MB')


if __name__ == '__main__':
  main()
