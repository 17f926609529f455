"""One schedule of a simulated setup, run to completion: the real JointOrchestrator,
schedules, rollout engine, balancer and batch builders against a SimClock, simulated
rollout instances (`instances.py`) and trainers (`trainer.py`) whose durations come
from cost models (`costs.py`). `flexmarl.simulate` is its command line.

Reported per schedule: the step times, the utilization of the rollout and training
pools (busy / wall over the run, in device-group seconds) and the critical-path bound:
the busy time along the chain of the spans inside the step that ends last, i.e. the
step time had nothing on that chain waited. All in simulated seconds.

Variants (`VARIANTS`, each labelled with the system it stands for): `flexmarl` and the
paper's ablations `flexmarl_no_pipeline` (each agent's trainer waits for the agent's
whole batch before its first micro-batch, then trains it while the rollout goes on for
the others: the pipeline with one micro-batch per update; load balancing on) and
`flexmarl_no_balance` (the pipeline without load balancing), on separate rollout and
training pools; the baselines as those systems are built:
`colocated` (MARTI: rollout and training on the same devices, every phase change
moving weights and optimizer states, agents trained at once) and `agents_in_turn`
(MAS-RL: colocated, the agents rolled out for and trained one after another,
`sim.turns`); and the exact references `sync` and `sync_parallel` (the same work as
`flexmarl` on its pools, trained after the rollout in turn or at once). The baselines
balance no load, as the systems they stand for.

The step time reported is the mean over the steps after `warmup_steps` (setup, default
0), so that compilation (`compile_s`) shows only where it recurs. With
`step_query_stride` = n > 0 (setup), step k serves queries from index k·n on, so every
variant's step k serves the same queries (common random numbers: how many queries a
step needs varies a lot, and variants compared on different queries differ by that
noise); 0 keeps one stream across steps, as a real run does.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time

import ml_collections
import numpy as np

from flexmarl.build import build_orchestrator
from flexmarl.core.clock import SimClock
from flexmarl.metrics.spans import Span, SpanRecorder
from flexmarl.metrics.utilization import Usage, critical_path, group_usage, track_usage
from flexmarl.metrics.writer import TEAM
from flexmarl.sim.placement import train_tracks
from flexmarl.sim.team import sim_factories, sim_team_spec, sim_workflow
from flexmarl.sim.tokenizer import FastCharTokenizer
from flexmarl.sim.turns import AgentsInTurn



@dataclasses.dataclass(frozen=True)
class Variant:
  schedule: str  # the real schedule that runs it
  balance: bool  # load balancing between and within agents
  system: str  # what it stands for, in the output
  colocated: bool = False  # rollout and training on the same devices (sim.team)
  turns: bool = False  # one agent after another (sim.turns)
  whole_batches: bool = False  # one micro-batch per update: the agent's whole batch


VARIANTS = {
    'flexmarl': Variant('flexmarl', True, 'FlexMARL'),
    'flexmarl_no_pipeline': Variant('flexmarl', True, 'FlexMARL w/o micro-batch pipeline',
                                    whole_batches=True),
    'flexmarl_no_balance': Variant('flexmarl', False, 'FlexMARL w/o load balancing'),
    'colocated': Variant('sync_parallel', False, 'MARTI (colocated)', colocated=True),
    'agents_in_turn': Variant('sync', False, 'MAS-RL (agents in turn)', colocated=True,
                              turns=True),
    'sync': Variant('sync', False, 'reference: train in turn'),
    'sync_parallel': Variant('sync_parallel', False, 'reference: train at once'),
}


class StepTags:
  """A span sink that tags every span with the orchestrator's current step."""

  def __init__(self, recorder: SpanRecorder):
    self.recorder, self.step = recorder, 0

  def add(self, track, name, start, end, **args):
    return self.recorder.add(track, name, start, end, step=self.step, **args)


@dataclasses.dataclass(frozen=True)
class SimResult:
  variant: str
  step_times: list[float]  # simulated seconds, one per step
  rollout_times: list[float]
  bounds: list[float]  # critical-path busy seconds per step
  utilization: dict[str, float]  # per pool ('rollout', 'train') and 'all'
  queries: float  # mean queries per step
  rebalances: int
  wall_s: float  # real seconds the simulation took
  warmup: int = 0  # steps left out of the means

  @property
  def step_s(self) -> float:
    return float(np.mean(self.step_times[self.warmup:]))

  @property
  def rollout_s(self) -> float:
    return float(np.mean(self.rollout_times[self.warmup:]))

  @property
  def bound_s(self) -> float:
    return float(np.mean(self.bounds[self.warmup:]))


def critical_busy(spans: list[Span], window: tuple[float, float]) -> float:
  """Busy seconds on the critical path of the spans inside `window` (a step): the step
  time had nothing on that chain waited."""
  inside = [s for s in spans if s.start >= window[0] - 1e-9 and s.end <= window[1] + 1e-9]
  return sum(s.duration for s in critical_path(inside))


def check_variant(variant: str) -> Variant:
  if variant not in VARIANTS:
    raise ValueError(f'--schedules: unknown schedule {variant!r}; choose from {list(VARIANTS)}.')
  return VARIANTS[variant]


def variant_setup(setup: ml_collections.ConfigDict, variant: str) -> ml_collections.ConfigDict:
  """The setup as `variant` runs it: `variant_overrides.<variant>` (setup, optional)
  replaces top-level fields for that variant only (what a baseline does differently,
  e.g. MAS-RL's fewer queries in flight); only fields the setup has, so that a
  misspelt one is refused rather than ignored."""
  overrides = setup.get('variant_overrides', {}).get(variant, {})
  unknown = sorted(set(overrides) - set(setup.keys()))
  if unknown:
    raise ValueError(f'config.variant_overrides.{variant} names {unknown}, which the setup '
                     f'does not have; override only its top-level fields {sorted(setup.keys())}.')
  if not overrides:
    return setup
  setup = ml_collections.ConfigDict(setup.to_dict())
  for field, value in overrides.items():
    setup[field] = value
  return setup


def simulate(setup: ml_collections.ConfigDict, variant: str, workdir: str | None = None
             ) -> SimResult:
  """Run `setup.steps` steps of one schedule in simulated time (spans to
  `workdir/trace.json` when a workdir is given)."""
  v = check_variant(variant)
  setup = variant_setup(setup, variant)
  warmup = setup.get('warmup_steps', 0)
  if not 0 <= warmup < setup.steps:
    raise ValueError(f'warmup_steps={warmup}: it must leave at least one of the '
                     f'steps={setup.steps} to measure.')
  t_real = time.perf_counter()
  with tempfile.TemporaryDirectory() as tmp:
    workdir = workdir or tmp
    clock = SimClock()
    recorder = (SpanRecorder.for_workdir(clock, workdir) if workdir != tmp
                else SpanRecorder(clock))
    tags = StepTags(recorder)
    tokenizer = FastCharTokenizer()
    spec = sim_team_spec(setup, v.schedule, v.balance, tokenizer, v.colocated,
                         v.whole_batches)
    orch = build_orchestrator(
        spec, sim_workflow(setup), tokenizer, workdir, clock=clock,
        factories=lambda _: sim_factories(spec, setup, clock, tokenizer, tags),
        schedule=AgentsInTurn(spec.agents) if v.turns else None)
    team, windows = [], []
    try:
      stride = setup.get('step_query_stride', 0)
      for step in range(setup.steps):
        tags.step = step
        if stride:
          orch.serve_from(step * stride)
        t0 = clock.now()
        team.append(orch.run_step()[TEAM])
        windows.append((t0, clock.now()))
    finally:
      orch.close()
      recorder.close()
  spans = recorder.spans()
  tracks = set(train_tracks(spec.placement)) | {
      f'rollout/{m.devices[0]}' for ms in spec.placement.rollout.values() for m in ms}
  groups = group_usage(track_usage(spans, (0.0, clock.now()), tracks))
  util = {g: u.utilization for g, u in groups.items()}
  util['all'] = sum(groups.values(), start=Usage(0.0, 0.0, 0.0)).utilization
  return SimResult(variant, [l['step_time_s'] for l in team], [l['rollout_s'] for l in team],
                   [critical_busy(spans, w) for w in windows], util,
                   float(np.mean([l['queries'] for l in team])),
                   int(sum(l['rebalances'] for l in team)), time.perf_counter() - t_real, warmup)


def format_results(results: list[SimResult], paper: dict[str, float]) -> str:
  """A table of the variants beside the paper's figures (relative error where it has
  one), then FlexMARL's speed-up over each baseline."""
  head = (f"{'variant':<21}{'stands for':<34}{'step s':>8}{'paper s':>9}{'error':>8}"
          f"{'rollout s':>10}{'bound s':>9}{'util roll':>10}{'util train':>11}{'queries':>8}"
          f"{'moves':>6}")
  rows = [head]
  for r in results:
    p = paper.get(r.variant)
    error = f'{r.step_s / p - 1:+.1%}' if p else '-'
    rows.append(f'{r.variant:<21}{VARIANTS[r.variant].system:<34}{r.step_s:>8.1f}'
                f'{p if p else "-":>9}{error:>8}{r.rollout_s:>10.1f}{r.bound_s:>9.1f}'
                f'{r.utilization.get("rollout", 0):>10.1%}{r.utilization.get("train", 0):>11.1%}'
                f'{r.queries:>8.1f}{r.rebalances:>6}')
  by = {r.variant: r.step_s for r in results}
  for base in ('colocated', 'agents_in_turn', 'sync_parallel', 'sync'):
    if 'flexmarl' in by and base in by:
      paper_ratio = (f" (paper {paper[base] / paper['flexmarl']:.2f}x)"
                     if base in paper and 'flexmarl' in paper else '')
      rows.append(f"speed-up of flexmarl over {base} ({VARIANTS[base].system}): "
                  f"{by[base] / by['flexmarl']:.2f}x{paper_ratio}")
  return '\n'.join(rows)
