"""Agent-state swap throughput per path, against plain copies of the same bytes.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python -m experiments.benchmarks.swap [--sizes_mb=10,100] [--repeats=3] [--dir=/tmp/x]

A synthetic state of S bytes (float32 arrays of at most 64 MiB, sharded over a ('fsdp',)
mesh of 2 devices) is moved with `flexmarl.train.state.move` along each path:
mesh → mesh (to 2 other devices), mesh → host, host → mesh, host → storage (one raw file
per array), storage → host, storage → mesh. The baseline of each path is the plainest copy of the same
bytes: one `jax.device_put` of the arrays to the same target shardings (pinned host memory
for host), and for storage a raw `ndarray.tofile` / `np.fromfile` of each array. Reports
the best of `repeats` for each, as MB/s and as the ratio move / baseline (1.0: no overhead;
storage reads come from the page cache). The last line is JSON.

A real agent's state (`--agent_presets=tiny,base`, instead of the above): an
`AgentTrainer` of each model preset (its params, AdamW state and RNG: many small arrays,
where a swap's fixed costs per array show) on a (1, 1) mesh, released to host memory
and bound again, `--cycles` times; reports the median milliseconds of a release, of a
bind back onto the same mesh, and of a bind onto another mesh.

End to end (`--end_to_end_steps=N`, instead of the above): the default experiment
(`experiments/hierarchical_assistant.py`, 4 agents) with each agent on a mesh of its own,
and with a training pool of half as many meshes (`training.pool_devices=2`), alternated
`--end_to_end_repeats` times; reports the median step time of the steady state (steps after
`--end_to_end_warmup`) of each, their ratio, and the fraction of the pool run's swap time
(`swap_s`, the copies) that did not block the schedule (`swap_wait_s`) over those steps.
"""

import json
import os
import statistics
import shutil
import tempfile
import time

import jax
import numpy as np
from absl import app, flags
from jax.sharding import PartitionSpec as P

from flexmarl.models import sharding
from flexmarl.train import state as state_lib
from flexmarl.train.state import AgentState, InStorage, OnHost, OnMesh

_SIZES = flags.DEFINE_list('sizes_mb', ['10', '100'], 'State sizes in MB (1e6 bytes); '
                           'add 1000,2000 for the large states (minutes on 2 cores).')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Timed repeats per path; the best is kept.')
_DIR = flags.DEFINE_string('dir', None, 'Storage folder (default: a temporary folder).')
_END_TO_END = flags.DEFINE_integer('end_to_end_steps', 0, 'Run the end-to-end comparison '
                                   'for this many steps instead (0: the swap paths).')
_E2E_WARMUP = flags.DEFINE_integer('end_to_end_warmup', 10, 'Steps left out of the end-to-end '
                                    'figures (compilation, first swaps).')
_E2E_REPEATS = flags.DEFINE_integer('end_to_end_repeats', 1, 'Alternated runs of each setup.')
_PRESETS = flags.DEFINE_list('agent_presets', [], 'Time the swaps of a real agent state of '
                             'these model presets instead (e.g. tiny,base).')
_CYCLES = flags.DEFINE_integer('cycles', 50, 'Release/bind cycles per agent preset.')
_CHUNK = 64 * 2**20


def _state(nbytes: int, mesh) -> tuple[AgentState, OnMesh]:
  rng = np.random.default_rng(0)
  sizes = [_CHUNK] * (nbytes // _CHUNK) + ([nbytes % _CHUNK] if nbytes % _CHUNK else [])
  cols = 1024
  params = {f'w{i}': rng.standard_normal((max(2, s // 4 // cols) // 2 * 2, cols), np.float32)
            for i, s in enumerate(sizes)}
  specs = {k: P('fsdp') for k in params}
  location = OnMesh(mesh, {'params': sharding.on_mesh(specs, mesh), 'opt_state': ()})
  host = AgentState(params=params, opt_state=(), rng=np.zeros(2, np.uint32),
                    location=OnHost())
  return state_lib.move(host, location)[0], location


def _best(fn, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return min(times)


def _write_raw(arrays: dict, path: str) -> None:
  os.makedirs(path, exist_ok=True)
  for k, x in arrays.items():
    np.asarray(x).tofile(os.path.join(path, k))


def _read_raw(like: dict, path: str) -> dict:
  return {k: np.fromfile(os.path.join(path, k), x.dtype).reshape(x.shape) for k, x in like.items()}


def _bench(nbytes: int, root: str, repeats: int) -> dict:
  devices = jax.devices()
  mesh_a = sharding.make_mesh(devices[:2], (2,), ('fsdp',))
  mesh_b = sharding.make_mesh(devices[2:4], (2,), ('fsdp',))
  on_a, at_a = _state(nbytes, mesh_a)
  nbytes = on_a.nbytes  # whole rows of 1024 floats: within 0.01% of the asked size
  at_b = OnMesh(mesh_b, {'params': sharding.on_mesh({k: P('fsdp') for k in on_a.params}, mesh_b),
                         'opt_state': ()})
  host, _ = state_lib.move(on_a, OnHost())
  path = os.path.join(root, f'state_{nbytes}')
  stored, _ = state_lib.move(host, InStorage(path))
  raw = os.path.join(root, f'raw_{nbytes}')
  host_np = jax.device_get(host.params)
  pinned = {k: x.sharding for k, x in host.params.items()}

  def put(arrays, shardings):
    return lambda: jax.block_until_ready(jax.device_put(arrays, shardings))

  def save_move():
    shutil.rmtree(path, ignore_errors=True)
    state_lib.move(host, InStorage(path))

  def save_raw():
    shutil.rmtree(raw, ignore_errors=True)
    _write_raw(host_np, raw)

  paths = {
      'mesh->mesh': (lambda: state_lib.move(on_a, at_b), put(on_a.params, at_b.shardings['params'])),
      'mesh->host': (lambda: state_lib.move(on_a, OnHost()), put(on_a.params, pinned)),
      'host->mesh': (lambda: state_lib.move(host, at_a), put(host.params, at_a.shardings['params'])),
      'host->storage': (save_move, save_raw),
      'storage->host': (lambda: state_lib.move(stored, OnHost()), lambda: _read_raw(host_np, raw)),
      'storage->mesh': (lambda: state_lib.move(stored, at_b),
                        lambda: jax.block_until_ready(jax.device_put(
                            _read_raw(host_np, raw), at_b.shardings['params']))),
  }
  out = {}
  for name, (moving, plain) in paths.items():
    t_move, t_plain = _best(moving, repeats), _best(plain, repeats)
    out[name] = dict(move_mb_s=nbytes / t_move / 1e6, plain_mb_s=nbytes / t_plain / 1e6,
                     ratio=t_plain / t_move)
  assert np.array_equal(np.asarray(state_lib.move(stored, at_b)[0].params['w0']), host_np['w0'])
  shutil.rmtree(path, ignore_errors=True)
  shutil.rmtree(raw, ignore_errors=True)
  return out


def _agent_swaps(preset: str, cycles: int) -> dict:
  from flexmarl.models.transformer import PRESETS, ModelConfig
  from flexmarl.train.grpo import GRPOConfig
  from flexmarl.train.spec import OptimizerConfig
  from flexmarl.train.trainer import AgentTrainer

  layout = sharding.MeshLayout((1, 1), ('data', 'fsdp'))
  trainer = AgentTrainer(preset, ModelConfig(**{**PRESETS[preset], 'vocab_size': 512}),
                         OptimizerConfig(), GRPOConfig(), layout, seed=0)
  meshes = [sharding.make_mesh(jax.devices()[i:i + 1], (1, 1), layout.axes) for i in (0, 1)]
  times = {'release': [], 'bind, same mesh': [], 'bind, other mesh': []}
  trainer.bind(meshes[0])
  for i in range(cycles + 2):  # the first two compile
    for name, mesh in (('bind, same mesh', meshes[i % 2]), ('bind, other mesh', meshes[1 - i % 2])):
      t0 = time.perf_counter()
      trainer.release()
      t1 = time.perf_counter()
      trainer.bind(mesh)
      if i >= 2:
        times['release'].append(t1 - t0)
        times[name].append(time.perf_counter() - t1)
  return dict(arrays=len(jax.tree.leaves(trainer.state.arrays())), bytes=trainer.state.nbytes,
              **{k: statistics.median(v) * 1e3 for k, v in times.items()})


def _end_to_end(steps: int, warmup: int, repeats: int, root: str) -> dict:
  from experiments import hierarchical_assistant
  from flexmarl.config import training_config
  from flexmarl.main import train
  from flexmarl.metrics.writer import read_metrics

  runs = {'own meshes': [], 'pool of 2 meshes': []}
  for repeat in range(repeats):
    for name, pool_devices in (('own meshes', 0), ('pool of 2 meshes', 2)):
      config = hierarchical_assistant.get_config('runlocal')
      config.steps, config.checkpoint_every = steps, steps
      config.training = training_config(pool_devices=pool_devices)
      workdir = os.path.join(root, f"{name.replace(' ', '_')}_{repeat}")
      train(config, workdir, log=lambda *_: None)
      lines = [l for l in read_metrics(os.path.join(workdir, 'metrics.jsonl'))
               if l['step'] > warmup]
      agents = [l for l in lines if l['agent'] != 'team']
      swap_s = sum(l.get('swap_s', 0.0) for l in agents)
      wait_s = sum(l.get('swap_wait_s', 0.0) for l in agents)
      run = dict(step_s=statistics.median(l['step_time_s'] for l in lines
                                          if l['agent'] == 'team'),
                 swaps=sum(l.get('swaps', 0) for l in agents), swap_s=swap_s,
                 swap_wait_s=wait_s, hidden=1 - wait_s / swap_s if swap_s else None)
      runs[name].append(run)
      print(name, repeat, run, flush=True)
  out = {name: dict(step_s=statistics.median(r['step_s'] for r in rs), runs=rs)
         for name, rs in runs.items()}
  out['ratio'] = out['pool of 2 meshes']['step_s'] / out['own meshes']['step_s']
  return out


def main(argv):
  del argv
  if _PRESETS.value:
    results = {p: _agent_swaps(p, _CYCLES.value) for p in _PRESETS.value}
    for p, r in results.items():
      print(f"{p:<6} {r['arrays']} arrays, {r['bytes'] / 1e6:.1f} MB: release "
            f"{r['release']:.2f} ms, bind same mesh {r['bind, same mesh']:.2f} ms, "
            f"other mesh {r['bind, other mesh']:.2f} ms")
    print(json.dumps(results))
    return
  if _END_TO_END.value:
    with tempfile.TemporaryDirectory() as tmp:
      print(json.dumps(_end_to_end(_END_TO_END.value, _E2E_WARMUP.value, _E2E_REPEATS.value,
                                    _DIR.value or tmp)))
    return
  memories = {m.kind for m in jax.devices()[0].addressable_memories()}
  print(f'{jax.devices()[0].platform}, host memory for OnHost: '
        f"{'pinned_host' if 'pinned_host' in memories else 'numpy'}")
  results = {}
  with tempfile.TemporaryDirectory() as tmp:
    root = _DIR.value or tmp
    for mb in map(int, _SIZES.value):
      results[mb] = _bench(mb * 10**6, root, _REPEATS.value)
      for name, r in results[mb].items():
        print(f"{mb:>6} MB  {name:<14} move {r['move_mb_s']:>8.0f} MB/s   plain "
              f"{r['plain_mb_s']:>8.0f} MB/s   ratio {r['ratio']:.2f}")
  print(json.dumps(results))


if __name__ == '__main__':
  app.run(main)
