"""Train a team of LLM agents: `python -m flexmarl.main --config=FILE --workdir=DIR`.

Config fields are overridden on the command line, e.g.
`--config.steps=20 --config.seed=1 --config.schedule=sync`. A rerun with the same
workdir resumes from its latest checkpoints. Library use (scripts, notebooks):
`flexmarl.run.build` / `flexmarl.run.train`; this module only adds the flags.
"""

from __future__ import annotations

import sys

import ml_collections
from absl import app, flags
from ml_collections import config_flags

from flexmarl.run import train
from flexmarl.spec.validate import replacement

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config file.',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Where metrics, checkpoints and the store go.')
flags.mark_flags_as_required(['config', 'workdir'])


def _overridden_fields(argv: list[str]) -> list[str]:
  """The dotted fields that `--config.FIELD=VALUE` arguments set."""
  return [a[len('--config.'):].split('=', 1)[0] for a in argv if a.startswith('--config.')]


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with the fix added to what went wrong (a renamed, removed or unknown
  `--config.x`, a bad value, a missing config file, a config file that raises)."""
  for field in _overridden_fields(argv):
    fix = replacement(field, flag=True)
    if fix:
      sys.exit(f'--config.{field}: {fix}')
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    sys.exit(f'FATAL Flags parsing error: {e}\nFix: give --config (an experiment file) and '
             "--workdir, and each --config.FIELD a value of that field's type (see the "
             'experiment file); --helpfull lists the flags.')
  except Exception as e:  # noqa: BLE001 — an override names no field, or the file raised
    missing = [f for f in _overridden_fields(argv) if repr(f.rsplit('.', 1)[-1]) in str(e)]
    if missing:
      sys.exit(f'--config.{missing[0]}: the config has no such field ({type(e).__name__}: '
               f'{e}). Fix: check the name against the experiment file and '
               'flexmarl.config.rollout_config / agent_config / training_config.')
    config = next((a.split('=', 1)[1] for a in argv if a.startswith('--config=')), '?')
    sys.exit(f'--config={config}: the experiment file raised {type(e).__name__}: {e}\n'
             'Fix: correct get_config() in that file, or give another experiment, e.g. '
             '--config=experiments/hierarchical_assistant.py.')


def main(argv):
  del argv
  # Imported here: jax loads only once the flags are parsed.
  from flexmarl.config import ConfigError
  from flexmarl.runtime.workdir import WorkdirError
  from flexmarl.workflows.checks import WorkflowError
  config = _CONFIG.value
  if not isinstance(config, ml_collections.ConfigDict):  # the file could not be loaded
    try:
      config.seed  # raises the loading error
    except Exception as e:  # noqa: BLE001
      sys.exit(f'--config={flags.FLAGS["config"].config_filename}: cannot load it: {e}\n'
               'Fix: give the path of an experiment file that defines get_config(), e.g. '
               '--config=experiments/hierarchical_assistant.py.')
  try:
    train(config, _WORKDIR.value, experiment=flags.FLAGS['config'].config_filename)
  except (ConfigError, WorkflowError, WorkdirError) as e:  # the message names the fix
    sys.exit(f'{type(e).__name__}: {e}')


if __name__ == '__main__':
  app.run(main, flags_parser=parse_flags)
