"""vLLM weight sync: the full layer-wise reload against the copy into the model in place.

  GLIBC_TUNABLES=glibc.malloc.hugetlb=1 PYTHONPATH=. \
    python experiments/benchmarks/vllm_sync.py [--shape=qwen2.5-0.5b] [--rounds=3]

(GLIBC_TUNABLES as the launchers set it: huge pages for malloc; leave it out to see a
sync that faults in 4 KiB pages, the default where the kernel's huge pages are `madvise`.)

One in-process vLLM engine (CPU, fp32, random weights), the two paths alternated round
by round on the same engine, each syncing a fresh set of weights. Per path: the whole
`update_weights` (median over rounds), split into our layout conversion on the device
(timed alone, same arrays) and the rest (inside vLLM). After the last round both paths
sync the same weights and their logprobs on one batch must agree: the fast path is
checked against vLLM's own loader, not only timed.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import jax
import numpy as np
from flax import nnx

from flexmarl.models import hf
from flexmarl.models.transformer import PRESETS, Decoder, ModelConfig, count_params
from flexmarl.rollout import vllm_weights
from flexmarl.rollout.sampler import SamplingParams, sample_key
from flexmarl.rollout.vllm_sampler import VLLMEngineConfig, VLLMSampler

SHAPES = {
    'tiny32': dict(PRESETS['tiny'], vocab_size=64, heads=2, kv_heads=1, head_dim=32),
    'qwen2.5-0.5b': PRESETS['qwen2.5-0.5b'],
}
PATHS = {'reload': False, 'in place': True}  # name → VLLMSampler.in_place


def _params(cfg: ModelConfig, seed: int) -> dict:
  params = nnx.to_pure_dict(nnx.state(Decoder(cfg, nnx.Rngs(params=seed))))
  return jax.block_until_ready(params)


def _convert_s(cfg: ModelConfig, params: dict, in_place: bool) -> float:
  """Seconds to produce every host array the path hands to vLLM (nothing sent)."""
  start = time.perf_counter()
  arrays = (vllm_weights.host_weights(cfg, params) if in_place
            else hf.hf_weights(cfg, params, 'float32'))
  for _ in arrays:
    pass
  return time.perf_counter() - start


def _logprobs(sampler: VLLMSampler, cfg: ModelConfig) -> np.ndarray:
  rng = np.random.default_rng(0)
  prompts = [list(map(int, rng.integers(3, cfg.vocab_size, 8))) for _ in range(4)]
  keys = np.stack([sample_key(0, 'bench', 0, f'q{i}') for i in range(4)])
  out = sampler.submit(prompts, keys, SamplingParams(temperature=1.0, top_p=1.0,
                                                     max_new_tokens=8)).result()
  return out.logprobs


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--shape', default='qwen2.5-0.5b', choices=sorted(SHAPES))
  parser.add_argument('--rounds', type=int, default=3)
  args = parser.parse_args()
  cfg = ModelConfig(**SHAPES[args.shape])
  with tempfile.TemporaryDirectory() as tmp:
    sampler = VLLMSampler(cfg, _params(cfg, 0), workdir=tmp, eos_id=2, pad_id=0,
                          engine=VLLMEngineConfig(max_model_len=64, kv_cache_bytes=256 << 20))
    assert sampler.in_place, 'the model is not one the in-place copy covers (see the log)'
    times = {p: {'sync': [], 'convert': []} for p in PATHS}
    for r in range(args.rounds):
      for path, in_place in PATHS.items():
        params = _params(cfg, 1 + 2 * r + in_place)
        times[path]['convert'].append(_convert_s(cfg, params, in_place))
        sampler.in_place = in_place
        sampler.update_weights(params, 1 + r)
        times[path]['sync'].append(sampler.last_sync_s)
        del params
    params = _params(cfg, 99)
    served = {}
    for path, in_place in PATHS.items():
      sampler.in_place = in_place
      sampler.update_weights(params, 99)
      served[path] = _logprobs(sampler, cfg)
    sampler.close()
  gap = float(np.abs(served['reload'] - served['in place']).max())
  print(f'{args.shape}: {count_params(params):,} params, fp32, {args.rounds} rounds; '
        f'logprobs after the same weights differ by {gap:.1e} between the paths')
  print(f"{'path':<9} {'sync s':>8} {'convert s':>10} {'in vLLM s':>10}")
  median = {p: {k: statistics.median(v) for k, v in t.items()} for p, t in times.items()}
  for path, m in median.items():
    print(f"{path:<9} {m['sync']:>8.3f} {m['convert']:>10.3f} {m['sync'] - m['convert']:>10.3f}")
  print(f"in place is {median['reload']['sync'] / median['in place']['sync']:.1f}x faster")
  assert gap < 1e-4, f'the paths serve different logprobs ({gap})'


if __name__ == '__main__':
  main()
