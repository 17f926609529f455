"""Small verifiable task families for the built-in workflows.

Each family makes (prompt, answer) pairs from a seeded generator and is checked
exactly. Answers of several tokens also earn partial credit per position, so a
policy learning from random weights gets a signal before its first exact hit.
No family may be solvable by a constant answer (tests enumerate each family and
check the best constant's exact-match rate stays at or below 0.3).
"""

from __future__ import annotations

import dataclasses
import inspect
import string
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Task:
  family: str
  prompt: str
  answer: str


def add(rng: np.random.Generator, max_operand: int = 4) -> Task:
  a, b = rng.integers(0, max_operand + 1, size=2)
  return Task('add', f'{a}+{b}', str(a + b))


def reverse(rng: np.random.Generator, length: int = 3, alphabet: int = 4) -> Task:
  s = ''.join(rng.choice(list(string.ascii_lowercase[:alphabet]), size=length))
  return Task('reverse', s, s[::-1])


def sort(rng: np.random.Generator, length: int = 2, max_digit: int = 4) -> Task:
  digits = rng.integers(0, max_digit + 1, size=length)
  return Task('sort', ''.join(map(str, digits)), ''.join(map(str, sorted(digits))))


def successor(rng: np.random.Generator, alphabet: int = 8) -> Task:
  i = int(rng.integers(0, alphabet))
  letters = string.ascii_lowercase[:alphabet]
  return Task('successor', f'{letters[i]}>', letters[(i + 1) % alphabet])


def predecessor(rng: np.random.Generator, alphabet: int = 8) -> Task:
  i = int(rng.integers(0, alphabet))
  letters = string.ascii_lowercase[:alphabet]
  return Task('predecessor', f'{letters[i]}<', letters[i - 1])  # 'a' wraps to the last


def double(rng: np.random.Generator, max_operand: int = 4) -> Task:
  x = int(rng.integers(0, max_operand + 1))
  return Task('double', f'{x}*2', str(2 * x))


FAMILIES: dict[str, Callable[..., Task]] = {
    'add': add, 'reverse': reverse, 'sort': sort, 'successor': successor,
    'predecessor': predecessor, 'double': double}


def check_task_args(family: str, args: Mapping[str, Any], field: str) -> dict[str, Any]:
  """`args` are keyword arguments of `family`'s generator; raises naming the unknown ones."""
  if family not in FAMILIES:
    raise ValueError(f'{field}: unknown task family {family!r}; known: {sorted(FAMILIES)}.')
  params = list(inspect.signature(FAMILIES[family]).parameters)[1:]  # after rng
  unknown = sorted(set(args) - set(params))
  if unknown:
    raise ValueError(f'{field}={dict(args)!r}: {unknown} are not arguments of task family '
                     f'{family!r}; its arguments: {params}.')
  return dict(args)


def partial_credit(pred: str, answer: str) -> float:
  """Fraction of positions that match, over the longer of the two strings."""
  if not pred and not answer:
    return 1.0
  hits = sum(p == a for p, a in zip(pred, answer))
  return hits / max(len(pred), len(answer))


def zipf_probs(k: int, exponent: float) -> np.ndarray:
  """P(rank i) ∝ 1 / (i+1)^exponent: the skewed query mix."""
  w = 1.0 / np.arange(1, k + 1) ** exponent
  return w / w.sum()
