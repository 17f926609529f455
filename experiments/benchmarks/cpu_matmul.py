"""Can JAX on this CPU reach its matrix units? Matmul rates of XLA:CPU's own paths against
oneDNN's (through PyTorch), fp32 and bf16.

  python experiments/benchmarks/cpu_matmul.py          # needs torch (the real extra)

Each XLA:CPU path runs in a fresh process with its flag in XLA_FLAGS: the default
emitter, the oneDNN custom call and fusion, and the XNNPACK and YNNPACK dot fusions
(flags of jaxlib 0.10.2; an unknown flag fails that row). Shapes: 2048³, and 256×576 @
576×1536 (a micro-batch's tokens through SmolLM2-135M's MLP). Prints GFLOP/s per path,
dtype and shape, the CPU's matrix-unit flags (AMX, AVX-512 BF16) and the best JAX rate
over oneDNN's for each dtype.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

SHAPES = ((2048, 2048, 2048), (256, 576, 1536))
XLA_PATHS = {
    'xla default': '',
    'onednn custom call': '--xla_cpu_experimental_onednn_custom_call=true',
    'onednn fusion (dot)': '--xla_cpu_experimental_onednn_fusion_type=dot',
    'xnnpack fusion (dot)': '--xla_cpu_experimental_xnn_fusion_type=dot',
    'ynnpack fusion (dot)': '--xla_cpu_experimental_ynn_fusion_type=dot',
}


def rate(seconds: float, m: int, k: int, n: int) -> float:
  return 2 * m * k * n / seconds / 1e9


def jax_rates() -> dict:
  import jax
  import jax.numpy as jnp
  out = {}
  for dtype in ('float32', 'bfloat16'):
    for m, k, n in SHAPES:
      a, b = jnp.ones((m, k), dtype), jnp.ones((k, n), dtype)
      f = jax.jit(lambda a, b: a @ b)
      f(a, b).block_until_ready()
      reps = 5 if m == 2048 else 20
      t = time.perf_counter()
      for _ in range(reps):
        f(a, b).block_until_ready()
      out[f'{dtype} {m}x{k}x{n}'] = rate((time.perf_counter() - t) / reps, m, k, n)
  return out


def torch_rates() -> dict:
  import torch
  torch.set_num_threads(os.cpu_count() or 1)
  out = {}
  for name, dtype in (('float32', torch.float32), ('bfloat16', torch.bfloat16)):
    for m, k, n in SHAPES:
      a, b = torch.ones(m, k, dtype=dtype), torch.ones(k, n, dtype=dtype)
      a @ b
      reps = 5 if m == 2048 else 20
      t = time.perf_counter()
      for _ in range(reps):
        a @ b
      out[f'{name} {m}x{k}x{n}'] = rate((time.perf_counter() - t) / reps, m, k, n)
  return out


def cpu_flags() -> str:
  try:
    with open('/proc/cpuinfo', encoding='utf-8') as f:
      flags = next(l for l in f if l.startswith('flags')).split()
    model = next(l for l in open('/proc/cpuinfo', encoding='utf-8')
                 if l.startswith('model name')).split(':', 1)[1].strip()
  except (OSError, StopIteration):
    return 'unknown'
  units = sorted(f for f in flags if f.startswith('amx') or f == 'avx512_bf16')
  return f'{model}; matrix units: {", ".join(units) or "none"}'


def main() -> None:
  if len(sys.argv) > 1 and sys.argv[1] == '--child':
    print(json.dumps(jax_rates()))
    return
  print(f'CPU: {cpu_flags()}, {os.cpu_count()} cores')
  rows = {}
  for name, flag in XLA_PATHS.items():
    env = dict(os.environ, XLA_FLAGS=flag)
    done = subprocess.run([sys.executable, __file__, '--child'], env=env, capture_output=True,
                          text=True)
    rows[name] = (json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0
                  else None)
  rows['torch (oneDNN)'] = torch_rates()
  keys = list(rows['torch (oneDNN)'])
  print(f"{'path':24s} " + ' '.join(f'{k:>24s}' for k in keys))
  for name, r in rows.items():
    cells = ' '.join(f'{r[k]:24.0f}' for k in keys) if r else 'failed'
    print(f'{name:24s} {cells}')
  for dtype in ('float32', 'bfloat16'):
    for key in (k for k in keys if k.startswith(dtype)):
      best = max((r[key], n) for n, r in rows.items() if r and n != 'torch (oneDNN)')
      print(f'{key}: best JAX path {best[1]} at {best[0] / rows["torch (oneDNN)"][key]:.2f}× '
            "oneDNN's rate")


if __name__ == '__main__':
  main()
