"""Publish times and sampler/trainer mismatch of the real team, per variant, from short runs.

  python experiments/benchmarks/real_publish.py [--variants=lora,full,vllm,full+vllm,bf16] \
      [--steps=4] [--out=runs/real_publish]

Each variant runs `experiments/real_team.py` for `--steps` steps (no held-out evaluation,
one checkpoint at the end) in a process of its own, then this reads the run's trace and
metrics:
- publish: the `weight_sync` spans, new weights sent to the rollout instances after an
  update (per agent; a LoRA agent sends its adapters only), median and max over the run,
  the first publish left out (it may compile);
- mismatch: per update, the mean |Δ logprob| and the KL estimate between the sampler's
  and the trainer's log-probabilities of the sampled tokens (`logprob_mismatch`,
  `mismatch_kl`), mean and max over the run;
- rollout: generated tokens/s of the run's rollout instances, from the `generate` spans
  after step 1 (its compiles and engine warm-up left out): their tokens over the time
  any of them was generating.

Variants: `lora` (the experiment as shipped: LoRA adapters, embedded sampler, fp32),
`full` and `vllm` and `full+vllm` (the experiment's own variants), `bf16` (LoRA, every
agent's `model.dtype='bfloat16'`: weights and compute), `base_bf16` (LoRA,
`model.base_dtype='bfloat16'`). Prints one JSON line per variant.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

AGENTS = ('router', 'sum', 'product')
VARIANTS = {  # name → (the experiment's variants, model fields set on every agent)
    'lora': ('', {}), 'full': ('full', {}), 'vllm': ('vllm', {}),
    'full+vllm': ('full,vllm', {}), 'bf16': ('', {'dtype': 'bfloat16'}),
    'base_bf16': ('', {'base_dtype': 'bfloat16'}),
}


def run(variant: str, steps: int, workdir: str) -> None:
  config_variants, model = VARIANTS[variant]
  command = [sys.executable, '-m', 'flexmarl.main',
             f'--config=experiments/real_team.py{":" + config_variants if config_variants else ""}',
             f'--workdir={workdir}', f'--config.steps={steps}', '--config.eval_every=0',
             f'--config.checkpoint_every={steps}']
  command += [f'--config.agents.{a}.model.{k}={v}' for a in AGENTS for k, v in model.items()]
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8')
  env.setdefault('GLIBC_TUNABLES', 'glibc.malloc.hugetlb=1')  # vLLM's syncs (README)
  subprocess.run(command, check=True, env=env)


def read(variant: str, workdir: str) -> dict:
  with open(os.path.join(workdir, 'trace.json'), encoding='utf-8') as f:
    trace = json.load(f)
  events = trace['traceEvents'] if isinstance(trace, dict) else trace
  syncs = sorted((e for e in events if e.get('ph') == 'X' and e.get('cat') == 'weight_sync'),
                 key=lambda e: e['ts'])
  by_agent: dict[str, list[float]] = {}
  for e in syncs:
    by_agent.setdefault(e.get('args', {}).get('agent', '?'), []).append(e['dur'] / 1e6)
  publish = [s for durations in by_agent.values() for s in durations[1:]]
  generates = [e for e in events if e.get('ph') == 'X' and e.get('cat') == 'generate'
               and e.get('args', {}).get('step', 1) > 1]
  rows = []
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    for line in f:
      row = json.loads(line)
      if row.get('agent') in AGENTS and 'logprob_mismatch' in row:
        rows.append(row)
  delta = [r['logprob_mismatch'] for r in rows]
  kl = [r['mismatch_kl'] for r in rows]
  return dict(variant=variant, rollout_tok_s=tokens_per_s(generates), publishes=len(publish),
              publish_median_s=statistics.median(publish) if publish else None,
              publish_max_s=max(publish) if publish else None,
              updates=len(rows), mismatch_mean=statistics.mean(delta) if delta else None,
              mismatch_max=max(delta) if delta else None,
              kl_mean=statistics.mean(kl) if kl else None, kl_max=max(kl) if kl else None)


def tokens_per_s(spans: list[dict]) -> float | None:
  """The spans' tokens over the union of their intervals (instances generate at once)."""
  busy, end = 0.0, float('-inf')
  for e in sorted(spans, key=lambda e: e['ts']):
    start, stop = max(e['ts'], end), e['ts'] + e['dur']
    busy, end = busy + max(0.0, stop - start), max(end, stop)
  tokens = sum(e['args']['tokens'] for e in spans)
  return tokens / (busy / 1e6) if busy else None


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--variants', default='lora,full,vllm,full+vllm,bf16')
  parser.add_argument('--steps', type=int, default=4)
  parser.add_argument('--out', default='runs/real_publish')
  args = parser.parse_args()
  variants = args.variants.split(',')
  unknown = [v for v in variants if v not in VARIANTS]
  if unknown:
    raise SystemExit(f'--variants: unknown {unknown}; choose from {list(VARIANTS)}')
  for variant in variants:
    workdir = os.path.join(args.out, variant)
    if not os.path.exists(os.path.join(workdir, 'summary.json')):
      run(variant, args.steps, workdir)
    print(json.dumps(read(variant, workdir)), flush=True)


if __name__ == '__main__':
  main()
