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

A kill at a random moment finds the narrow windows only by luck: one of them (a
checkpoint written, the store's consumed marks not yet) is hit on purpose, by a kill
point (`experiments/benchmarks/crash_stress.py`, which kills at many more moments).
"""

import importlib.util
import os
import random

import pytest

from conftest import FAST_COMPILE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    'crash_stress', os.path.join(ROOT, 'experiments', 'benchmarks', 'crash_stress.py'))
crash = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(crash)


def _run(workdir, schedule, **kill):
  return crash.run_main(str(workdir), (*crash.FLAGS, f'--config.schedule={schedule}'),
                        xla_flags=FAST_COMPILE, **kill)


@pytest.fixture(scope='module')
def straight(tmp_path_factory):
  """The uninterrupted run of a schedule, made once for the file's tests."""
  runs = {}

  def of(schedule):
    if schedule not in runs:
      workdir = tmp_path_factory.mktemp(f'straight-{schedule.replace(":", "")}')
      rc, out = _run(workdir, schedule)
      assert rc == 0, out[-3000:]
      runs[schedule] = str(workdir)
    return runs[schedule]
  return of


# Logged steps to kill after: checkpoints are at 3, 6, 9 and 12, and those of 3 and 9
# carry rows; steps 4 and 10 train on them; a kill after 6 lands in its checkpoint's save.
KILL_AFTER = (2, 4, 6, 10)


@pytest.mark.parametrize('schedule', ['flexmarl', 'async:1'])
def test_sigkill_at_random_moments(tmp_path, schedule, straight):
  rng = random.Random(0)
  crashed = str(tmp_path / 'crashed')
  checks = crash.Checks(crashed)
  resumed_with_rows = 0
  for kill_after in KILL_AFTER:
    carried = crash.carried_rows(crashed)
    rc, out = _run(crashed, schedule, kill_after_step=kill_after, delay=rng.uniform(0.0, 0.3))
    assert rc == -9, f'killed after step {kill_after}: rc={rc}\n{out[-3000:]}'
    resumed_with_rows += bool(carried.get(crash.resumed_from(out)))
    assert not checks.after_run()
  carried = crash.carried_rows(crashed)
  rc, out = _run(crashed, schedule)
  assert rc == 0, out[-3000:]
  resumed_with_rows += bool(carried.get(crash.resumed_from(out)))
  assert resumed_with_rows, 'no restart resumed from a checkpoint that carries rows'
  assert sum(map(len, checks.committed.values())) > 0
  assert checks.at_end(straight(schedule)) == []


def test_a_kill_between_a_checkpoint_and_its_consumed_marks_loses_no_mark(tmp_path, straight):
  # The store marks the rows a checkpoint's updates trained on once the checkpoint is
  # written: agent by agent, solver first. Killed before the verifier's marks of step 3,
  # the run resumes from that checkpoint, which must mark them itself.
  crashed = str(tmp_path / 'crashed')
  rc, out = _run(crashed, 'flexmarl', kill_point='consumed', nth=2)
  assert rc == -9, out[-3000:]
  assert crash.consumed_rows(crashed)['verifier'] == set()
  rc, out = _run(crashed, 'flexmarl')
  assert rc == 0, out[-3000:]
  assert crash.resumed_from(out) == 3
  assert crash.Checks(crashed).at_end(straight('flexmarl')) == []


# The multi-turn team (experiments/rounds_team.py:toy): a solver and a checker in rounds,
# attempts side by side, credit by episode; the same invariants after two kills.
ROUNDS = ('--config=experiments/rounds_team.py:toy', f'--config.steps={crash.STEPS}',
          '--config.checkpoint_every=3', '--config.eval_every=0',
          '--config.rollout.query_concurrency=4', '--config.rollout.max_step_queries=5')


def test_a_team_in_turns_resumes_after_sigkill_as_if_never_killed(tmp_path):
  straight, crashed = str(tmp_path / 'straight'), str(tmp_path / 'crashed')
  rc, out = crash.run_main(straight, ROUNDS, xla_flags=FAST_COMPILE)
  assert rc == 0, out[-3000:]
  checks = crash.Checks(crashed)
  for kill_after, delay in ((4, 0.1), (8, 0.25)):
    rc, out = crash.run_main(crashed, ROUNDS, kill_after_step=kill_after, delay=delay,
                             xla_flags=FAST_COMPILE)
    assert rc == -9, f'killed after step {kill_after}: rc={rc}\n{out[-3000:]}'
    assert not checks.after_run()
  rc, out = crash.run_main(crashed, ROUNDS, xla_flags=FAST_COMPILE)
  assert rc == 0, out[-3000:]
  assert crash.resumed_from(out) > 0
  assert checks.at_end(straight) == []
