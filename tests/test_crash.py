"""SIGKILL the training process at random moments; restart it; nothing committed is lost.

The run is `python -m flexmarl.main` on the solver/verifier experiment (under
`flexmarl`, and under `async:1`, where rows are served while an update runs), killed
four times, each a random fraction of a second after it logged a chosen step (so the
kills land in start-up of the next step, rollout, store writes, training steps and
checkpoint saves), and restarted each time, then left to finish. Two of the kills come
after the step that trained on the rows a checkpoint carries over, before the next
checkpoint: those restarts resume from a checkpoint whose rows must be read back from
the store, unconsumed. After every kill the store's committed rows are recorded; at
the end each of them must still be there, identical, exactly once, the rows marked
consumed must be those the checkpointed updates trained on, and the run must end with
the same parameters as a run that was never interrupted.
"""

import os
import random
import re
import subprocess
import sys
import threading

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
import pytest

from conftest import FAST_COMPILE
from flexmarl.metrics.writer import read_metrics
from flexmarl.store.experience_store import ExperienceStore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AGENTS = ('solver', 'verifier')
STEPS = 12
# At most 5 queries a step: both agents carry rows over every other step, and the
# checkpoints of steps 3 and 9 hold rows that must be read back from the store.
FLAGS = [f'--config.steps={STEPS}', '--config.checkpoint_every=3',
         '--config.rollout.query_concurrency=4', '--config.rollout.max_step_queries=5']


def _train(workdir, schedule, kill_after_step=None, delay=0.0):
  """Run the trainer; with `kill_after_step`, SIGKILL it `delay` s after it has logged
  that step of the run (or the first step past it, where a restart resumed beyond it),
  or at once when it logs the step after that: steps can take a few milliseconds, and
  a kill that came after the end would find the run finished."""
  env = dict(os.environ, XLA_FLAGS=f'--xla_force_host_platform_device_count=8 {FAST_COMPILE}',
             PYTHONUNBUFFERED='1')
  proc = subprocess.Popen(
      [sys.executable, '-m', 'flexmarl.main', '--config=experiments/solver_verifier.py',
       f'--workdir={workdir}', f'--config.schedule={schedule}', *FLAGS], cwd=ROOT, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True)
  watchdog = threading.Timer(300, proc.kill)
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
  return proc.returncode, ''.join(output)


def _rows(workdir):
  store = ExperienceStore.open(os.path.join(workdir, 'store'), agents=AGENTS)
  out = {}
  for agent in AGENTS:
    rows = store.read(agent)
    ids = [r.sample_id for r in rows]
    assert len(ids) == len(set(ids)), f'{agent}: a sample_id is stored twice'
    out[agent] = {r.sample_id: (r.policy_version, r.response_ids.tobytes(),
                                r.logprobs.tobytes(), r.reward) for r in rows}
  store.close()
  return out


def _params(workdir, agent):
  path = os.path.join(workdir, 'checkpoints', agent, str(STEPS), 'state')
  return jax.tree.leaves(ocp.StandardCheckpointer().restore(os.path.abspath(path))['params'])


def _carried(workdir):
  """Per kept checkpoint step, the rows the agents' checkpoints carry over to the next step."""
  out = {}
  for agent in AGENTS:
    root = os.path.join(workdir, 'checkpoints', agent)
    for step in os.listdir(root) if os.path.isdir(root) else ():
      if step.isdigit():
        meta = ocp.JsonCheckpointHandler().restore(epath.Path(root) / step / 'meta')
        out.setdefault(int(step), set()).update(
            (agent, s) for ref in meta['buffer'] for s in ref['sample_ids'])
  return out


def _resumed_from(output):
  """The checkpoint step a run's log says it resumed from; 0 for a fresh start."""
  found = re.search(r'resumed from step (\d+)', output)
  return int(found.group(1)) if found else 0


def _consumed(workdir):
  with ExperienceStore.open(os.path.join(workdir, 'store'), agents=AGENTS) as store:
    return {a: {r.sample_id for r in store.read(a, consumed=True)} for a in AGENTS}


# Logged steps to kill after: checkpoints are at 3, 6, 9 and 12, and those of 3 and 9
# carry rows; steps 4 and 10 train on them; a kill after 6 lands in its checkpoint's save.
KILL_AFTER = (2, 4, 6, 10)


@pytest.mark.parametrize('schedule', ['flexmarl', 'async:1'])
def test_sigkill_at_random_moments(tmp_path, schedule):
  rng = random.Random(0)
  crashed, straight = str(tmp_path / 'crashed'), str(tmp_path / 'straight')
  committed = {a: {} for a in AGENTS}
  resumed_with_rows = 0
  for kill_after in KILL_AFTER:
    carried = _carried(crashed)
    rc, out = _train(crashed, schedule, kill_after_step=kill_after, delay=rng.uniform(0.0, 0.3))
    assert rc == -9, f'killed after step {kill_after}: rc={rc}\n{out[-3000:]}'
    resumed_with_rows += bool(carried.get(_resumed_from(out)))
    if os.path.exists(os.path.join(crashed, 'store')):
      for agent, rows in _rows(crashed).items():
        committed[agent].update(rows)
  carried = _carried(crashed)
  rc, out = _train(crashed, schedule)
  assert rc == 0, out[-3000:]
  resumed_with_rows += bool(carried.get(_resumed_from(out)))
  assert resumed_with_rows, 'no restart resumed from a checkpoint that carries rows'

  final = _rows(crashed)
  for agent in AGENTS:
    lost = set(committed[agent]) - set(final[agent])
    assert not lost, f'{agent}: committed rows lost after the crashes: {sorted(lost)[:5]}'
    changed = [s for s, row in committed[agent].items() if final[agent][s] != row]
    assert not changed, f'{agent}: rows changed after the crashes: {changed[:5]}'
  assert sum(map(len, committed.values())) > 0

  lines = read_metrics(os.path.join(crashed, 'metrics.jsonl'))
  for agent in AGENTS:
    assert sorted(l['step'] for l in lines if l['agent'] == agent) == list(range(1, STEPS + 1))
  assert os.path.exists(os.path.join(crashed, 'summary.json'))
  # Consumed: every row the updates trained on (all checkpointed at the last step), none
  # of those the last checkpoint carries.
  consumed = _consumed(crashed)
  last = _carried(crashed)[STEPS]
  for agent in AGENTS:
    trained = sum(l['rows'] for l in lines if l['agent'] == agent and l['updated'])
    assert len(consumed[agent]) == trained > 0, agent
    assert not {(agent, s) for s in consumed[agent]} & last, agent

  rc, out = _train(straight, schedule)
  assert rc == 0, out[-3000:]
  assert final == _rows(straight), 'the crashed run served other rows than an uninterrupted one'
  assert consumed == _consumed(straight), 'the crashed run marked other rows consumed'
  for agent in AGENTS:
    for x, y in zip(_params(crashed, agent), _params(straight, agent), strict=True):
      np.testing.assert_allclose(x, y, atol=1e-6)
