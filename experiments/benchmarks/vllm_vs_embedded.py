"""Embedded JAX sampler vs a vLLM instance: generated tokens/s and weight-sync time.

  python experiments/benchmarks/vllm_vs_embedded.py [--shapes=tiny32,qwen2.5-0.5b]

Same model (random weights, fp32), same prompts and per-row keys, side by side in
one process. Each backend is warmed up (compiles, engine start) before the timed
batch. `tiny32` is the tiny preset with two 32-wide heads (vLLM's CPU attention needs
head sizes >= 32). All embedded runs come first: vLLM's CPU worker pins threads.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import jax
import numpy as np
from flax import nnx

from flexmarl.models.transformer import PRESETS, Decoder, ModelConfig, count_params
from flexmarl.rollout.sampler import EmbeddedSampler, SamplingParams, sample_key
from flexmarl.rollout.vllm_sampler import VLLMEngineConfig, VLLMSampler

SHAPES = {
    'tiny32': (dict(PRESETS['tiny'], vocab_size=64, heads=2, kv_heads=1, head_dim=32),
               64, 128),  # (model, batch, new tokens)
    'qwen2.5-0.5b': (PRESETS['qwen2.5-0.5b'], 16, 32),
}
PROMPT_LEN = 16


def _model(sizes: dict, seed: int):
  cfg = ModelConfig(**sizes)
  graphdef, state = nnx.split(Decoder(cfg, nnx.Rngs(params=seed)))
  return cfg, graphdef, state


def _work(cfg: ModelConfig, batch: int):
  rng = np.random.default_rng(0)
  prompts = [list(map(int, rng.integers(3, cfg.vocab_size, PROMPT_LEN))) for _ in range(batch)]
  keys = np.stack([sample_key(0, 'bench', 0, f'q{i}') for i in range(batch)])
  return prompts, keys


def embedded(name: str) -> dict:
  sizes, batch, new = SHAPES[name]
  cfg, graphdef, state = _model(sizes, 0)
  params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=new)
  prompts, keys = _work(cfg, batch)
  s = EmbeddedSampler(graphdef, state, max_prompt_len=PROMPT_LEN, eos_id=2, pad_id=0)
  t = time.perf_counter()
  s.generate(prompts, keys, params)
  warm = time.perf_counter() - t
  t = time.perf_counter()
  out = s.generate(prompts, keys, params)
  gen = time.perf_counter() - t
  _, _, new_state = _model(sizes, 1)
  jax.block_until_ready(new_state)
  t = time.perf_counter()
  s.update_weights(new_state, 1)
  jax.block_until_ready(s.state)
  sync = time.perf_counter() - t
  return dict(params=count_params(state), warm=warm, tokens=int(out.lengths.sum()),
              tok_s=out.lengths.sum() / gen, sync=sync)


def vllm(name: str, workdir: str) -> dict:
  sizes, batch, new = SHAPES[name]
  cfg, _, state = _model(sizes, 0)
  params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=new)
  prompts, keys = _work(cfg, batch)
  t = time.perf_counter()
  s = VLLMSampler(cfg, nnx.to_pure_dict(state), workdir=workdir, eos_id=2, pad_id=0,
                  engine=VLLMEngineConfig(max_model_len=PROMPT_LEN + new,
                                          kv_cache_bytes=1 << 30))
  s.submit(prompts, keys, params).result()
  warm = time.perf_counter() - t
  t = time.perf_counter()
  out = s.submit(prompts, keys, params).result()
  gen = time.perf_counter() - t
  _, _, new_state = _model(sizes, 1)
  s.update_weights(nnx.to_pure_dict(new_state), 1)
  sync = s.last_sync_s
  s.close()
  return dict(params=count_params(state), warm=warm, tokens=int(out.lengths.sum()),
              tok_s=out.lengths.sum() / gen, sync=sync)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--shapes', default=','.join(SHAPES))
  shapes = parser.parse_args().shapes.split(',')
  rows = [(n, 'embedded', embedded(n)) for n in shapes]
  with tempfile.TemporaryDirectory() as tmp:
    rows += [(n, 'vllm', vllm(n, f'{tmp}/{n}')) for n in shapes]
  print(f"{'shape':<14} {'backend':<9} {'params':>11} {'batch×new':>10} {'warm-up s':>10} "
        f"{'tokens':>7} {'tok/s':>9} {'sync ms':>9}")
  for name, backend, r in sorted(rows):
    _, batch, new = SHAPES[name]
    print(f"{name:<14} {backend:<9} {r['params']:>11,} {f'{batch}×{new}':>10} "
          f"{r['warm']:>10.1f} {r['tokens']:>7} {r['tok_s']:>9.0f} {r['sync'] * 1e3:>9.1f}")


if __name__ == '__main__':
  main()
