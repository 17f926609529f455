"""One process against Ray workers on this machine, weights through Ray's object store, and
`sync` against `flexmarl` with rollout and training on cores of their own.

  python experiments/benchmarks/cluster.py [--steps=30] [--warmup=10] [--sizes_mb=1,16,256,1024]
  python experiments/benchmarks/cluster.py --parts=cores --steps=60 --warmup=30 --rounds=2

Part 1 runs the default experiment (`experiments/hierarchical_assistant.py`, 8 CPU
devices: 4 training meshes, 4 rollout instances of their own) with
`cluster.backend=local` and then `cluster.backend=ray` (each mesh and each instance a
process of its own, 8 worker processes), same config and seed, and reports the median
step time and its parts (rollout; training left after the rollout) side by side. On two
cores the Ray run's processes compete for the same cores as the driver's; the per-call
costs (object-store puts and gets, actor calls, host copies of the weights) are what the
ratio shows.

Part 2 times one weight publish through the object store: `ray.put` of a parameter
tree of S bytes (float32 arrays of 4 MB at most) in the driver, then `ray.get` of it in
a worker actor on the same node (zero-copy: the worker maps the driver's shared memory)
and the worker's sum over it (touching every byte), for each size.

Part 3 (`--parts=cores`) runs the default experiment under Ray with `sync` and with
`flexmarl`, once with every process free to use every core and once with
`cluster.rollout_cores` and `cluster.trainer_cores` set to the two halves of the
machine's cores (on two cores: the rollout workers on core 0, the trainers on core 1;
the driver on both). In one process the schedules share every core, so overlap has
little to gain (`pipeline.py`); pinned, the rollout and the training run on separate
hardware, as the paper's pools do, which is what the micro-batch pipeline overlaps. Each
run builds its Ray workers anew; the four runs alternate `--rounds` times, so drift
over minutes hits each alike. Reported: every run, then per pinning the median over
rounds and `sync` / `flexmarl`.

The last line is JSON.
"""

import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # the experiments package
os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

from absl import app, flags, logging  # noqa: E402

_STEPS = flags.DEFINE_integer('steps', 30, 'Timed steps per backend.')
_WARMUP = flags.DEFINE_integer('warmup', 10, 'Untimed steps first (compilation).')
_SIZES = flags.DEFINE_list('sizes_mb', ['1', '16', '256', '1024'], 'Weight sizes, MB.')
_PARTS = flags.DEFINE_list('parts', ['backends', 'publish'], 'Parts to run: backends, '
                           'publish, cores.')
_ROUNDS = flags.DEFINE_integer('rounds', 2, 'Part 3: rounds of the four runs.')


def time_backend(backend: str, steps: int, warmup: int, schedule: str = 'flexmarl',
                 **cluster) -> dict:
  """Median step time (and parts) of the default experiment under `backend` and
  `schedule`; `cluster`: other fields of `config.cluster`."""
  from experiments import hierarchical_assistant
  from flexmarl.run import build

  config = hierarchical_assistant.get_config()
  config.schedule = schedule
  config.cluster.update(dict(cluster, backend=backend))
  with tempfile.TemporaryDirectory() as workdir:
    t0 = time.perf_counter()
    orch = build(config, workdir, log=lambda *_: None)
    build_s = time.perf_counter() - t0
    for _ in range(warmup):
      orch.run_step()
    step, rollout, after = [], [], []
    for _ in range(steps):
      t = time.perf_counter()
      lines = orch.run_step()
      step.append(time.perf_counter() - t)
      rollout.append(lines['team']['rollout_s'])
      after.append(lines['team']['train_s'])
    orch.close()
  return dict(backend=backend, schedule=schedule, **cluster, build_s=build_s,
              step_ms=1e3 * statistics.median(step),
              rollout_ms=1e3 * statistics.median(rollout),
              after_rollout_ms=1e3 * statistics.median(after))


class Reader:
  """A worker that reads published weights, as a rollout worker does."""

  def read(self, tree: dict) -> float:
    import numpy as np
    return float(sum(np.sum(x) for x in tree.values()))


def time_publish(sizes_mb: list[int]) -> list[dict]:
  import numpy as np
  import ray
  reader = ray.remote(Reader).options(num_cpus=0).remote()
  ray.get(reader.read.remote({}))
  out = []
  for mb in sizes_mb:
    leaf = min(mb, 4) * 2**20 // 4
    tree = {f'w{i}': np.full(leaf, 1.0, np.float32) for i in range(max(1, mb // 4))}
    nbytes = sum(x.nbytes for x in tree.values())
    t0 = time.perf_counter()
    ref = ray.put(tree)
    put_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ray.get(reader.read.remote(ref))
    get_s = time.perf_counter() - t0
    out.append(dict(mb=nbytes / 2**20, put_s=put_s, get_and_read_s=get_s,
                    put_mb_s=nbytes / 2**20 / put_s, publish_mb_s=nbytes / 2**20 / (put_s + get_s)))
    del ref, tree
  ray.kill(reader)
  return out


def split_cores() -> tuple[str, str]:
  """The machine's usable cores as two halves, for the rollout and the trainers."""
  cores = sorted(os.sched_getaffinity(0))
  half = max(1, len(cores) // 2)
  return (','.join(map(str, cores[:half])), ','.join(map(str, cores[half:] or cores)))


def time_separate_cores(steps: int, warmup: int, rounds: int) -> list[dict]:
  """Part 3: `sync` and `flexmarl` under Ray, unpinned and pinned, alternated."""
  rollout, trainer = split_cores()
  pins = {'unpinned': {}, 'pinned': dict(rollout_cores=rollout, trainer_cores=trainer)}
  runs = []
  for r in range(rounds):
    for pin, cores in pins.items():
      for schedule in ('sync', 'flexmarl'):
        run = dict(time_backend('ray', steps, warmup, schedule, **cores), pin=pin, round=r)
        print(f"round {r} {pin:<9} {schedule:<9} step {run['step_ms']:6.1f} ms, rollout "
              f"{run['rollout_ms']:6.1f} ms, after it {run['after_rollout_ms']:5.1f} ms",
              flush=True)
        runs.append(run)
  for pin in pins:
    med = {s: statistics.median(r['step_ms'] for r in runs if (r['pin'], r['schedule']) ==
                                (pin, s)) for s in ('sync', 'flexmarl')}
    print(f"{pin:<9} sync {med['sync']:6.1f} ms, flexmarl {med['flexmarl']:6.1f} ms: "
          f"flexmarl {med['sync'] / med['flexmarl']:.2f}x sync")
  return runs


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  import ray
  out = {}
  if 'backends' in _PARTS.value:
    local = out['local'] = time_backend('local', _STEPS.value, _WARMUP.value)
    remote = out['ray'] = time_backend('ray', _STEPS.value, _WARMUP.value)
    print(f"{'backend':<8} {'build s':>8} {'step ms':>8} {'rollout ms':>11} {'after ms':>9}")
    for r in (local, remote):
      print(f"{r['backend']:<8} {r['build_s']:>8.1f} {r['step_ms']:>8.1f} "
            f"{r['rollout_ms']:>11.1f} {r['after_rollout_ms']:>9.1f}")
    print(f"ray / local step time: {remote['step_ms'] / local['step_ms']:.2f}x")
  if 'publish' in _PARTS.value:
    ray.init(include_dashboard=False, _temp_dir='/tmp/flexray')
    publish = out['publish'] = time_publish([int(s) for s in _SIZES.value])
    ray.shutdown()
    print(f"{'MB':>6} {'put s':>8} {'get+read s':>11} {'put MB/s':>9} {'publish MB/s':>13}")
    for p in publish:
      print(f"{p['mb']:>6.0f} {p['put_s']:>8.3f} {p['get_and_read_s']:>11.3f} "
            f"{p['put_mb_s']:>9.0f} {p['publish_mb_s']:>13.0f}")
  if 'cores' in _PARTS.value:
    out['cores'] = time_separate_cores(_STEPS.value, _WARMUP.value, _ROUNDS.value)
  print(json.dumps(out))


if __name__ == '__main__':
  app.run(main)
