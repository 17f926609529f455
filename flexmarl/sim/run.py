"""One schedule of a simulated setup, run to completion: the real JointOrchestrator,
schedules, rollout engine, balancer and batch builders against a SimClock, simulated
rollout instances (`instances.py`) and trainers (`trainer.py`) whose durations come
from cost models (`costs.py`). `flexmarl.simulate` is its command line.

Reported per schedule: the step times, the utilization of the rollout and training
pools (busy / wall over the run, in device-group seconds) and the critical-path bound:
the busy time along the chain of the spans inside the step that ends last, i.e. the
step time had nothing on that chain waited. All in simulated seconds.

Schedules: `sync` (MAS-RL style), `sync_parallel` (MARTI style), `flexmarl`, and the
paper's ablations `flexmarl_no_pipeline` (train after the rollout, all agents at once,
with load balancing) and `flexmarl_no_balance` (the pipeline without load balancing).
The baselines balance no load, as the systems they stand for.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time

import ml_collections
import numpy as np

from flexmarl.clock import SimClock
from flexmarl.metrics.spans import Span, SpanRecorder
from flexmarl.metrics.utilization import Usage, critical_path, group_usage, track_usage
from flexmarl.metrics.writer import TEAM
from flexmarl.orchestrator import JointOrchestrator
from flexmarl.sim.team import build_sim_team, sim_team_spec, sim_workflow
from flexmarl.tokenizer import build_char_tokenizer

# name -> (schedule, load balancing)
VARIANTS = {
    'sync': ('sync', False),
    'sync_parallel': ('sync_parallel', False),
    'flexmarl': ('flexmarl', True),
    'flexmarl_no_pipeline': ('sync_parallel', True),
    'flexmarl_no_balance': ('flexmarl', False),
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

  @property
  def step_s(self) -> float:
    return float(np.mean(self.step_times))

  @property
  def bound_s(self) -> float:
    return float(np.mean(self.bounds))


def critical_busy(spans: list[Span], window: tuple[float, float]) -> float:
  """Busy seconds on the critical path of the spans inside `window` (a step): the step
  time had nothing on that chain waited."""
  inside = [s for s in spans if s.start >= window[0] - 1e-9 and s.end <= window[1] + 1e-9]
  return sum(s.duration for s in critical_path(inside))


def check_variant(variant: str) -> tuple[str, bool]:
  if variant not in VARIANTS:
    raise ValueError(f'--schedules: unknown schedule {variant!r}; choose from {list(VARIANTS)}.')
  return VARIANTS[variant]


def simulate(setup: ml_collections.ConfigDict, variant: str, workdir: str | None = None
             ) -> SimResult:
  """Run `setup.steps` steps of one schedule in simulated time (spans to
  `workdir/trace.json` when a workdir is given)."""
  schedule, balance = check_variant(variant)
  t_real = time.perf_counter()
  with tempfile.TemporaryDirectory() as tmp:
    workdir = workdir or tmp
    clock = SimClock()
    recorder = (SpanRecorder.for_workdir(clock, workdir) if workdir != tmp
                else SpanRecorder(clock))
    tags = StepTags(recorder)
    tokenizer = build_char_tokenizer()
    spec = sim_team_spec(setup, schedule, balance, tokenizer)
    agents = build_sim_team(spec, setup, clock, tokenizer, tags)
    orch = JointOrchestrator(spec, sim_workflow(setup), tokenizer, workdir, clock=clock,
                             agents=agents)
    team, windows = [], []
    try:
      for step in range(setup.steps):
        tags.step = step
        t0 = clock.now()
        team.append(orch.run_step()[TEAM])
        windows.append((t0, clock.now()))
    finally:
      orch.close()
      recorder.close()
  spans = recorder.spans()
  tracks = {f'train/{n}' for n in spec.agents} | {
      f'rollout/{m.devices[0]}' for ms in spec.placement.rollout.values() for m in ms}
  groups = group_usage(track_usage(spans, (0.0, clock.now()), tracks))
  util = {g: u.utilization for g, u in groups.items()}
  util['all'] = sum(groups.values(), start=Usage(0.0, 0.0, 0.0)).utilization
  return SimResult(variant, [l['step_time_s'] for l in team], [l['rollout_s'] for l in team],
                   [critical_busy(spans, w) for w in windows], util,
                   float(np.mean([l['queries'] for l in team])),
                   int(sum(l['rebalances'] for l in team)), time.perf_counter() - t_real)


def format_results(results: list[SimResult], paper: dict[str, float]) -> str:
  head = (f"{'schedule':<22}{'step s':>9}{'rollout s':>11}{'bound s':>9}{'util roll':>10}"
          f"{'util train':>11}{'util all':>9}{'queries':>8}{'moves':>6}{'paper s':>9}")
  rows = [head]
  for r in results:
    p = paper.get(r.variant)
    rows.append(f'{r.variant:<22}{r.step_s:>9.4g}{np.mean(r.rollout_times):>11.4g}'
                f'{r.bound_s:>9.4g}{r.utilization.get("rollout", 0):>10.1%}'
                f'{r.utilization.get("train", 0):>11.1%}{r.utilization["all"]:>9.1%}'
                f'{r.queries:>8.1f}{r.rebalances:>6}{p if p else "-":>9}')
  by = {r.variant: r.step_s for r in results}
  for base in ('sync_parallel', 'sync'):
    if 'flexmarl' in by and base in by:
      paper_ratio = (f" (paper {paper[base] / paper['flexmarl']:.2f}x)"
                     if base in paper and 'flexmarl' in paper else '')
      rows.append(f"speed-up of flexmarl over {base}: {by[base] / by['flexmarl']:.2f}x"
                  f'{paper_ratio}')
  return '\n'.join(rows)
