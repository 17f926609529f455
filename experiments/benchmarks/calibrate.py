"""Measure this machine's rates for the cluster simulator, with the real classes.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python -m experiments.benchmarks.calibrate [--out=experiments/sim/this_machine.json]

On the default experiment's agents (experiments/hierarchical_assistant.py: tiny models,
its max_prompt_len, one training device and one rollout device per agent) it times
- `EmbeddedSampler.submit(...).result()` over batches of 16/32/64 rows and 1–3 new
  tokens, and fits `call_s + max_len·decode_step_s + rows·max_len·decode_token_s`
  (least squares; the sampler computes every padded row until the longest ends, as
  the simulator charges with `padded_batches`; `call_s` is the per-call cost:
  dispatch, prefill of the padded prompts, fetching the result);
- `AgentTrainer.accumulate` on micro-batches of 16/32/64 rows, fit as
  `micro_batch_s + slots·train_token_s` (slots: the padded batch's prompt + response
  token positions, which the trainer computes), and `AgentTrainer.apply` (optimizer_s);
- `EmbeddedSampler.update_weights` from the training device to the rollout device (sync_s);
- contention: the same sampler batch on 4 rollout devices at once vs one alone. The
  forced host devices share this machine's cores, so devices are not parallel;
  `contention` is (time of k concurrent batches) / (k · time of one): 1/k means k
  devices run in parallel, 1 means they serialize.

Medians of `--reps` timed calls after one untimed (compiling) call each. Writes the
fitted constants as JSON to `--out`, which experiments/sim/this_machine.py reads.
"""

import functools
import json
import statistics
import time

import numpy as np
from absl import app, flags

_OUT = flags.DEFINE_string('out', 'experiments/sim/this_machine.json', 'Where the rates go.')
_REPS = flags.DEFINE_integer('reps', 9, 'Timed calls per point (the median is kept).')
ROWS = (16, 32, 64)


def timed(fn, reps: int) -> float:
  fn()  # compile
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def nnls(xs: list[list[float]], ys: list[float]) -> list[float]:
  """Least squares with every coefficient >= 0 (a rate is never negative)."""
  from scipy.optimize import nnls as solve
  coef, _ = solve(np.asarray(xs), np.asarray(ys))
  return [float(c) for c in coef]


def main(argv):
  del argv
  import jax

  from experiments import hierarchical_assistant
  from flexmarl.config import build_team_spec
  from flexmarl.models import sharding
  from flexmarl.rollout.sampler import EmbeddedSampler, SamplingParams, compile_generate
  from flexmarl.models.tokenizer import load_tokenizer
  from flexmarl.train.trainer import AgentTrainer, TrainBatch

  config = hierarchical_assistant.get_config()
  tok = load_tokenizer(config.tokenizer)
  devices = jax.devices()
  spec = build_team_spec(config, tok.vocab_size, [d.id for d in devices],
                         ['router', 'reverser', 'sorter', 'adder'])
  a = spec.agents['reverser']  # every agent is the same tiny model
  mesh = lambda d: sharding.make_mesh([devices[d]], a.mesh_shape, a.mesh_axes)
  trainer = AgentTrainer('calib', a.model, a.optimizer, a.grpo, mesh(0), seed=0)
  gen = compile_generate(trainer.graphdef)
  samplers = [EmbeddedSampler(trainer.graphdef, trainer.params, max_prompt_len=spec.max_prompt_len,
                              eos_id=tok.eos_id, pad_id=tok.pad_id, generate_fn=gen,
                              place=functools.partial(trainer.place, mesh=mesh(d)))
              for d in (4, 5, 6, 7)]
  rng = np.random.default_rng(0)
  prompt = lambda: list(rng.integers(3, tok.vocab_size, 5))  # BOS + 3 chars + '=' in the real run
  results = {}

  # -- sampler: time per batch as a function of rows and new tokens ---------------------
  xs, ys = [], []
  for rows in ROWS:
    for new in (1, 2, 3):
      prompts = [prompt() for _ in range(rows)]
      keys = rng.integers(0, 2**31, (rows, 2)).astype(np.uint32)
      params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=new)
      out = samplers[0].generate(prompts, keys, params)
      seconds = timed(lambda: samplers[0].generate(prompts, keys, params), _REPS.value)
      lengths = np.asarray(out.lengths)
      xs.append([1.0, float(lengths.max()), float(rows * lengths.max())])
      ys.append(seconds)
      print(f'generate rows={rows} new={new} tokens={lengths.sum()}: {seconds * 1e3:.2f} ms')
  call_s, step_s, token_s = nnls(xs, ys)
  results.update(call_s=call_s, decode_step_s=step_s, decode_token_s=token_s, prefill_token_s=0.0)

  # -- contention: one batch on each of 4 rollout devices at once -------------------------
  prompts = [prompt() for _ in range(32)]
  keys = rng.integers(0, 2**31, (32, 2)).astype(np.uint32)
  params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=3)
  one = timed(lambda: samplers[0].generate(prompts, keys, params), _REPS.value)
  four = timed(lambda: [p.result() for p in [s.submit(prompts, keys, params) for s in samplers]],
               _REPS.value)
  results.update(contention=four / (4 * one), contention_one_s=one, contention_four_s=four)
  print(f'1 batch {one * 1e3:.2f} ms, 4 at once {four * 1e3:.2f} ms: contention '
        f'{results["contention"]:.2f}')

  # -- trainer: time per micro-batch token, per optimizer step ----------------------------
  xs, ys = [], []
  for rows in ROWS:
    resp = [rng.integers(3, tok.vocab_size, 3).astype(np.int32) for _ in range(rows)]
    batch = TrainBatch.from_rows([prompt() for _ in range(rows)], resp,
                                 [np.full(3, -1.0, np.float32)] * rows,
                                 rng.standard_normal(rows).astype(np.float32),
                                 prompt_len=spec.max_prompt_len, response_len=3,
                                 pad_id=tok.pad_id)
    seconds = timed(lambda: jax.block_until_ready(trainer.accumulate(batch)), _REPS.value)
    slots = batch.prompts.size + batch.responses.size
    xs.append([1.0, float(slots)])
    ys.append(seconds)
    print(f'accumulate rows={rows} slots={slots}: {seconds * 1e3:.2f} ms')
  micro_batch_s, train_token_s = nnls(xs, ys)
  optimizer_s = timed(lambda: (trainer.accumulate(batch), trainer.apply()), _REPS.value)
  optimizer_s = max(0.0, optimizer_s - ys[-1])  # less the micro-batch it needs first
  print(f'optimizer step: {optimizer_s * 1e3:.2f} ms')

  # -- weight sync: the trainer's new weights onto a rollout device -----------------------
  def sync():
    samplers[1].update_weights(trainer.params, 1)
    jax.block_until_ready(samplers[1].state)
  sync_s = timed(sync, _REPS.value)
  print(f'weight sync: {sync_s * 1e3:.2f} ms')
  results.update(micro_batch_s=micro_batch_s, train_token_s=train_token_s,
                 optimizer_s=optimizer_s, sync_s=sync_s)
  with open(_OUT.value, 'w') as f:
    json.dump(results, f, indent=1)
  print(json.dumps(results))


if __name__ == '__main__':
  app.run(main)
