"""One process against Ray workers on this machine, and weights through Ray's object store.

  python experiments/benchmarks/cluster.py [--steps=30] [--warmup=10] [--sizes_mb=1,16,256,1024]

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
and the worker's sum over it (touching every byte), for each size. The last line is
JSON.
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


def time_backend(backend: str, steps: int, warmup: int) -> dict:
  """Median step time (and parts) of the default experiment under `backend`."""
  from experiments import hierarchical_assistant
  from flexmarl.run import build

  config = hierarchical_assistant.get_config()
  config.cluster.backend = backend
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
  return dict(backend=backend, build_s=build_s, step_ms=1e3 * statistics.median(step),
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


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  import ray
  local = time_backend('local', _STEPS.value, _WARMUP.value)
  remote = time_backend('ray', _STEPS.value, _WARMUP.value)
  print(f"{'backend':<8} {'build s':>8} {'step ms':>8} {'rollout ms':>11} {'after ms':>9}")
  for r in (local, remote):
    print(f"{r['backend']:<8} {r['build_s']:>8.1f} {r['step_ms']:>8.1f} {r['rollout_ms']:>11.1f} "
          f"{r['after_rollout_ms']:>9.1f}")
  print(f"ray / local step time: {remote['step_ms'] / local['step_ms']:.2f}x")
  ray.init(include_dashboard=False, _temp_dir='/tmp/flexray')
  publish = time_publish([int(s) for s in _SIZES.value])
  ray.shutdown()
  print(f"{'MB':>6} {'put s':>8} {'get+read s':>11} {'put MB/s':>9} {'publish MB/s':>13}")
  for p in publish:
    print(f"{p['mb']:>6.0f} {p['put_s']:>8.3f} {p['get_and_read_s']:>11.3f} "
          f"{p['put_mb_s']:>9.0f} {p['publish_mb_s']:>13.0f}")
  print(json.dumps(dict(local=local, ray=remote, publish=publish)))


if __name__ == '__main__':
  app.run(main)
