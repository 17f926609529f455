"""Kill a run at many random moments, resume it each time, and check that nothing is lost.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python experiments/benchmarks/crash_stress.py [--rounds=5] [--schedules=flexmarl,sync,async:1]
  python experiments/benchmarks/crash_stress.py --quick  # one round of one schedule

A round starts a fresh workdir of the solver/verifier experiment (12 steps, a checkpoint
every 3, at most 5 queries a step: checkpoints carry rows over) and SIGKILLs it up to
four times, each time at a kill point drawn from `random.Random(seed)`: inside a store
append, a checkpoint save (its arrays are written on Orbax's threads after `save`
returns), the store's consumed marks after a checkpoint, a publish of new weights, or a
random fraction of a second after a step's log line. Each kill restarts the run from its
workdir. After every restart it checks that each row committed before is still there,
unchanged and once; at the end, that metrics steps are contiguous, that the rows marked
consumed are exactly the rows the updates trained on (each once; none the last
checkpoint carries), and that rows, consumed marks and parameters equal those of the
same run never interrupted. The last line is JSON: kills landed per schedule and kill
point, and the mismatches (0 is the only passing figure).

`tests/test_crash.py` uses `run_main`, `Checks` and the readers here.
"""

from __future__ import annotations

import collections
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')  # to read checkpoints

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from etils import epath  # noqa: E402

from flexmarl.metrics.writer import read_metrics  # noqa: E402
from flexmarl.store.experience_store import ExperienceStore  # noqa: E402

AGENTS = ('solver', 'verifier')
STEPS = 12
# At most 5 queries a step: both agents carry rows over every other step, and the
# checkpoints of steps 3 and 9 hold rows that must be read back from the store.
FLAGS = ('--config=experiments/solver_verifier.py', f'--config.steps={STEPS}',
         '--config.checkpoint_every=3', '--config.rollout.query_concurrency=4',
         '--config.rollout.max_step_queries=5')

# Where a kill lands: a function the run calls, as MODULE:QUALNAME.
KILL_POINTS = {
    'append': 'flexmarl.store.experience_store:ExperienceStore.append',
    'checkpoint': 'flexmarl.train.checkpoint:AgentCheckpointer.save',
    'consumed': 'flexmarl.store.experience_store:ExperienceStore.mark_consumed',
    'publish': 'flexmarl.agent:Agent.publish',
}

# `python -c` this, then SITE NTH DELAY and flexmarl.main's arguments: a SIGKILL `DELAY`
# seconds after the NTH call of SITE begins (with DELAY 0: before the call does anything).
_WITH_KILL_POINT = '''
import importlib, os, runpy, signal, sys, threading
site, nth, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
del sys.argv[1:4]
module, qualname = site.split(':')
owner = importlib.import_module(module)
*path, name = qualname.split('.')
for part in path:
  owner = getattr(owner, part)
original, calls = getattr(owner, name), [0]
def kill():
  os.kill(os.getpid(), signal.SIGKILL)
def call(*args, **kwargs):
  calls[0] += 1
  if calls[0] == nth:
    kill() if delay == 0 else threading.Timer(delay, kill).start()
  return original(*args, **kwargs)
setattr(owner, name, call)
sys.argv[0] = 'flexmarl.main'
runpy.run_module('flexmarl.main', run_name='__main__', alter_sys=True)
'''


def run_main(workdir: str, args: tuple[str, ...] = FLAGS, *, kill_point: str | None = None,
             nth: int = 1, delay: float = 0.0, kill_after_step: int | None = None,
             xla_flags: str = '') -> tuple[int, str]:
  """`python -m flexmarl.main ARGS --workdir=WORKDIR` in a process of its own; returns its
  exit code (-9 where killed) and output. `kill_point` (a KILL_POINTS key or
  MODULE:QUALNAME) kills it in the `nth` call there, `delay` s after the call begins;
  `kill_after_step` kills it `delay` s after it logged that step (or the first past it,
  where it resumed beyond it), or at once when it logs the next one (steps can take
  milliseconds, and a kill that came after the end would find the run finished)."""
  env = dict(os.environ, PYTHONUNBUFFERED='1', XLA_FLAGS=' '.join(
      ['--xla_force_host_platform_device_count=8', xla_flags]).strip())
  if kill_point is None:
    command = [sys.executable, '-m', 'flexmarl.main']
  else:
    command = [sys.executable, '-c', _WITH_KILL_POINT, KILL_POINTS.get(kill_point, kill_point),
               str(nth), str(delay)]
  proc = subprocess.Popen([*command, *args, f'--workdir={workdir}'], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  watchdog = threading.Timer(600, proc.kill)
  watchdog.start()
  output, timer = [], None
  for line in proc.stdout:
    output.append(line)
    logged = re.match(r'step (\d+)/', line)
    if kill_after_step is None or not logged or int(logged.group(1)) < kill_after_step:
      continue
    if timer is None:
      timer = threading.Timer(delay, proc.kill)
      timer.start()
    else:
      proc.kill()
  proc.wait()
  watchdog.cancel()
  if timer is not None:
    timer.cancel()
  return proc.returncode, ''.join(output)


def stored_rows(workdir: str) -> dict[str, dict[str, tuple]]:
  """Per agent, every committed row by sample id; raises if an id is stored twice."""
  rows_of = {}
  with ExperienceStore.open(os.path.join(workdir, 'store'), agents=AGENTS) as store:
    for agent in AGENTS:
      rows = store.read(agent)
      ids = [r.sample_id for r in rows]
      if len(ids) != len(set(ids)):
        raise AssertionError(f'{agent}: a sample_id is stored twice')
      rows_of[agent] = {r.sample_id: (r.policy_version, r.response_ids.tobytes(),
                                      r.logprobs.tobytes(), r.reward) for r in rows}
  return rows_of


def consumed_rows(workdir: str) -> dict[str, set[str]]:
  with ExperienceStore.open(os.path.join(workdir, 'store'), agents=AGENTS) as store:
    return {a: {r.sample_id for r in store.read(a, consumed=True)} for a in AGENTS}


def carried_rows(workdir: str) -> dict[int, set[tuple[str, str]]]:
  """Per kept checkpoint step, the (agent, sample id)s its checkpoints carry over."""
  out = {}
  for agent in AGENTS:
    root = os.path.join(workdir, 'checkpoints', agent)
    for step in os.listdir(root) if os.path.isdir(root) else ():
      if step.isdigit():
        meta = ocp.JsonCheckpointHandler().restore(epath.Path(root) / step / 'meta')
        out.setdefault(int(step), set()).update(
            (agent, s) for ref in meta['buffer'] for s in ref['sample_ids'])
  return out


def final_params(workdir: str, agent: str) -> list[np.ndarray]:
  path = os.path.join(workdir, 'checkpoints', agent, str(STEPS), 'state')
  return jax.tree.leaves(ocp.StandardCheckpointer().restore(os.path.abspath(path))['params'])


def resumed_from(output: str) -> int:
  """The checkpoint step a run's log says it resumed from; 0 for a fresh start."""
  found = re.search(r'resumed from step (\d+)', output)
  return int(found.group(1)) if found else 0


class Checks:
  """The invariants of one crashed workdir, checked as it is killed and resumed."""

  def __init__(self, workdir: str):
    self.workdir = workdir
    self.committed: dict[str, dict[str, tuple]] = {a: {} for a in AGENTS}

  def after_run(self) -> list[str]:
    """After a run (killed or finished): every row committed before is still there,
    unchanged (ids once: `stored_rows`); then remember this run's rows too."""
    if not os.path.exists(os.path.join(self.workdir, 'store')):
      return []
    problems = []
    now = stored_rows(self.workdir)
    for agent in AGENTS:
      lost = set(self.committed[agent]) - set(now[agent])
      if lost:
        problems.append(f'{agent}: committed rows lost: {sorted(lost)[:5]}')
      changed = [s for s, row in self.committed[agent].items()
                 if s in now[agent] and now[agent][s] != row]
      if changed:
        problems.append(f'{agent}: committed rows changed: {changed[:5]}')
      self.committed[agent].update(now[agent])
    return problems

  def at_end(self, straight: str) -> list[str]:
    """Once the run finished: metrics steps contiguous; consumed rows = the rows the
    updates trained on, each once, none that the last checkpoint carries; rows, marks
    and parameters equal to the uninterrupted run in `straight`."""
    problems = self.after_run()
    lines = read_metrics(os.path.join(self.workdir, 'metrics.jsonl'))
    consumed, last = consumed_rows(self.workdir), carried_rows(self.workdir).get(STEPS, set())
    for agent in AGENTS:
      steps = sorted(l['step'] for l in lines if l['agent'] == agent)
      if steps != list(range(1, STEPS + 1)):
        problems.append(f'{agent}: metrics steps {steps}')
      trained = sum(l['rows'] for l in lines if l['agent'] == agent and l['updated'])
      if len(consumed[agent]) != trained or not trained:
        problems.append(f'{agent}: {len(consumed[agent])} rows consumed, {trained} trained')
      if {(agent, s) for s in consumed[agent]} & last:
        problems.append(f'{agent}: rows the last checkpoint carries are marked consumed')
    if stored_rows(self.workdir) != stored_rows(straight):
      problems.append('other rows served than in the uninterrupted run')
    if consumed != consumed_rows(straight):
      problems.append('other rows consumed than in the uninterrupted run')
    for agent in AGENTS:
      for x, y in zip(final_params(self.workdir, agent), final_params(straight, agent),
                      strict=True):
        if not np.allclose(x, y, atol=1e-6):
          problems.append(f'{agent}: parameters differ from the uninterrupted run')
          break
    return problems


def _stress(schedule: str, rounds: int, rng: random.Random, root: str) -> dict:
  """`rounds` crashed runs of one schedule against one uninterrupted run."""
  args = (*FLAGS, f'--config.schedule={schedule}')
  straight = os.path.join(root, f'{schedule}-straight')
  rc, out = run_main(straight, args)
  if rc != 0:
    raise RuntimeError(f'the uninterrupted {schedule} run failed:\n{out[-3000:]}')
  kills, problems = collections.Counter(), []
  for r in range(rounds):
    crashed = os.path.join(root, f'{schedule}-{r}')
    checks = Checks(crashed)
    for _ in range(4):
      where = rng.choice([*KILL_POINTS, 'time'])
      if where == 'time':
        rc, out = run_main(crashed, args, kill_after_step=rng.randint(1, STEPS - 1),
                           delay=rng.uniform(0.0, 0.5))
      else:  # appends and marks: 2 an agent a step; saves and publishes fewer
        rc, out = run_main(crashed, args, kill_point=where, nth=rng.randint(1, 6),
                           delay=rng.choice([0.0, rng.uniform(0.0, 0.2)]))
      problems += [f'{schedule} round {r}: {p}' for p in checks.after_run()]
      if rc == 0:
        break  # the run finished before the kill point came
      if rc != -9:
        raise RuntimeError(f'{schedule} round {r} ended rc={rc}:\n{out[-3000:]}')
      kills[where] += 1
      print(f'{schedule} round {r}: killed in {where} '
            f'(resumed from step {resumed_from(out)})', flush=True)
    rc, out = run_main(crashed, args)
    if rc != 0:
      raise RuntimeError(f'{schedule} round {r}: the last resume failed:\n{out[-3000:]}')
    problems += [f'{schedule} round {r}: {p}' for p in checks.at_end(straight)]
    shutil.rmtree(crashed)
  return dict(kills=dict(kills), problems=problems)


def main() -> None:
  args = dict(a[2:].split('=', 1) if '=' in a else (a[2:], '1') for a in sys.argv[1:])
  quick = 'quick' in args
  schedules = args.get('schedules', 'flexmarl' if quick else 'flexmarl,sync,async:1').split(',')
  rounds = int(args.get('rounds', 1 if quick else 4))
  rng = random.Random(int(args.get('seed', 0)))
  results = {}
  with tempfile.TemporaryDirectory(prefix='crash-stress-') as root:
    for schedule in schedules:
      results[schedule] = _stress(schedule, rounds, rng, root)
      print(f'{schedule}: {sum(results[schedule]["kills"].values())} kills, '
            f'{len(results[schedule]["problems"])} mismatches', flush=True)
      for problem in results[schedule]['problems']:
        print(f'  {problem}', flush=True)
  kills = sum(sum(r['kills'].values()) for r in results.values())
  mismatches = sum(len(r['problems']) for r in results.values())
  print(json.dumps(dict(kills=kills, mismatches=mismatches, schedules=results)))


if __name__ == '__main__':
  main()
