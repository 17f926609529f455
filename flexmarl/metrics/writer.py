"""Metrics a person can plot: `metrics.jsonl` plus TensorBoard event files.

One JSON object per line, per agent per step and one 'team' line per step. On
resume the lines past the restored step (written after the last checkpoint by a
run that then died) are dropped, since the resumed run writes them again. A line
that does not parse (a torn write) or a missing file is never passed over in
silence: `scan_metrics` names it, and the writer keeps what it found in `problems`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping

from absl import logging
from tensorboardX import SummaryWriter

TEAM = 'team'


class MetricsWriter:

  def __init__(self, workdir: str, resume_step: int = 0):
    self.path = os.path.join(workdir, 'metrics.jsonl')
    self.problems: list[str] = []  # what was wrong with the file on resume, for the log
    if resume_step and not os.path.exists(self.path):
      self.problems.append(f'{self.path} is missing: the metrics of steps 1..{resume_step} '
                           'are lost (the run resumes; summary.json lists them under '
                           "'metrics_lost').")
    self._truncate_after(resume_step)
    self._file = open(self.path, 'a', encoding='utf-8')
    self._tb = SummaryWriter(os.path.join(workdir, 'tensorboard'))

  def _truncate_after(self, step: int) -> None:
    if not os.path.exists(self.path):
      return
    lines, problems = scan_metrics(self.path)
    self.problems += problems
    kept = [line for line in lines if line['step'] <= step]
    lost = lost_steps(kept, step)
    if lost:
      self.problems.append(f'{self.path} has no lines for steps {format_steps(lost)} of the '
                           f'{step} the run resumes after (the file was cut or edited): their '
                           "metrics are lost; summary.json lists them under 'metrics_lost'.")
    tmp = self.path + '.tmp'
    with open(tmp, 'w', encoding='utf-8') as f:
      f.writelines(json.dumps(line) + '\n' for line in kept)
    os.replace(tmp, self.path)

  def write(self, step: int, agent: str, values: Mapping[str, float]) -> None:
    line = {'step': step, 'agent': agent, **values}
    self._file.write(json.dumps(line) + '\n')
    self._file.flush()
    for key, value in values.items():
      if isinstance(value, (int, float)) and math.isfinite(value):
        self._tb.add_scalar(f'{agent}/{key}', value, step)

  def write_lines(self, step: int, lines: Mapping[str, Mapping[str, float]]) -> None:
    """One line per agent (and 'team') of `step`."""
    for agent, values in lines.items():
      self.write(step, agent, values)

  def close(self) -> None:
    self._file.close()
    self._tb.close()


def scan_metrics(path: str) -> tuple[list[dict], list[str]]:
  """The parsed lines of a metrics.jsonl, and a message for each line that was skipped
  (torn by a crash mid-write, or edited) or for a missing file."""
  if not os.path.exists(path):
    return [], [f'{path} is missing; no metrics to read.']
  lines, problems = [], []
  with open(path, encoding='utf-8') as f:
    for number, raw in enumerate(f, 1):
      try:
        line = json.loads(raw)
        if not isinstance(line, dict) or not {'step', 'agent'} <= set(line):
          raise ValueError('not a metrics object with step and agent')
        lines.append(line)
      except ValueError as e:  # JSONDecodeError is a ValueError
        problems.append(f'{path}:{number} skipped, it does not parse ({e}): {raw[:80]!r}')
  return lines, problems


def lost_steps(lines: list[dict], steps: int) -> list[int]:
  """Steps 1..`steps` without a single metrics line."""
  return sorted(set(range(1, steps + 1)) - {line['step'] for line in lines})


def format_steps(steps: list[int]) -> str:
  """[1, 2, 3, 5] → '1..3, 5'."""
  runs: list[list[int]] = []
  for step in steps:
    if runs and step == runs[-1][1] + 1:
      runs[-1][1] = step
    else:
      runs.append([step, step])
  return ', '.join(f'{a}..{b}' if b > a else str(a) for a, b in runs)


def read_metrics(path: str) -> list[dict]:
  """The parsed lines of a metrics.jsonl; each skipped line is logged as a warning."""
  lines, problems = scan_metrics(path)
  for problem in problems:
    logging.warning('%s', problem)
  return lines
