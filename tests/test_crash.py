"""SIGKILL the training process at random moments; restart it; nothing committed is lost.

The run is `python -m flexmarl.main` on the solver/verifier experiment (under
`flexmarl`, and under `async:1`, where rows are served while an update runs), killed
five times at different moments (during start-up, rollout, store
writes, training steps and checkpoint saves all happen within the windows drawn) and
restarted each time, then left to finish. After every kill the store's committed rows
are recorded; at the end each of them must still be there, identical, exactly once, and
the run must end with the same parameters as a run that was never interrupted.
"""

import os
import random
import subprocess
import sys
import threading

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
import pytest

from flexmarl.metrics.writer import read_metrics
from flexmarl.store.experience_store import ExperienceStore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AGENTS = ('solver', 'verifier')
STEPS = 12
# At most 5 queries a step: both agents carry rows over every other step, and the
# checkpoints of steps 3 and 9 hold rows that must be read back from the store.
FLAGS = [f'--config.steps={STEPS}', '--config.checkpoint_every=3',
         '--config.rollout.query_concurrency=4', '--config.rollout.max_step_queries=5']


def _train(workdir, schedule, kill_after_steps=None, delay=0.0):
  """Run the trainer; with `kill_after_steps`, SIGKILL it `delay` s after it has logged
  that many steps (counted in this process: a restarted run resumes first)."""
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=8',
             PYTHONUNBUFFERED='1')
  proc = subprocess.Popen(
      [sys.executable, '-m', 'flexmarl.main', '--config=experiments/solver_verifier.py',
       f'--workdir={workdir}', f'--config.schedule={schedule}', *FLAGS], cwd=ROOT, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True)
  watchdog = threading.Timer(300, proc.kill)
  watchdog.start()
  output, steps = [], 0
  for line in proc.stdout:
    output.append(line)
    steps += line.startswith('step ')
    if kill_after_steps is not None and steps == kill_after_steps and line.startswith('step '):
      threading.Timer(delay, proc.kill).start()
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


def _carried(workdir, agent):
  """Rows the agent's kept checkpoints carry over to the next step."""
  root = os.path.join(workdir, 'checkpoints', agent)
  return sum(len(ocp.JsonCheckpointHandler().restore(epath.Path(root) / step / 'meta')['buffer'])
             for step in os.listdir(root) if step.isdigit())


@pytest.mark.parametrize('schedule', ['flexmarl', 'async:1'])
def test_sigkill_at_random_moments(tmp_path, schedule):
  rng = random.Random(0)
  crashed, straight = str(tmp_path / 'crashed'), str(tmp_path / 'straight')
  committed = {a: {} for a in AGENTS}
  kills = 0
  while kills < 5:
    rc, out = _train(crashed, schedule, kill_after_steps=rng.randint(1, 2), delay=rng.uniform(0.0, 0.4))
    if rc == 0:  # the run got to its end before the kill landed
      break
    assert rc == -9, out[-3000:]
    kills += 1
    if os.path.exists(os.path.join(crashed, 'store')):
      for agent, rows in _rows(crashed).items():
        committed[agent].update(rows)
  assert kills >= 5, f'only {kills} kills landed'
  rc, out = _train(crashed, schedule)
  assert rc == 0, out[-3000:]

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

  rc, out = _train(straight, schedule)
  assert rc == 0, out[-3000:]
  assert final == _rows(straight), 'the crashed run served other rows than an uninterrupted one'
  for agent in AGENTS:
    for x, y in zip(_params(crashed, agent), _params(straight, agent), strict=True):
      np.testing.assert_allclose(x, y, atol=1e-6)
  assert all(_carried(straight, agent) for agent in AGENTS), 'no checkpoint carried rows'
