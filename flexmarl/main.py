"""Train a team of LLM agents: `python -m flexmarl.main --config=FILE --workdir=DIR`.

Config fields are overridden on the command line, e.g.
`--config.steps=20 --config.seed=1 --config.schedule=sync`. A rerun with the same
workdir resumes from its latest checkpoints.
"""

from __future__ import annotations

import os

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config file.',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Where metrics, checkpoints and the store go.')
flags.mark_flags_as_required(['config', 'workdir'])


def build(config, workdir: str, workflow=None):
  """Check the config, then build the team's JointOrchestrator over `workdir`.

  `workflow`: a Workflow object (see flexmarl.workflows.base); by default the
  built-in one that `config.workflow` names. Nothing is written before the config
  has been checked.
  """
  import jax  # after absl parsed flags, so XLA_FLAGS set by the caller take effect

  from flexmarl.config import build_team_spec
  from flexmarl.orchestrator import JointOrchestrator
  from flexmarl.tokenizer import load_tokenizer
  from flexmarl.workflows import build_workflow

  tokenizer = load_tokenizer(config.tokenizer)
  workflow = workflow or build_workflow(config.workflow)
  spec = build_team_spec(config, tokenizer.vocab_size, [d.id for d in jax.devices()],
                         workflow.agent_names())
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, 'config.json'), 'w', encoding='utf-8') as f:
    f.write(config.to_json_best_effort(indent=2))
  tokenizer.save(os.path.join(workdir, 'tokenizer'))
  return JointOrchestrator(spec, workflow, tokenizer, workdir)


def train(config, workdir: str, workflow=None, log=print) -> dict:
  """Build the team (see `build`) and run it to `config.steps`; returns the summary."""
  summary = build(config, workdir, workflow).run(log)
  log(format_summary(summary))
  return summary


def format_summary(summary: dict) -> str:
  rows = [f"{'agent':<12} {'accuracy first → last':>24} {'reward first → last':>22} {'updates':>8}"]
  for name, s in summary['agents'].items():
    rows.append(f"{name:<12} {s['first_accuracy']:>10.2f} → {s['last_accuracy']:<11.2f} "
                f"{s['first_reward']:>9.2f} → {s['last_reward']:<10.2f} {s['updates']:>8}")
  rows.append(f"{summary['steps']} steps in {summary['wall_s']:.0f}s, "
              f"{summary['tokens_per_s']:.0f} generated tokens/s")
  return '\n'.join(rows)


def main(argv):
  del argv
  if not flags.FLAGS['verbosity'].present:  # keep library INFO logs out of the progress lines
    logging.set_verbosity(logging.WARNING)
  train(_CONFIG.value, _WORKDIR.value)


if __name__ == '__main__':
  app.run(main)
