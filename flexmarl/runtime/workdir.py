"""What a workdir belongs to, and whether a new run may carry it on.

A workdir holds one run: `config.json` (the config it runs with) and `run.json`
(the workflow class and, from the command line, the experiment file). Starting a
run over an existing workdir resumes it, so the new config is compared with the
saved one first, field by field:
- a field that a resume cannot honour (model sizes, the agents, the tokenizer, the
  workflow, the seed, the schedule, batch sizes, GRPO and optimizer settings...) is
  refused, naming every differing field and the two ways out;
- a field that only changes what happens from here on (`steps`, `checkpoint_every`,
  the schedules' lengths, where meshes and rollout instances run, whether placement
  may fit the team to the devices) is accepted with a warning.
Nothing is written until the run is accepted, so a refused start leaves the
workdir exactly as it was.
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Mapping
from typing import Any

CONFIG_FILE, RUN_FILE = 'config.json', 'run.json'
# Fields a resumed run may change (patterns over dotted field names); any other
# difference is refused.
HARMLESS = ('steps', 'checkpoint_every', 'trace_steps', 'store_keep_steps', 'compile_cache_dir',
            'prompt_width_multiple',
            'agents.*.optimizer.decay_steps', 'agents.*.grpo.entropy_decay_steps',
            'agents.*.grpo.skip_without_signal', 'agents.*.grpo.unstick_below',
            'agents.*.grpo.unstick_after', 'agents.*.grpo.collapse_*',
            'agents.*.grpo.balance_answers', 'agents.*.grpo.zero_spread_baseline',
            'agents.*.grpo.self_imitation',
            'agents.*.grpo.entropy_by_error', 'agents.*.mesh_shape',
            'rollout.devices', 'placement', 'cluster.*',
            'rollout.admission')  # removed: runs that set it resume streaming


class WorkdirError(ValueError):
  """The workdir holds another run; the message names the differences and the fix."""


def config_values(config) -> dict[str, Any]:
  """A config (ConfigDict or mapping) as plain JSON values, references resolved."""
  raw = config.to_json_best_effort() if hasattr(config, 'to_json_best_effort') else json.dumps(
      config)
  return json.loads(raw)


def flatten(values: Any, prefix: str = '') -> dict[str, Any]:
  """{'a': {'b': 1}} → {'a.b': 1}; lists stay values."""
  if not isinstance(values, Mapping) or not values:
    return {prefix.rstrip('.'): values}
  out = {}
  for key, value in values.items():
    out.update(flatten(value, f'{prefix}{key}.'))
  return out


def workflow_id(workflow) -> str:
  cls = type(workflow)
  return f'{cls.__module__}:{cls.__qualname__}'


def diff_configs(old: Mapping, new: Mapping, defaults: Mapping[str, Any] | None = None
                 ) -> tuple[dict, dict]:
  """(refused, harmless): dotted field → (old value, new value) for every difference.
  `defaults` (dotted field → its default): a field the saved config lacks (the run began
  before the field existed) at its default now is no difference: the run had it so."""
  a, b = flatten(old), flatten(new)
  defaults = defaults or {}
  refused, harmless = {}, {}
  for field in sorted(set(a) | set(b)):
    before, after = a.get(field, '<absent>'), b.get(field, '<absent>')
    if before == after or (field not in a and field in defaults and defaults[field] == after):
      continue
    ok = any(fnmatch.fnmatchcase(field, p) for p in HARMLESS)
    (harmless if ok else refused)[field] = (before, after)
  return refused, harmless


def _read_json(path: str) -> dict | None:
  if not os.path.exists(path):
    return None
  try:
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise WorkdirError(f'{path} cannot be read ({e}); it records which run owns the workdir. '
                       'Fix: use a new --workdir, or restore the file.') from None


def check_usable(workdir: str) -> None:
  """Raise WorkdirError unless `workdir` is a folder this process can write in, or can be
  made one (its nearest existing parent is such a folder)."""
  existing = os.path.abspath(workdir)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise WorkdirError(f'--workdir {workdir}: {existing} is a file, not a folder. Fix: give '
                       'the path of a folder (it is created if missing), e.g. runs/NAME.')
  if not os.access(existing, os.W_OK | os.X_OK):
    raise WorkdirError(f'--workdir {workdir}: the folder {existing} is not writable by this '
                       'user. Fix: give a folder you can write in, or make it writable '
                       f'(chmod u+w {existing}).')


def check_workdir(workdir: str, config, workflow, experiment: str | None = None,
                  defaults: Mapping[str, Any] | None = None) -> list[str]:
  """Raise WorkdirError if `workdir` is not a writable folder or holds a run this config
  cannot carry on; returns warnings (harmless changes) to print. Writes nothing.
  `defaults`: see `diff_configs`."""
  check_usable(workdir)
  old = _read_json(os.path.join(workdir, CONFIG_FILE))
  owner = _read_json(os.path.join(workdir, RUN_FILE)) or {}
  if old is None:
    return []
  where = owner.get('experiment') or 'another config'
  mine = workflow_id(workflow)
  if owner.get('workflow') not in (None, mine):
    raise WorkdirError(
        f'workdir {workdir} belongs to a run of workflow {owner["workflow"]} ({where}); this '
        f'run uses {mine}. Fix: use a new --workdir for this run.')
  refused, harmless = diff_configs(old, config_values(config), defaults)
  if refused:
    lines = '\n'.join(f'  {k}: {v[0]!r} in the workdir, {v[1]!r} now' for k, v in refused.items())
    back = ' '.join(f'--config.{k}={v[0]}' for k, v in refused.items()
                    if v[0] != '<absent>' and not isinstance(v[0], (dict, list)))
    raise WorkdirError(
        f'workdir {workdir} holds a run ({where}) whose config differs in fields a resume '
        f'cannot change:\n{lines}\nFix: use a new --workdir for this config, or set these '
        f'fields back to the workdir\'s values{": " + back if back else ""}.')
  return [f'{k}: {v[0]!r} → {v[1]!r} (resuming {workdir} with the new value)'
          for k, v in harmless.items()]


def _write_json(path: str, values: Any) -> None:
  tmp = path + '.tmp'
  with open(tmp, 'w', encoding='utf-8') as f:
    json.dump(values, f, indent=2)
  os.replace(tmp, path)


def accept_workdir(workdir: str, config, workflow, experiment: str | None = None) -> None:
  """Record the accepted run in `workdir` (call after `check_workdir` and every other check)."""
  try:
    os.makedirs(workdir, exist_ok=True)
    _write_json(os.path.join(workdir, CONFIG_FILE), config_values(config))
    owner = _read_json(os.path.join(workdir, RUN_FILE)) or {}
    _write_json(os.path.join(workdir, RUN_FILE),
                {'workflow': workflow_id(workflow),
                 'experiment': owner.get('experiment') or experiment})
  except OSError as e:  # e.g. a read-only file system, a full disk
    raise WorkdirError(f'--workdir {workdir} cannot be written: {e}. Fix: give a folder you '
                       'can write in, with free space.') from None
