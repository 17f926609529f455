"""How JAX and the vLLM engines of a run share GPU memory.

JAX's GPU client takes a fraction of every GPU's memory when it starts
(`XLA_PYTHON_CLIENT_MEM_FRACTION`, 0.75 unless set; preallocated unless
`XLA_PYTHON_CLIENT_PREALLOCATE=false`), and a vLLM engine asks for its own fraction
(`rollout.vllm.gpu_memory_utilization`) of its GPU and refuses to start when that much
is not free. Left at their defaults they do not fit together. FlexMARL runs every vLLM
engine inside the training process, and vLLM starts such an engine on the process's
first GPU whatever device the placement names for the instance, so the first GPU holds
JAX's share and every engine's, the others JAX's alone.

`plan` splits `BUDGET` of a GPU equally among what runs on the first one: JAX alone
gets all of it; JAX and k engines get BUDGET / (k + 1) each. A value the user set (the
environment variable, the config field) is kept and the rest is fitted around it.
`run.build` sets the plan before JAX starts its GPU client, and once it has started
checks what each share holds against what the placement puts in it. On CPU none of
this applies (the variables are read by the GPU client only).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping

from flexmarl.config import TeamSpec
from flexmarl.core.errors import ConfigError
from flexmarl.rollout import backends
from flexmarl.train.sizing import state_nbytes

BUDGET = 0.9  # of a GPU, for JAX and vLLM together; the rest: CUDA contexts, workspaces
JAX_FRACTION = 'XLA_PYTHON_CLIENT_MEM_FRACTION'
JAX_FRACTION_NEW = 'XLA_CLIENT_MEM_FRACTION'  # the newer name; jax refuses both at once
PREALLOCATE = 'XLA_PYTHON_CLIENT_PREALLOCATE'
VLLM_FIELD = 'rollout.vllm.gpu_memory_utilization'


@dataclasses.dataclass(frozen=True)
class Shares:
  """The fractions of a GPU's memory JAX and each vLLM engine may use."""

  jax: float
  vllm: float  # per engine; 0 without engines
  engines: int  # vLLM engines on the first GPU
  preallocate: bool
  jax_given: str = ''  # the variable the user set JAX's fraction with ('' : planned)
  vllm_given: bool = False  # the user set rollout.vllm.gpu_memory_utilization
  problem: str = ''  # why these shares cannot work on a GPU ('' : they can)

  def env(self) -> dict[str, str]:
    """The variables to set before JAX starts (those the user did not set; none when
    the shares cannot work, so that `check` can say why once JAX is on a GPU)."""
    return {} if self.jax_given or self.problem else {JAX_FRACTION: f'{self.jax:.4g}'}

  def check(self) -> None:
    """Raise ConfigError (naming both numbers) when the shares cannot work on a GPU."""
    if self.problem:
      raise ConfigError(self.problem)

  def describe(self) -> str:
    jax = (f'{self.jax_given}={self.jax:.4g} (yours)' if self.jax_given
           else f'{JAX_FRACTION}={self.jax:.4g}')
    line = f'GPU memory: JAX {jax}, preallocated: {"yes" if self.preallocate else "no"}'
    if self.engines:
      line += (f'; {self.engines} vLLM engine(s) on the first GPU, {VLLM_FIELD}='
               f'{self.vllm:.4g}{" (yours)" if self.vllm_given else ""} each')
    return line + ' (set the variable or the field to change them).'


def plan(engines: int, environ: Mapping[str, str], vllm_given: float | None = None,
         budget: float = BUDGET) -> Shares:
  """The shares for `engines` vLLM engines beside JAX, keeping what the user set
  (`environ`'s variables, `vllm_given`). Shares that cannot work carry the reason
  (`Shares.problem`): it only matters on a GPU, which is known once JAX has started."""
  name = next((n for n in (JAX_FRACTION_NEW, JAX_FRACTION) if environ.get(n)), '')
  preallocate = environ.get(PREALLOCATE, 'true') not in ('false', 'False', '0')
  try:
    jax = float(environ[name]) if name else None
  except ValueError:
    jax = float('nan')
  if jax is not None and not 0 < jax <= 1:
    return Shares(0.0, 0.0, engines, preallocate, name, vllm_given is not None,
                  f'{name}={environ[name]!r}: give a fraction of GPU memory in (0, 1], '
                  'e.g. 0.5, or leave it unset.')
  if not engines:
    return Shares(jax or budget, 0.0, 0, preallocate, name)
  if vllm_given is not None:
    vllm = vllm_given
    jax = jax if jax is not None else budget - engines * vllm
  elif jax is not None:
    vllm = (budget - jax) / engines
  else:
    jax = vllm = budget / (engines + 1)
  total = jax + engines * vllm
  jax_text = f'{name or JAX_FRACTION}={jax:.4g} (JAX)'
  vllm_text = f'{VLLM_FIELD}={vllm:.4g} for each of {engines} vLLM engine(s) on the first GPU'
  if total > 1:
    problem = f'{jax_text} and {vllm_text} add up to {total:.4g} of its memory.'
  elif jax <= 0:
    problem = f'{vllm_text} leaves {jax:.4g} of {budget} of it for JAX.'
  elif vllm <= 0:
    problem = f'{jax_text} leaves {vllm:.4g} of {budget} of the first GPU for vLLM.'
  else:
    problem = ''
  if problem:
    problem += (f' Fix: set them so that JAX + {engines} x vLLM <= {budget}, e.g. leave both '
                'unset to share the GPU equally, or use fewer rollout instances.')
  return Shares(jax, vllm, engines, preallocate, name, vllm_given is not None, problem)


def check_fits(shares: Shares, device_bytes: int, jax_needs: Mapping[int, Mapping[str, int]],
               engine_needs: Mapping[str, int]) -> None:
  """What the placement puts in each share fits it; `device_bytes`: one GPU's memory.

  `jax_needs`: per device id, what JAX holds there at least (name → bytes: training
  states, sampler copies of weights); `engine_needs`: per engine, its weights and the KV
  cache of one longest sequence. Activations and compiled programs come on top, so
  passing this check does not promise a fit, but failing it means no fit."""
  gb = lambda b: f'{b / 1e9:.3g} GB' if b >= 1e8 else f'{b / 1e6:.3g} MB'
  have = shares.jax * device_bytes
  for device, parts in jax_needs.items():
    need = sum(parts.values())
    if need > have:
      what = ', '.join(f'{n} {gb(b)}' for n, b in parts.items())
      raise ConfigError(
          f'GPU {device}: JAX gets {shares.jax:.4g} of it ({gb(have)}) but what the placement '
          f'puts there needs at least {gb(need)} ({what}). Fix: raise {JAX_FRACTION}'
          f'{f" and lower {VLLM_FIELD}" if shares.engines else ""}, use smaller models or '
          'more devices' + ('; a training pool mesh holds two states at once unless '
                            'config.training.states_per_mesh=1 (its swaps then wait)'
                            if any(n.startswith('pool') for n in parts) else '') + '.')
  have = shares.vllm * device_bytes
  for engine, need in engine_needs.items():
    if need > have:
      raise ConfigError(
          f'vLLM engine {engine}: {VLLM_FIELD}={shares.vllm:.4g} gives it {gb(have)} of the '
          f'first GPU, but its weights and one sequence of rollout.vllm.max_model_len need '
          f'{gb(need)}. Fix: raise {VLLM_FIELD} (and lower {JAX_FRACTION}), use fewer '
          'rollout instances, a shorter max_model_len or a smaller model.')


def needs(spec: TeamSpec) -> tuple[dict[int, dict[str, int]], dict[str, int]]:
  """What `spec`'s placement puts in JAX's share of each device and in each vLLM
  engine's, at least (see `check_fits`), from shapes alone: the training states, and
  what the rollout backend's instances hold (`Backend.memory`)."""
  p = spec.placement
  state = {n: state_nbytes(a.model, a.optimizer, a.grpo) for n, a in spec.agents.items()}
  held: dict[int, dict[str, int]] = collections.defaultdict(dict)

  def put(devices: tuple[int, ...], what: str, nbytes: int) -> None:
    for d in devices:  # sharded evenly over the mesh, roughly
      held[d][what] = nbytes // len(devices)

  for name, m in p.train.items():
    if m.devices:
      put(m.devices, f'{name} state', state[name])
  held_at_once = spec.training.states_per_mesh
  for i, m in enumerate(p.pool):  # the largest states of its shape it holds at once
    largest = sorted((n for n, t in p.train.items() if t.shape == m.shape),
                     key=lambda n: (-state[n], n))[:held_at_once]
    put(m.devices, f"pool{i} ({' + '.join(largest)} state{'s' * (len(largest) > 1)})",
        sum(state[n] for n in largest))
  in_jax, engines = backends.get(spec.rollout.backend).memory(spec)
  for devices, what, nbytes in in_jax:
    put(devices, what, nbytes)
  return dict(held), engines


def settle(spec: TeamSpec, shares: Shares, device_bytes: int) -> TeamSpec:
  """`spec` with the planned vLLM share, once JAX has started on GPUs of `device_bytes`
  each; raises ConfigError when the shares or the placement cannot fit."""
  shares.check()
  check_fits(shares, device_bytes, *needs(spec))
  if not shares.engines:
    return spec
  vllm = {**spec.rollout.vllm, 'gpu_memory_utilization': shares.vllm}
  return dataclasses.replace(spec, rollout=dataclasses.replace(spec.rollout, vllm=vllm))
