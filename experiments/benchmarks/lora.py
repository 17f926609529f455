"""Full-parameter agents against LoRA agents on one shared base: memory, step time, swaps.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python -m experiments.benchmarks.lora [--preset=base] [--agents=4,16] [--rank=16]

For each team size N in `--agents` and each kind (full, lora), N `AgentTrainer`s of
one model (`--preset`, vocab `--vocab`, fp32, AdamW) are built on the same device
group (the first `--devices` devices, a ('fsdp',) mesh): full agents each with their
own weights, LoRA agents (`--rank`, every projection) as adapters on one
`train.shared_base.SharedBase`. Reported per row: device bytes held (all live arrays on
the devices, after every agent took one step), their share per agent, the state
bytes of one agent (what moves and is checkpointed), and the mean time of one
optimizer step (one micro-batch of `--rows` rows, prompt and answer of `--tokens`
tokens each, then `apply`) over `--steps` rounds of every agent after one warm-up
round. A team that does not fit on the devices is reported as `did not fit`.

Swaps: one full agent's state and one LoRA agent's state moved mesh -> host -> mesh
(`release` / `bind`), best of `--repeats`, in seconds and bytes. The last line is JSON.
"""

import json
import time

import jax
import numpy as np
from absl import app, flags

from flexmarl.models import sharding
from flexmarl.models.lora import LoRAConfig
from flexmarl.models.transformer import PRESETS, ModelConfig
from flexmarl.train import shared_base, grpo
from flexmarl.train.state import OnHost
from flexmarl.train.trainer import AgentTrainer, OptimizerConfig, TrainBatch

_PRESET = flags.DEFINE_string('preset', 'base', f'Model preset: one of {sorted(PRESETS)}.')
_VOCAB = flags.DEFINE_integer('vocab', 256, 'Vocabulary size (presets without their own).')
_AGENTS = flags.DEFINE_list('agents', ['4', '16'], 'Team sizes.')
_RANK = flags.DEFINE_integer('rank', 16, 'LoRA rank (alpha = 2 * rank).')
_DEVICES = flags.DEFINE_integer('devices', 1, 'Devices of the shared mesh (fsdp).')
_ROWS = flags.DEFINE_integer('rows', 16, 'Rows per micro-batch.')
_TOKENS = flags.DEFINE_integer('tokens', 16, 'Prompt and answer tokens per row.')
_STEPS = flags.DEFINE_integer('steps', 3, 'Timed rounds (one step of every agent each).')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Timed swaps per kind; the best is kept.')


def _model(kind: str) -> ModelConfig:
  preset = {'vocab_size': _VOCAB.value, **PRESETS[_PRESET.value]}
  adapters = LoRAConfig(_RANK.value, 2.0 * _RANK.value) if kind == 'lora' else LoRAConfig()
  return ModelConfig(**preset, lora=adapters)


def _batch(vocab: int) -> TrainBatch:
  rng = np.random.default_rng(0)
  n, t = _ROWS.value, _TOKENS.value
  return TrainBatch.from_rows(
      [list(rng.integers(3, vocab, t)) for _ in range(n)],
      [rng.integers(3, vocab, t) for _ in range(n)],
      [np.full(t, -1.0, np.float32) for _ in range(n)], rng.normal(size=n).astype(np.float32),
      prompt_len=t, response_len=t, pad_id=0)


def _device_bytes(devices) -> int:
  """Bytes of the live arrays' shards on `devices` (each array counted once)."""
  ids = {d.id for d in devices}
  return sum(s.data.nbytes for x in jax.live_arrays() for s in x.addressable_shards
             if s.device.id in ids)


def _team(kind: str, n: int, mesh) -> list[AgentTrainer]:
  cfg = _model(kind)
  base = shared_base.SharedBase(shared_base.load_base(cfg, '', seed=0)) if kind == 'lora' else None
  return [AgentTrainer(f'{kind}{i}', cfg, OptimizerConfig(learning_rate=1e-4),
                       grpo.GRPOConfig(), mesh, seed=i + 1, base=base) for i in range(n)]


def _round(team: list[AgentTrainer], batch: TrainBatch) -> float:
  start = time.perf_counter()
  for t in team:
    t.accumulate(batch)
    t.dispatch_apply()
  jax.block_until_ready([t.state.params for t in team])
  return time.perf_counter() - start


def _bench_team(kind: str, n: int, mesh, batch: TrainBatch) -> dict:
  before = _device_bytes(mesh.devices.flat)
  try:
    team = _team(kind, n, mesh)
    _round(team, batch)  # warm-up: compiles, and every agent's optimizer state is made
    held = _device_bytes(mesh.devices.flat) - before
    step_s = np.mean([_round(team, batch) for _ in range(_STEPS.value)]) / n
  except jax.errors.JaxRuntimeError as e:  # an allocation the devices could not make
    if 'RESOURCE_EXHAUSTED' not in str(e):
      raise
    return dict(kind=kind, agents=n, fits=False)
  return dict(kind=kind, agents=n, fits=True, device_bytes=held, per_agent_bytes=held / n,
              state_bytes=team[0].state.nbytes, step_s=float(step_s))


def _swap(kind: str, mesh, batch: TrainBatch) -> dict:
  t = _team(kind, 1, mesh)[0]
  t.accumulate(batch)
  t.apply()
  times = []
  for _ in range(_REPEATS.value):
    start = time.perf_counter()
    t.release(OnHost())
    t.bind(mesh)
    jax.block_until_ready(t.state.params)
    times.append(time.perf_counter() - start)
  return dict(kind=kind, state_bytes=t.state.nbytes, mesh_host_mesh_s=min(times))


def main(argv):
  del argv
  mesh = sharding.make_mesh(jax.devices()[:_DEVICES.value], (_DEVICES.value,), ('fsdp',))
  batch = _batch(_model('full').vocab_size)
  print(f'{jax.devices()[0].platform}: preset {_PRESET.value}, rank {_RANK.value}, '
        f'{_DEVICES.value} device(s)')
  rows = []
  for n in map(int, _AGENTS.value):
    for kind in ('full', 'lora'):
      r = _bench_team(kind, n, mesh, batch)
      rows.append(r)
      if not r['fits']:
        print(f'{kind:>4} x{n:<3} did not fit')
        continue
      print(f"{kind:>4} x{n:<3} device {r['device_bytes'] / 2**20:9.1f} MiB  per agent "
            f"{r['per_agent_bytes'] / 2**20:8.1f} MiB  state {r['state_bytes'] / 2**20:8.2f} MiB"
            f"  step {r['step_s'] * 1e3:8.1f} ms")
  swaps = [_swap(kind, mesh, batch) for kind in ('full', 'lora')]
  for s in swaps:
    print(f"swap {s['kind']:>4}: {s['state_bytes'] / 2**20:8.2f} MiB mesh->host->mesh "
          f"{s['mesh_host_mesh_s'] * 1e3:8.2f} ms")
  print(json.dumps(dict(preset=_PRESET.value, rank=_RANK.value, devices=_DEVICES.value,
                        teams=rows, swaps=swaps)))


if __name__ == '__main__':
  app.run(main)
