"""Whether a run fits this machine's memory, train steps included, before it starts:

  python -m flexmarl.plan_memory --config=experiments/tool_team.py:path,qwen

The report a run logs as it starts counts each device group's bases and states from
shapes. A train step needs more on top: the activations its backward keeps, for a
micro-batch of long prompts on a large model the largest part (16 rows of 536 tokens on
Qwen2.5-0.5B: 8.7 GiB, where its base is 2.4). This compiles each agent's gradient at the
longest rows it can get (`flexmarl.train.sizing.train_step_scratch`: `micro_batch` rows
of `max_prompt_len` + `max_new_tokens` tokens, no prompt shared) and asks XLA for its
scratch, then adds what trains at once: on CPU every device group's share of the one host
memory; on a GPU each group on its own devices. Not counted: the sampler's KV caches and
vLLM's share of a GPU, the process itself: a plan fits within 80 % of the memory. Exits
1 when it does not, naming the fields that shrink it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any, NamedTuple

from absl import app, flags
from ml_collections import config_flags



# What is not counted (the sampler's caches, the process itself) needs room too: the
# 0.5B team above was killed with 22.4 of 23.5 GiB planned.
MARGIN = 0.8


def _size(n: int) -> str:
  return f'{n / 2**30:.2f} GiB' if n >= 2**30 else f'{n / 2**20:.1f} MiB'


def _machine_bytes(platform: str, device) -> int | None:
  """Memory one device group can use: the host's on CPU, one device's elsewhere."""
  if platform == 'cpu':
    return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  return (device.memory_stats() or {}).get('bytes_limit')


def _peak(group: Mapping, scratch: Mapping[str, int]) -> int:
  """A group's most: what it holds, plus the largest step of each set of agents that
  train there at once (a training pool's agents take turns: one set)."""
  from flexmarl.runtime.memory import held_bytes
  return held_bytes(group) + sum(max(scratch[n] for n in names) for names in group['training'])


class MemoryPlan(NamedTuple):
  lines: list[str]  # the report
  spec: Any  # the placed TeamSpec
  scratch: dict[str, int]  # per agent, one train step's
  need: dict[str, int]  # per memory (the host, or a device group's device), the most
  fits: bool


def plan(config) -> MemoryPlan:
  """The report, and whether the run fits (within MARGIN of each memory)."""
  import jax
  from flexmarl.config import place_team, team_spec
  from flexmarl.core.errors import ConfigError
  from flexmarl.run import load_tokenizers
  from flexmarl.runtime.memory import describe_memory, holdings
  from flexmarl.train.sizing import train_step_scratch
  from flexmarl.workflows import build_workflow
  tokenizers, _ = load_tokenizers(config)
  spec = team_spec(config, {n: t.vocab_size for n, t in tokenizers.items()},
                   build_workflow(config.workflow).agent_names())
  if spec.cluster.on_ray:
    raise ConfigError("config.cluster.backend='ray': this plans a run in one process; plan "
                      "it with cluster.backend='local' on as many devices (XLA_FLAGS) instead.")
  devices = jax.devices()
  spec = place_team(spec, [d.id for d in devices])
  lines = [describe_memory(spec.agents, spec.placement),
           f'a train step\'s scratch (XLA\'s compiled gradient of micro_batch rows of '
           f'max_prompt_len={spec.max_prompt_len} + max_new_tokens tokens, none sharing a prompt):']
  scratch, compiled = {}, {}
  for n, a in spec.agents.items():
    shape = (a.model, a.grpo, a.micro_batch, spec.max_prompt_len, a.sampling.max_new_tokens)
    if shape not in compiled:
      compiled[shape] = train_step_scratch(a.model, a.grpo, a.micro_batch,
                                           spec.max_prompt_len, a.sampling.max_new_tokens)
    scratch[n] = compiled[shape]
    lines.append(f'  {n:<12} {a.micro_batch} rows x {spec.max_prompt_len + a.sampling.max_new_tokens} '
                 f'tokens: {_size(scratch[n])}'
                 + ('' if a.model.remat else '  (model.remat=True keeps less)'))
  groups = holdings(spec.agents, spec.placement)[3]
  platform = devices[0].platform
  if platform == 'cpu':  # every group's arrays live in the one host memory
    pools = {'the host': sum(_peak(g, scratch) for g in groups.values())}
  else:
    pools = {f'device group {list(d)}': _peak(g, scratch) // len(d) for d, g in groups.items()}
  limit = _machine_bytes(platform, devices[0])
  fits = True
  for where, need in pools.items():
    if limit is None:
      lines.append(f'{where}: {_size(need)} at most (this device does not say its memory)')
      continue
    verdict = ('fits' if need <= MARGIN * limit else
               'may NOT fit' if need <= limit else 'does NOT fit')
    fits &= verdict == 'fits'
    lines.append(f'{where}: {_size(need)} at most of {_size(limit)}: {verdict}')
  if not fits:
    lines.append('to shrink a train step: a smaller agents.NAME.micro_batch (rows at once), '
                 'agents.NAME.model.remat=True with scan_layers=True (each layer recomputed '
                 'for the backward), a shorter max_prompt_len, or fewer agents training at '
                 'once (training.pool_devices: agents take turns on its meshes).')
  return MemoryPlan(lines, spec, scratch, pools, fits)


def main(argv) -> None:
  del argv
  from flexmarl.core.errors import ConfigError
  from flexmarl.run import quiet_logging
  quiet_logging()
  try:
    result = plan(flags.FLAGS.config)
  except ConfigError as e:  # the message names the fix
    sys.exit(f'ConfigError: {e}')
  print('\n'.join(result.lines))
  sys.exit(0 if result.fits else 1)


if __name__ == '__main__':  # the flag only here: the library (plan) may share a process
  config_flags.DEFINE_config_file('config', None, 'Experiment config file.')  # with main's
  flags.mark_flags_as_required(['config'])
  app.run(main)
