"""Held-out evaluation of a run's newest checkpoint, or of the base model alone.

  python -m flexmarl.evaluate --config=experiments/real_team.py --workdir=runs/real_team
  python -m flexmarl.evaluate --config=experiments/real_team.py --base   # before training

prints greedy pass@1 and mean reward per agent and for the team on the workflow's
held-out problems (`flexmarl.held_out`); `--out=FILE` writes them as JSON.
"""

from __future__ import annotations

import json
import os
import tempfile

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config file.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run folder whose newest checkpoint to '
                               'evaluate.')
_BASE = flags.DEFINE_bool('base', False, "Evaluate the agents' starting weights (the base "
                          'model, before any training) instead of a checkpoint.')
_OUT = flags.DEFINE_string('out', '', 'Write the table here as JSON.')


def main(argv) -> None:
  del argv
  from flexmarl import run
  from flexmarl.held_out import evaluate, format_eval
  if not _BASE.value and not _WORKDIR.value:
    raise app.UsageError('give --workdir=RUN (its newest checkpoint) or --base.')
  config = _CONFIG.value
  workdir = _WORKDIR.value if not _BASE.value else tempfile.mkdtemp(prefix='flexmarl-eval-')
  if not _BASE.value and not os.path.isdir(workdir):
    raise app.UsageError(f'--workdir={workdir!r} does not exist.')
  orchestrator = run.build(config, workdir)
  try:
    step = orchestrator.restore() if not _BASE.value else 0
    if not _BASE.value and not step:
      raise app.UsageError(f'--workdir={workdir!r} has no checkpoint yet.')
    lines = evaluate(orchestrator.rollout_engine, orchestrator.workflow)
  finally:
    orchestrator.close()
  print(format_eval(step, lines))
  if _OUT.value:
    with open(_OUT.value, 'w', encoding='utf-8') as f:
      json.dump({'step': step, 'base': _BASE.value, **lines}, f, indent=2)


if __name__ == '__main__':
  app.run(main)
