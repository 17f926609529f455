"""Step time of the default experiment under `sync`, `sync_parallel` and `flexmarl`.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python experiments/benchmarks/pipeline.py [--steps=40] [--warmup=10] \
      [--queries_per_wave=6] [--max_waves=8]

The three schedules give the same parameters (tests/test_schedules.py), so each one
does exactly the same work; only its timing differs. Waves are smaller than in the
default experiment so that a global batch fills over several waves, as it does when
rollout concurrency is bounded: that is where micro-batches can start early. Each
schedule warms up (compiles) first; the timed steps follow. The last line is JSON.
"""

import importlib.util
import json
import os
import tempfile
import time

from absl import app, flags

_STEPS = flags.DEFINE_integer('steps', 40, 'Timed steps per schedule.')
_WARMUP = flags.DEFINE_integer('warmup', 10, 'Untimed steps first (compilation).')
_QUERIES = flags.DEFINE_integer('queries_per_wave', 6, 'Rollout concurrency (queries).')
_WAVES = flags.DEFINE_integer('max_waves', 8, 'Waves a step may take to fill batches.')

SCHEDULES = ('sync', 'sync_parallel', 'flexmarl')


def step_time(schedule: str) -> dict:
  import jax

  from flexmarl.config import build_team_spec
  from flexmarl.orchestrator import JointOrchestrator
  from flexmarl.tokenizer import load_tokenizer
  from flexmarl.workflows import build_workflow

  spec_file = os.path.join(os.path.dirname(__file__), '..', 'hierarchical_assistant.py')
  module_spec = importlib.util.spec_from_file_location('hierarchical_assistant', spec_file)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  config = module.get_config()
  config.schedule = schedule
  config.rollout.queries_per_wave, config.rollout.max_waves = _QUERIES.value, _WAVES.value
  tokenizer = load_tokenizer(config.tokenizer)
  workflow = build_workflow(config.workflow)
  spec = build_team_spec(config, tokenizer.vocab_size, len(jax.devices()), workflow.agent_names())
  with tempfile.TemporaryDirectory() as workdir:
    orch = JointOrchestrator(spec, workflow, tokenizer, workdir)
    for _ in range(_WARMUP.value):
      orch.run_step()
    rollout = train = 0.0
    t0 = time.perf_counter()
    for _ in range(_STEPS.value):
      team = orch.run_step()['team']
      rollout += team['rollout_s']
      train += team['train_s']
    elapsed = time.perf_counter() - t0
    orch.close()
  n = _STEPS.value
  return dict(step_s=elapsed / n, rollout_s=rollout / n, after_rollout_s=train / n)


def main(argv):
  del argv
  results = {}
  for schedule in SCHEDULES:
    results[schedule] = step_time(schedule)
    print(f"{schedule:>14}: {results[schedule]['step_s'] * 1e3:.0f} ms/step "
          f"(rollout {results[schedule]['rollout_s'] * 1e3:.0f} ms, then training "
          f"{results[schedule]['after_rollout_s'] * 1e3:.0f} ms)", flush=True)
  base = results['sync']['step_s']
  for schedule in SCHEDULES:
    results[schedule]['speedup_vs_sync'] = base / results[schedule]['step_s']
  print(' '.join(f"{s}: {r['speedup_vs_sync']:.2f}x" for s, r in results.items()))
  print(json.dumps(results))


if __name__ == '__main__':
  app.run(main)
