"""A vLLM instance inside a training run against the same engine on its own.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 GLIBC_TUNABLES=glibc.malloc.hugetlb=1 \
    PYTHONPATH=. python experiments/benchmarks/vllm_in_run.py [--shape=qwen2.5-0.5b] [--rounds=2] \
    [--cpu_threads=2]

One agent on `a+b=` (single_task, char tokenizer) under `rollout.backend=vllm`, built
through `flexmarl.run.build` (the product path), `sync` schedule: every step rolls out
one batch on its one vLLM engine, trains, and syncs the new weights into the engine.
Round by round in one process, side by side:

- in run: one `JointOrchestrator.run_step`; its rollout tokens/s (tokens the engine
  generated / the team line's `rollout_s`), the engine's own busy time (the worker
  thread's `_generate`) and the whole step's tokens/s;
- standalone: the weights that step's rollout served synced back, and the batches it
  served (same prompts, keys, limits, sampling: the same samples, checked) replayed
  straight into the same `VLLMSampler` (`submit(...).result()`): once right after
  the sync (`after_sync`), then `--repeats` times warm (`standalone`, the median).
  Then the trained weights go back in, so the next step's rollout follows a sync, as
  in a run.

Shapes (random weights, fp32): `small` (2 layers, width 128, heads of 32: vLLM's CPU
attention needs head sizes >= 32; about two minutes on 2 cores) and `qwen2.5-0.5b`.
`smollm2`: the real team instead (`experiments/real_team.py:full,vllm`: SmolLM2-135M-
Instruct, a router and two specialists in its chat format, one engine an agent, 8 rows
an agent a step, 10 new tokens), every agent's batches recorded and replayed.
`--cpu_threads`: the engine's torch threads (`rollout.vllm.cpu_threads`; by default all
cores). The last line is JSON: per-round figures, their medians, the ratios in
run / standalone (rollout, engine busy time, whole step), the engine's torch threads
and the load average.
"""

import collections
import json
import os
import statistics
import tempfile
import time

import ml_collections
from absl import app, flags

SHAPES = {  # preset, model overrides, queries per step, samples per query, new tokens
    'small': ('small', dict(vocab_size=64), 16, 8, 32),
    'qwen2.5-0.5b': ('qwen2.5-0.5b', {}, 2, 8, 32),
}
REAL_TEAM = 'smollm2'  # experiments/real_team.py, not a preset of one agent
_SHAPE = flags.DEFINE_enum('shape', 'small', [*SHAPES, REAL_TEAM], 'Model shape.')
_ROUNDS = flags.DEFINE_integer('rounds', 2, 'Standalone / in-run rounds, alternated.')
_WARMUP = flags.DEFINE_integer('warmup', 2, 'Untimed steps first (compiles, engine warm-up).')
_REPEATS = flags.DEFINE_integer('repeats', 2, 'Standalone replays of the step\'s batches.')
_THREADS = flags.DEFINE_integer('cpu_threads', 0, 'rollout.vllm.cpu_threads (0: the default, '
                                'all cores).')


def get_config(shape: str, cpu_threads: int = 0) -> ml_collections.ConfigDict:
  from flexmarl.config import agent_config
  if shape == REAL_TEAM:
    return real_team_config(cpu_threads)
  preset, model, queries, group, new = SHAPES[shape]
  rows = queries * group
  c = ml_collections.ConfigDict()
  c.seed, c.steps, c.schedule, c.tokenizer = 0, 10**6, 'sync', 'char'
  c.max_prompt_len, c.checkpoint_every = 8, 10**6
  c.workflow = dict(name='single_task', agent='solver', family='add',
                    task_args={'max_operand': 9})
  c.rollout = dict(query_concurrency=queries, max_step_queries=queries, max_batch=rows,
                   backend='vllm', vllm=dict(dtype='float32', max_model_len=64,
                                             kv_cache_bytes=256 << 20, enforce_eager=True,
                                             cpu_threads=cpu_threads))
  c.agents = dict(solver=agent_config(
      preset, group_size=group, global_batch=rows, micro_batch=rows,
      sampling=dict(temperature=1.0, top_p=1.0, max_new_tokens=new),
      optimizer=dict(learning_rate=1e-4, b1=0.9, b2=0.99, weight_decay=0.0, max_grad_norm=1.0,
                     decay_steps=0, final_lr_fraction=0.1)))
  for k, v in model.items():
    c.agents.solver.model[k] = v
  return c


def real_team_config(cpu_threads: int) -> ml_collections.ConfigDict:
  """The real team, full agents on vLLM (one engine each), `sync`, no evaluation."""
  from experiments import real_team
  c = real_team.get_config('full,vllm')
  c.schedule, c.steps, c.checkpoint_every, c.eval_every = 'sync', 10**6, 10**6, 0
  c.rollout.query_concurrency, c.rollout.max_step_queries = 8, 64
  c.rollout.vllm.cpu_threads = cpu_threads
  for a in c.agents.values():
    a.global_batch = a.micro_batch = 8
  return c


class Recorder:
  """Wraps a VLLMSampler: keeps the batches submitted, with the version they were served
  at, and their futures (to replay them and count what they generated), and times the
  worker thread's work on each (the engine's busy time, whatever waits around it).

  A step starts the next step's rollout before it ends (once its weights are published),
  so its own batches are those served at the version it began with."""

  def __init__(self, sampler):
    self.sampler = sampler
    self.reset()
    self._versions = collections.deque()  # of the batches queued, for `generate`
    self._submit, self._generate = sampler.submit, sampler._generate
    sampler.submit, sampler._generate = self.submit, self.generate

  def submit(self, *args, **kwargs):
    version = self.sampler.version
    self._versions.append(version)
    future = self._submit(*args, **kwargs)
    self.batches.append((version, args, kwargs))
    self.futures.append((version, future))
    return future

  def generate(self, *args, **kwargs):
    version = self._versions.popleft()  # the engine's one worker runs batches in order
    start = time.perf_counter()
    try:
      return self._generate(*args, **kwargs)
    finally:
      self.engine_s[version] += time.perf_counter() - start

  def served_tokens(self, version: int) -> int:
    return sum(int(f.result().lengths.sum()) for v, f in self.futures if v == version)

  def batches_of(self, version: int) -> list:
    return [(args, kwargs) for v, args, kwargs in self.batches if v == version]

  def serve(self, weights: tuple[dict, int]) -> None:
    """Sync (params, version) into the engine."""
    self.sampler.update_weights(*weights)

  def threads(self) -> int:
    """Torch threads on the engine's thread."""
    import torch
    return self.sampler._pool.submit(torch.get_num_threads).result()

  def reset(self) -> None:
    self.batches, self.futures = [], []
    self.engine_s: collections.Counter[int] = collections.Counter()

  def replay(self, batches) -> tuple[int, float]:
    """Generated tokens and seconds of `batches`, one after the other, as a caller
    outside a run submits them."""
    tokens, start = 0, time.perf_counter()
    for args, kwargs in batches:
      self._versions.append(None)  # not a run's batch
      tokens += int(self._submit(*args, **kwargs).result().lengths.sum())
    return tokens, time.perf_counter() - start


def main(argv):
  del argv
  from flexmarl.run import build

  with tempfile.TemporaryDirectory() as workdir:
    t0 = time.perf_counter()
    orch = build(get_config(_SHAPE.value, _THREADS.value), workdir, log=lambda *_: None)
    recs = {name: Recorder(agent.pool.instances[0].sampler)
            for name, agent in orch.agents.items()}
    for _ in range(_WARMUP.value):
      orch.run_step()
    warmup_s = time.perf_counter() - t0
    rounds = []
    for r in range(_ROUNDS.value):
      # The next step's rollout, begun at the end of the step before, is dropped: each
      # timed step runs its whole rollout, and the replays below have the engines alone.
      orch.serve_from(orch.next_query)
      served = {n: (rec.sampler._params, rec.sampler.version) for n, rec in recs.items()}
      for rec in recs.values():
        rec.reset()
      team = orch.run_step()['team']
      tokens = sum(rec.served_tokens(served[n][1]) for n, rec in recs.items())
      engine_s = sum(rec.engine_s[served[n][1]] for n, rec in recs.items())
      batches = {n: rec.batches_of(served[n][1]) for n, rec in recs.items()}
      trained = {n: (rec.sampler._params, rec.sampler.version) for n, rec in recs.items()}

      def replay() -> tuple[int, float]:
        """Every engine's batches of the step, engine after engine."""
        counts = [recs[n].replay(b) for n, b in batches.items()]
        return sum(t for t, _ in counts), sum(s for _, s in counts)

      for n, rec in recs.items():
        rec.serve(served[n])  # the step's weights back: the replay draws the same samples
      first = replay()
      alone = [replay() for _ in range(_REPEATS.value)]
      assert first[0] == tokens == alone[0][0], (first[0], tokens, alone[0][0])
      alone_tok_s = statistics.median(t / s for t, s in alone)
      for n, rec in recs.items():
        rec.serve(trained[n])  # the next step's rollout follows a sync, as every step's does
      row = dict(batches=sum(map(len, batches.values())), standalone_tok_s=alone_tok_s,
                 after_sync_tok_s=first[0] / first[1],
                 sync_s=sum(rec.sampler.last_sync_s for rec in recs.values()),
                 tokens=tokens, line_tokens=int(team['tokens']), rollout_s=team['rollout_s'],
                 step_s=team['step_time_s'], engine_s=engine_s,
                 rollout_tok_s=tokens / team['rollout_s'], engine_tok_s=tokens / engine_s,
                 step_tok_s=tokens / team['step_time_s'])
      row['ratio'] = row['rollout_tok_s'] / alone_tok_s
      rounds.append(row)
      print(f"round {r + 1}: in run: rollout {row['rollout_tok_s']:.0f} tok/s ({tokens} tokens "
            f"in {row['rollout_s']:.2f}s, engines busy {engine_s:.2f}s), step "
            f"{row['step_tok_s']:.0f} tok/s ({row['step_s']:.2f}s); standalone "
            f"{alone_tok_s:.0f} tok/s (right after a sync {row['after_sync_tok_s']:.0f}); "
            f"ratio {row['ratio']:.2f}", flush=True)
    threads = next(iter(recs.values())).threads()
    orch.close()
  median = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
  result = dict(shape=_SHAPE.value, warmup_s=warmup_s, rounds=rounds, median=median,
                ratio=median['rollout_tok_s'] / median['standalone_tok_s'],
                engine_ratio=median['engine_tok_s'] / median['standalone_tok_s'],
                step_ratio=median['step_tok_s'] / median['standalone_tok_s'],
                engine_threads=threads, loadavg=os.getloadavg())
  print(f"{_SHAPE.value}: in run / standalone = {result['ratio']:.2f} (rollout), "
        f"{result['engine_ratio']:.2f} (engine busy time), {result['step_ratio']:.2f} (step); "
        f"load average {result['loadavg'][0]:.2f}")
  print(json.dumps(result))


if __name__ == '__main__':
  app.run(main)
