"""Held-out evaluation of a run's newest checkpoint, or of the base model alone.

  python -m flexmarl.evaluate --config=experiments/real_team.py --workdir=runs/real_team
  python -m flexmarl.evaluate --config=experiments/real_team.py --base   # before training

prints greedy pass@1 and mean reward per agent and for the team on the workflow's
held-out problems (`flexmarl.rollout.held_out`); `--out=FILE` writes them as JSON.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config file.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run folder whose newest checkpoint to '
                               'evaluate.')
_BASE = flags.DEFINE_bool('base', False, "Evaluate the agents' starting weights (the base "
                          'model, before any training) instead of a checkpoint.')
_OUT = flags.DEFINE_string('out', '', 'Write the table here as JSON.')


def _check_run(workdir: str, agents) -> None:
  """Raise WorkdirError unless `workdir` holds a run with a checkpoint of every one of
  `agents`: checked before the team is built, which would write into the folder and
  compile the model first."""
  from flexmarl.train.checkpoint import saved_steps
  from flexmarl.runtime.workdir import WorkdirError
  if not os.path.isfile(os.path.join(workdir, 'config.json')):
    raise WorkdirError(f'--workdir={workdir!r} holds no run (no config.json): give the '
                       '--workdir of a run of python -m flexmarl.main, or --base to evaluate '
                       'the base model.')
  missing = [agent for agent in agents if not saved_steps(workdir, agent)]
  if missing:
    raise WorkdirError(f'--workdir={workdir!r} has no checkpoint of {missing} yet: train '
                       'until a step that checkpoint_every saves, or give --base to '
                       'evaluate the base model.')


def main(argv) -> None:
  del argv
  from flexmarl.core.errors import ConfigError
  from flexmarl.rollout.held_out import format_eval
  from flexmarl.runtime.workdir import WorkdirError
  from flexmarl.workflows.checks import WorkflowError
  if not _BASE.value and not _WORKDIR.value:
    raise app.UsageError('give --workdir=RUN (its newest checkpoint) or --base.')
  if _OUT.value and not os.path.isdir(os.path.dirname(os.path.abspath(_OUT.value))):
    sys.exit(f'--out={_OUT.value!r}: its folder does not exist; create it first.')
  try:
    step, lines = _evaluate(_CONFIG.value, _WORKDIR.value, _BASE.value)
  except (ConfigError, WorkflowError, WorkdirError) as e:  # the message names the fix
    sys.exit(f'{type(e).__name__}: {e}')
  print(format_eval(step, lines))
  if _OUT.value:
    with open(_OUT.value, 'w', encoding='utf-8') as f:
      json.dump({'step': step, 'base': _BASE.value, **lines}, f, indent=2)


def _evaluate(config, workdir: str, base: bool) -> tuple[int, dict]:
  """(the step evaluated, the eval lines) of the run in `workdir`, or of the base."""
  from flexmarl import run
  from flexmarl.core.errors import ConfigError
  from flexmarl.rollout.held_out import evaluate, has_held_out
  from flexmarl.runtime.workdir import WorkdirError
  from flexmarl.workflows import build_workflow
  if not base:
    _check_run(workdir, config.agents)
  workflow = build_workflow(config.workflow)
  if not has_held_out(workflow):
    raise ConfigError(f'config.workflow: {type(workflow).__name__} has no held-out problems '
                      '(an eval_queries() method) to evaluate on; evaluate a run of a workflow '
                      'that has them (e.g. experiments/real_team.py), or add eval_queries() '
                      '(docs/workflows.md).')
  if base:
    workdir = tempfile.mkdtemp(prefix='flexmarl-eval-')
  orchestrator = run.build(config, workdir, workflow)
  try:
    step = 0 if base else orchestrator.restore()
    if not base and not step:
      raise WorkdirError(f'--workdir={workdir!r}: no checkpoint step is intact for every '
                         'agent (see the warnings above); train on, or give --base.')
    return step, evaluate(orchestrator.rollout_engine, orchestrator.workflow)
  finally:
    orchestrator.close()


if __name__ == '__main__':
  app.run(main)
