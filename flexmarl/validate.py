"""Field checks shared by the config and its sections: each failure is a ConfigError
naming the field, the value and the fix."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any

import ml_collections

from flexmarl.errors import ConfigError


# Config fields that were renamed: old dotted name → (new name, what to know when moving).
RENAMED = {
    'rollout.queries_per_wave': ('rollout.query_concurrency',
                                 'the queries in flight at once; a finished one is replaced '
                                 'at once rather than after its wave'),
    'rollout.max_waves': ('rollout.max_step_queries',
                          'it counts the queries a step may consume, not waves: about '
                          'max_waves × query_concurrency'),
}


def fail(field: str, value: Any, fix: str) -> None:
  raise ConfigError(f'config.{field}={value!r}: {fix}')


def refuse_unknown(field: str, values: Mapping[str, Any], known: Any) -> None:
  """Refuse the fields of section `field` that are not in `known`; a renamed one is
  pointed to its new name."""
  unknown = sorted(set(values) - set(known))
  for name in unknown:
    if f'{field}.{name}' in RENAMED:
      new, note = RENAMED[f'{field}.{name}']
      fail(f'{field}.{name}', values[name], f'renamed: use `{new}` ({note}).')
  if unknown:
    fail(field, dict(values), f'unknown field(s) {unknown}; known: {sorted(known)}.')


def check_finite(config: Mapping | ml_collections.ConfigDict, prefix: str = '') -> None:
  """Every number anywhere in the config is finite (NaN passes `x <= 0` checks)."""
  for key, value in config.items():
    field = f'{prefix}{key}'
    if isinstance(value, (Mapping, ml_collections.ConfigDict)):
      check_finite(value, f'{field}.')
    elif isinstance(value, (list, tuple)):
      check_finite(dict(enumerate(value)), f'{field}.')
    elif isinstance(value, numbers.Real) and not math.isfinite(value):
      fail(field, value, 'must be a finite number.')


def whole_number(field: str, value: Any, minimum: int) -> int:
  """A whole number >= minimum (not a bool, not a string)."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    fail(field, value, f'give a whole number >= {minimum} (got {type(value).__name__}).')
  if value < minimum:
    fail(field, value, f'must be >= {minimum}.')
  return int(value)


def in_range(field: str, value: Any, low: float, high: float, fix: str = '') -> None:
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not low <= value <= high:
    fail(field, value, fix or f'must be a number in [{low}, {high}].')


def section(a: ml_collections.ConfigDict, key: str, cls, field: str, **extra) -> Any:
  """`cls(**a[key], **extra)`, with an unknown field named."""
  values = a[key].to_dict()
  known = {f.name for f in dataclasses.fields(cls)} - set(extra)
  refuse_unknown(f'{field}.{key}', values, known)
  return cls(**values, **extra)
