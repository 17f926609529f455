"""Metrics a person can plot: `metrics.jsonl` plus TensorBoard event files.

One JSON object per line, per agent per step and one 'team' line per step. On
resume the lines past the restored step (written after the last checkpoint by a
run that then died) are dropped, since the resumed run writes them again.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping

from tensorboardX import SummaryWriter

TEAM = 'team'


class MetricsWriter:

  def __init__(self, workdir: str, resume_step: int = 0):
    self.path = os.path.join(workdir, 'metrics.jsonl')
    self._truncate_after(resume_step)
    self._file = open(self.path, 'a', encoding='utf-8')
    self._tb = SummaryWriter(os.path.join(workdir, 'tensorboard'))

  def _truncate_after(self, step: int) -> None:
    if not os.path.exists(self.path):
      return
    kept = [line for line in read_metrics(self.path) if line['step'] <= step]
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

  def close(self) -> None:
    self._file.close()
    self._tb.close()


def read_metrics(path: str) -> list[dict]:
  """All lines of a metrics.jsonl; a torn last line (a crash mid-write) is skipped."""
  lines = []
  with open(path, encoding='utf-8') as f:
    for raw in f:
      try:
        lines.append(json.loads(raw))
      except json.JSONDecodeError:
        continue
  return lines
