"""Built-in workflows, built from the `workflow` section of a config."""

from __future__ import annotations

import ml_collections

from flexmarl.errors import ConfigError

from flexmarl.workflows.base import Workflow
from flexmarl.workflows.hierarchical_assistant import HierarchicalAssistant
from flexmarl.workflows.single_task import SingleTask
from flexmarl.workflows.solver_verifier import SolverVerifier

WORKFLOWS = {'hierarchical_assistant': HierarchicalAssistant, 'single_task': SingleTask,
             'solver_verifier': SolverVerifier}


def build_workflow(cfg: ml_collections.ConfigDict) -> Workflow:
  """`cfg.name` picks the class; the other fields are its keyword arguments."""
  kwargs = cfg.to_dict()
  name = kwargs.pop('name')
  if name not in WORKFLOWS:
    raise ConfigError(f'config.workflow.name={name!r}: choose one of {sorted(WORKFLOWS)}, '
                     'or pass a Workflow object to flexmarl.main.train(config, workdir, workflow).')
  try:
    return WORKFLOWS[name](**kwargs)
  except (TypeError, ValueError) as e:
    raise ConfigError(f'config.workflow ({name}): {e}') from None
