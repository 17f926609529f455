"""Real step time per schedule vs the simulator's prediction at this machine's rates.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python -m experiments.benchmarks.calibrate --out=experiments/sim/this_machine.json
  for s in sync sync_parallel flexmarl; do
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m flexmarl.main \
      --config=experiments/hierarchical_assistant.py --workdir=runs/calib/$s \
      --config.steps=40 --config.schedule=$s
  done
  python -m experiments.benchmarks.sim_vs_real --runs=runs/calib [--rates=...json]

Real: mean step_time_s of steps `--first`..40 of RUNS/SCHEDULE/metrics.jsonl, with and
without the steps that compiled a new shape (over 4x the median; the simulator has no
compilation), and where its router sent queries (each specialist's rows + surplus_rows
over its group size). Simulated (experiments/sim/this_machine.py), the same schedule
at the measured rates, adding one effect at a time:
  nominal  devices independent, the experiment's Zipf mix;
  +mix     the real run's routed mix (a learned router sends most queries to one agent);
  +cores   devices on `shared_cores` (from calibrate.py's measured `contention`);
  +host    plus the host's Python work per step: the real orchestrator, engine, workflow,
           store and metrics, timed as the simulation's wall time less the time inside
           the simulator's stand-ins (SimSampler, SimTrainer). With every device on the
           same cores as the host thread, host work and device work add up.
"""

import contextlib
import functools
import json
import os
import time

import numpy as np
from absl import app, flags

_RUNS = flags.DEFINE_string('runs', None, 'Folder with one real workdir per schedule.')
_RATES = flags.DEFINE_string('rates', 'experiments/sim/this_machine.json', 'calibrate.py output.')
_FIRST = flags.DEFINE_integer('first', 11, 'First timed step (compilation before it).')
_SCHEDULES = flags.DEFINE_list('schedules', ['sync', 'sync_parallel', 'flexmarl'], 'Schedules.')
SPECIALISTS = ('reverser', 'sorter', 'adder')


def read_run(workdir: str, first: int) -> dict:
  """Step times, queries and routed mix of a real run's steps `first`.. (metrics.jsonl)."""
  team, served = {}, dict.fromkeys(SPECIALISTS, 0.0)
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    lines = [json.loads(l) for l in f]
  groups = {a: 8 for a in SPECIALISTS}
  for d in lines:
    if d['step'] < first:
      continue
    if d['agent'] == 'team':
      team[d['step']] = d
    elif d['agent'] in served:
      served[d['agent']] += (d.get('rows', 0) + d.get('surplus_rows', 0)) / groups[d['agent']]
  total = sum(served.values())
  times = np.asarray([team[s]['step_time_s'] for s in sorted(team)])
  compiling = times > 4 * np.median(times)
  return dict(step_s=float(times.mean()), clean_s=float(times[~compiling].mean()),
              compiles=int(compiling.sum()),
              queries=float(np.mean([team[s]['queries'] for s in team])),
              mix=[served[a] / total for a in SPECIALISTS])


@contextlib.contextmanager
def stand_in_time():
  """Seconds spent inside the simulator's stand-ins while the block runs (a list of one)."""
  from flexmarl.sim.instances import SimSampler
  from flexmarl.sim.trainer import SimTrainer
  spent, originals = [0.0], []

  def timed(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
      t0 = time.perf_counter()
      try:
        return fn(*args, **kwargs)
      finally:
        spent[0] += time.perf_counter() - t0
    return wrapper
  for cls, names in ((SimSampler, ('submit', 'update_weights')),
                     (SimTrainer, ('accumulate', 'dispatch_apply'))):
    for name in names:
      originals.append((cls, name, getattr(cls, name)))
      setattr(cls, name, timed(getattr(cls, name)))
  try:
    yield spent
  finally:
    for cls, name, fn in originals:
      setattr(cls, name, fn)


def main(argv):
  del argv
  from experiments.sim import this_machine
  from flexmarl.sim.run import simulate

  first = _FIRST.value
  mean = lambda r: float(np.mean(r.step_times[first - 1:]))  # the real run's timed steps
  print('| schedule | real 11–40 | real w/o compile | nominal | +mix | +cores | +host '
        '| sim / real w/o compile | sim / real 11–40 |')
  print('|---|---|---|---|---|---|---|---|---|')
  notes = []
  for schedule in _SCHEDULES.value:
    real = read_run(os.path.join(_RUNS.value, schedule), first)
    setup = this_machine.get_config(f'json={_RATES.value}')
    setup.shared_cores = 0
    nominal = simulate(setup, schedule)
    mix = ','.join(f'{m:.4f}' for m in real['mix'])
    setup = this_machine.get_config(f'json={_RATES.value}:mix={mix}')
    shared_cores, setup.shared_cores = setup.shared_cores, 0
    with_mix = simulate(setup, schedule)
    setup.shared_cores = shared_cores
    with stand_in_time() as spent:
      cores = simulate(setup, schedule)
    host = (cores.wall_s - spent[0]) / setup.steps
    pred = mean(cores) + host
    ms = lambda x: f'{x * 1e3:.0f} ms'
    print(f"| `{schedule}` | {ms(real['step_s'])} | {ms(real['clean_s'])} | {ms(mean(nominal))} "
          f"| {ms(mean(with_mix))} | {ms(mean(cores))} | {ms(pred)} "
          f"| **{pred / real['clean_s']:.2f}** | {pred / real['step_s']:.2f} |")
    notes.append(f"{schedule}: real {real['queries']:.1f} queries/step, {real['compiles']} "
                 f"compiling step(s), routed mix R/S/A {mix}; sim queries nominal "
                 f'{nominal.queries:.1f}, +mix {with_mix.queries:.1f}; shared_cores '
                 f"{setup.shared_cores}; host {host * 1e3:.0f} ms/step")
  print('\n'.join(notes))


if __name__ == '__main__':
  flags.mark_flag_as_required('runs')
  app.run(main)
