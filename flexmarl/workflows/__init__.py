"""Workflows, built from the `workflow` section of a config.

`workflow.name` is a built-in's name, or `package.module:ClassName` for a user's
own class (imported from `sys.path`; run from the folder that holds the package, or
add it to PYTHONPATH). The other fields of `workflow` are the class's keyword
arguments.
"""

from __future__ import annotations

import importlib
import sys

import ml_collections

from flexmarl.core.errors import ConfigError

from flexmarl.workflows.base import Workflow
from flexmarl.workflows.chat_router import ChatRouter
from flexmarl.workflows.hierarchical_assistant import HierarchicalAssistant
from flexmarl.workflows.rounds import SolverCheckerRounds
from flexmarl.workflows.single_task import SingleTask
from flexmarl.workflows.solver_verifier import SolverVerifier
from flexmarl.workflows.tool_turns import ToolTurns

WORKFLOWS = {'chat_router': ChatRouter, 'hierarchical_assistant': HierarchicalAssistant,
             'single_task': SingleTask, 'solver_checker_rounds': SolverCheckerRounds,
             'solver_verifier': SolverVerifier, 'tool_turns': ToolTurns}


def import_workflow_class(name: str) -> type:
  """`package.module:ClassName` → the class; errors name the module and the path searched."""
  module_name, _, class_name = name.partition(':')
  where = f'config.workflow.name={name!r}'
  if not module_name or not class_name:
    raise ConfigError(f'{where}: write package.module:ClassName (a colon before the class).')
  try:
    module = importlib.import_module(module_name)
  except ImportError as e:
    raise ConfigError(
        f'{where}: cannot import module {module_name!r} ({e}). Searched sys.path = '
        f'{sys.path}. Fix: run from the folder that holds it, or add that folder to '
        'PYTHONPATH.') from None
  cls = getattr(module, class_name, None)
  if not isinstance(cls, type):
    found = sorted(n for n, v in vars(module).items() if isinstance(v, type)
                   and getattr(v, '__module__', None) == module.__name__)
    raise ConfigError(f'{where}: module {module_name!r} ({module.__file__}) has no class '
                      f'{class_name!r}; its classes: {found}.')
  return cls


def build_workflow(cfg: ml_collections.ConfigDict) -> Workflow:
  """`cfg.name` picks the class; the other fields are its keyword arguments."""
  kwargs = cfg.to_dict()
  name = kwargs.pop('name')
  if ':' in str(name):
    cls = import_workflow_class(name)
  elif name in WORKFLOWS:
    cls = WORKFLOWS[name]
  else:
    raise ConfigError(f'config.workflow.name={name!r}: choose one of {sorted(WORKFLOWS)}, '
                      'give your own class as package.module:ClassName, '
                      'or pass a Workflow object to flexmarl.run.train(config, workdir, workflow).')
  try:
    return cls(**kwargs)
  except (TypeError, ValueError) as e:
    raise ConfigError(f'config.workflow ({name}): {e}') from None
