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


def fail(field: str, value: Any, fix: str) -> None:
  raise ConfigError(f'config.{field}={value!r}: {fix}')


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
  unknown = sorted(set(values) - known)
  if unknown:
    fail(f'{field}.{key}', values, f'unknown field(s) {unknown}; known: {sorted(known)}.')
  return cls(**values, **extra)
