"""What every part's spec shares: reading its config section (defaults generated from
the spec dataclass, unknown, renamed and removed fields refused) and the field checks.
Each failure is a ConfigError naming the field, the value and the fix."""

from __future__ import annotations

import dataclasses
import math
import numbers
import typing
from collections.abc import Mapping
from typing import Any

import ml_collections

from flexmarl.core.errors import ConfigError

# Config fields that were renamed or removed: old dotted name → (new name, or '' when
# the field is gone, and what to know when moving).
REPLACED = {
    'rollout.queries_per_wave': ('rollout.query_concurrency',
                                 'the queries in flight at once; a finished one is replaced '
                                 'at once rather than after its wave'),
    'rollout.max_waves': ('rollout.max_step_queries',
                          'it counts the queries a step may consume, not waves: about '
                          'max_waves × query_concurrency'),
    'rollout.admission': ('', 'the rollout always streams; drop the field'),
}

# Field metadata of a spec field that is set from another section, not configured.
DERIVED = {'derived': True}


def replacement(field: str, flag: bool = False) -> str | None:
  """What replaced the renamed or removed `field`, as a fix; None if it was not.
  `flag`: spell the new name as a command-line flag."""
  if field not in REPLACED:
    return None
  new, note = REPLACED[field]
  if not new:
    return f'removed: {note}.'
  return f'renamed: use {f"--config.{new}" if flag else f"`{new}`"} ({note}).'


def fail(field: str, value: Any, fix: str) -> typing.NoReturn:
  raise ConfigError(f'config.{field}={value!r}: {fix}')


def refuse_unknown(field: str, values: Mapping[str, Any], known: Any) -> None:
  """Refuse the fields of section `field` that are not in `known`; a renamed or removed
  one is told what replaced it."""
  unknown = sorted(set(values) - set(known))
  for name in unknown:
    fix = replacement(f'{field}.{name}')
    if fix:
      fail(f'{field}.{name}', values[name], fix)
  if unknown:
    fail(field, dict(values), f'unknown field(s) {unknown}; known: {sorted(known)}.')


def _default(f: dataclasses.Field) -> Any:
  return f.default_factory() if f.default is dataclasses.MISSING else f.default


def config_of(cls: type, **overrides: Any) -> ml_collections.ConfigDict:
  """The config section of spec dataclass `cls`: every configured field (one with a
  default, not DERIVED) with its default, so that both are written once, on `cls`.
  A field of a dataclass type becomes a section of its own; an optional field without
  a value, a placeholder of its type (command-line flags can then set it)."""
  hints = typing.get_type_hints(cls)
  values: dict[str, Any] = {}
  for f in dataclasses.fields(cls):
    if f.metadata.get('derived') or (f.default is dataclasses.MISSING
                                     and f.default_factory is dataclasses.MISSING):
      continue
    default = _default(f)
    if dataclasses.is_dataclass(default):
      values[f.name] = config_of(type(default))
    elif default is None:
      kind = next(t for t in typing.get_args(hints[f.name]) if t is not type(None))
      values[f.name] = ml_collections.config_dict.placeholder(kind)
    elif isinstance(default, Mapping):
      values[f.name] = ml_collections.ConfigDict(dict(default))
    else:
      values[f.name] = default
  cfg = ml_collections.ConfigDict(values)
  for key, value in overrides.items():
    cfg[key] = value
  return cfg


def read_section(cls: type, field: str, values: Mapping[str, Any] | None, **derived: Any):
  """`cls` from config section `field`: its `values` over the defaults, unknown fields
  refused; `derived`: the DERIVED fields, set from other sections."""
  given = (values.to_dict() if isinstance(values, ml_collections.ConfigDict)
           else dict(values or {}))
  refuse_unknown(field, given, config_of(cls))
  return cls(**{**config_of(cls).to_dict(), **given, **derived})


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


def number(field: str, value: Any) -> float:
  """A real number (not a bool, not a string), safe to compare."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    fail(field, value, f'give a number (got {type(value).__name__}).')
  return value


def whole_number(field: str, value: Any, minimum: int, meaning: str = '') -> int:
  """A whole number >= minimum (not a bool, not a string); `meaning`: what the
  smallest values mean, said when a value is too small."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    fail(field, value, f'give a whole number >= {minimum} (got {type(value).__name__}).')
  if value < minimum:
    fail(field, value, f'must be >= {minimum}{f" ({meaning})" if meaning else ""}.')
  return int(value)


def in_range(field: str, value: Any, low: float, high: float, fix: str = '') -> None:
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not low <= value <= high:
    fail(field, value, fix or f'must be a number in [{low}, {high}].')


def one_of(field: str, value: Any, choices: typing.Sequence[Any]) -> None:
  if value not in choices:
    fail(field, value, f'choose one of {list(choices)}.')
