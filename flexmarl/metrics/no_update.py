"""Say why an agent gets no update: the rows its steps serve never fill its global batch.

An agent trains only on a full global batch (`agents.NAME.global_batch` rows); its rows
wait across steps until then, and a step ends after `rollout.max_step_queries` queries.
Where the queries serve an agent fewer rows than that over the whole run, it never
trains, and its end-table row (`updates 0`, NaN rewards) does not say why. Three places
say so, with the reason and the fix:
- at start (`start_warnings`), where the workflow's dry run makes it certain: the run's
  queries at most, times the most rows one dry-run query gave the agent, is less than
  its global batch;
- during the run (`UpdateWatch`), once an agent with rows has gone `patience` steps
  without an update;
- in the end table (`reason`), for every agent that had none.
An agent that gets no rows at all is `StarvationWatch`'s to report.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence

from flexmarl.data.sample_id import parse_sample_id


def reason(agent: str, steps: int, waiting: int, global_batch: int,
           max_step_queries: int) -> str:
  """Why `agent` has had no update in `steps` steps, with `waiting` rows in its buffer."""
  if not waiting:
    return (f'agent {agent!r} has had no update in {steps} steps: no query served it a row. '
            'Fix: check what the agents called before it answer (the starvation warning '
            'names them) and that the workflow calls it.')
  per_step = waiting / steps
  need = f'about {global_batch / per_step:.0f} steps'
  return (f'agent {agent!r} has had no update in {steps} steps: {waiting} rows wait for its '
          f'global_batch={global_batch} (about {per_step:.1f} a step, so a batch takes {need}). '
          f'Fix: raise rollout.max_step_queries (now {max_step_queries}) or lower '
          f'agents.{agent}.global_batch (with micro_batch), or run more steps.')


def start_warnings(requests: Sequence[tuple[str, str, list[str]]],
                   global_batches: Mapping[str, int], steps: int,
                   max_step_queries: int) -> list[str]:
  """From the workflow's dry run (its requests: (agent, prompt, sample_ids)), a line per
  agent that the configured run cannot serve a global batch in all its steps."""
  rows = collections.defaultdict(collections.Counter)  # agent -> query -> rows
  for agent, _, sample_ids in requests:
    for sid in sample_ids:
      rows[agent][parse_sample_id(sid).query_id] += 1
  lines = []
  for agent, per_query in sorted(rows.items()):
    most = max(per_query.values()) * steps * max_step_queries
    if most < global_batches[agent]:
      lines.append(
          f'agent {agent!r} will not train in this run: {steps} steps × rollout.max_step_'
          f'queries={max_step_queries} queries × at most {max(per_query.values())} rows a '
          f'query (the workflow\'s dry run) = {most} rows, fewer than its global_batch='
          f'{global_batches[agent]}. Fix: raise rollout.max_step_queries or steps, or lower '
          f'agents.{agent}.global_batch (with micro_batch).')
  return lines


class UpdateWatch:
  """Per agent, counts the steps since its last update (or the start); warns once when
  the count reaches `patience` while rows wait, and again after an update and a new wait."""

  def __init__(self, global_batches: Mapping[str, int], max_step_queries: int,
               patience: int = 5):
    if patience < 1:
      raise ValueError(f'UpdateWatch(patience={patience}): give a patience >= 1 steps.')
    self.global_batches, self.max_step_queries = dict(global_batches), max_step_queries
    self.patience = patience
    self._since = dict.fromkeys(global_batches, 0)

  def end_step(self, step: int, lines: Mapping[str, Mapping[str, float]]) -> list[str]:
    """Close step `step` from its metrics lines; a warning line per agent that has just
    waited `patience` steps with rows but no update."""
    warnings = []
    for agent, batch in self.global_batches.items():
      line = lines.get(agent, {})
      if line.get('updated'):
        self._since[agent] = 0
        continue
      self._since[agent] += 1
      waiting = waiting_rows(line)
      if self._since[agent] == self.patience and waiting:
        warnings.append(f'step {step}: ' + reason(agent, self._since[agent], waiting, batch,
                                                  self.max_step_queries))
    return warnings


def waiting_rows(line: Mapping[str, float]) -> int:
  """The rows an agent's buffer holds after a step without an update (its metrics line:
  `rows` under the on-policy schedules, `buffered_rows` under `async:k`)."""
  return int(line.get('buffered_rows', line.get('rows', 0)) or 0)
