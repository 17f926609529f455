"""GRPO step throughput of one agent on `a+b=` (a, b in 0-9), through the product path.

  python experiments/benchmarks/grpo_step.py [--steps=100] [--warmup=5]

One agent needs one device, and the machine's own CPU device is what a peer library's
run gets. Forcing more host devices (`XLA_FLAGS=--xla_force_host_platform_device_count=8`,
as the tests do for meshes) changes the measurement: XLA's CPU client runs as many
compute threads as it has devices (at least one per core), so 8 threads share two cores
and the same step costs ≈1.2x the CPU time (RESULTS.md).

Model in the Qwen2 layout: 2 layers, width 128, MLP 256, 4 heads (2 KV heads of 32),
vocab 64, fp32. 16 prompts x 8 samples per step, at most 8 new tokens, temperature
1, AdamW lr 3e-3, one update per step. Each step is a full `sync` step of the
JointOrchestrator: embedded-sampler rollout, rewards, advantages, one optimizer
step, weights published. Compile time (the warm-up steps) is reported apart. The
last line is JSON: steps_per_s, gen_tokens_per_s, train_tokens_per_s, compile_s.
"""

import json
import tempfile
import time

import ml_collections
from absl import app, flags

_STEPS = flags.DEFINE_integer('steps', 100, 'Timed steps.')
_WARMUP = flags.DEFINE_integer('warmup', 5, 'Untimed steps first (compilation).')


def get_config() -> ml_collections.ConfigDict:
  from flexmarl.config import agent_config
  c = ml_collections.ConfigDict()
  c.seed, c.steps, c.schedule, c.tokenizer = 0, 10**6, 'sync', 'char'
  c.max_prompt_len, c.checkpoint_every = 8, 10**6
  c.workflow = dict(name='single_task', agent='solver', family='add',
                    task_args={'max_operand': 9})
  c.rollout = dict(query_concurrency=16, max_step_queries=16)
  c.agents = dict(solver=agent_config(
      'small', group_size=8, global_batch=128, micro_batch=128,
      sampling=dict(temperature=1.0, top_p=1.0, max_new_tokens=8),
      optimizer=dict(learning_rate=3e-3, b1=0.9, b2=0.99, weight_decay=0.0, max_grad_norm=1.0,
                     decay_steps=0, final_lr_fraction=0.1)))
  c.agents.solver.model.vocab_size = 64
  return c


def main(argv):
  del argv
  import jax

  from flexmarl.config import build_team_spec
  from flexmarl.build import build_orchestrator
  from flexmarl.core.clock import RealClock
  from flexmarl.models.tokenizer import load_tokenizer
  from flexmarl.workflows import build_workflow

  config = get_config()
  tokenizer = load_tokenizer(config.tokenizer)
  workflow = build_workflow(config.workflow)
  spec = build_team_spec(config, tokenizer.vocab_size, [d.id for d in jax.devices()],
                         workflow.agent_names())
  with tempfile.TemporaryDirectory() as workdir:
    orch = build_orchestrator(spec, workflow, tokenizer, workdir, clock=RealClock())
    t0 = time.perf_counter()
    for _ in range(_WARMUP.value):
      orch.run_step()
    compile_s = time.perf_counter() - t0
    gen = trained = 0
    t0 = time.perf_counter()
    for i in range(_STEPS.value):
      lines = orch.run_step()
      gen += lines['solver']['tokens']
      trained += lines['solver']['trained_tokens']
      if (i + 1) % 25 == 0:
        print(f"step {i + 1}/{_STEPS.value}: reward {lines['solver']['reward_mean']:.2f}",
              flush=True)
    elapsed = time.perf_counter() - t0
    orch.close()
  result = dict(steps_per_s=_STEPS.value / elapsed, gen_tokens_per_s=gen / elapsed,
                train_tokens_per_s=trained / elapsed, compile_s=compile_s)
  print(f"{result['steps_per_s']:.1f} steps/s, {result['gen_tokens_per_s']:.0f} generated tok/s, "
        f"{result['train_tokens_per_s']:.0f} trained tok/s; warm-up (compile) {compile_s:.1f}s")
  print(json.dumps(result))


if __name__ == '__main__':
  app.run(main)
