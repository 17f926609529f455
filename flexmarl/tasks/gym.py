"""reasoning-gym datasets as a task source for any workflow.

`reasoning-gym` (PyPI) generates reasoning tasks procedurally — arithmetic, chain sums,
letter counting, word spelling, sudoku, mazes, ... — each with its own scorer, and needs
no download. A `GymTask` names one dataset and its config; it gives

- training problems drawn from the query stream's generator (so they follow the run's seed),
- a held-out split of `held_out` problems from another dataset seed, disjoint from every
  training problem by question text (a training draw that repeats a held-out question is
  drawn again), and
- the dataset's own scorer as the reward (partial credit where the scorer gives it).

A problem travels in a `Query` as its split and index only; its entry (question, answer,
metadata) is regenerated from them when it is scored, since the datasets are pure
functions of (seed, index).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

TRAIN_SIZE = 10 ** 9  # indices the training stream draws from (items are made on demand)
MAX_REDRAWS = 100
SET_BY_TASK = frozenset({'seed', 'size'})  # dataset config fields the task sets itself


@functools.lru_cache(maxsize=64)
def _dataset(name: str, config: tuple, seed: int, size: int):
  import reasoning_gym  # only workflows on reasoning-gym tasks need it
  return reasoning_gym.create_dataset(name, seed=seed, size=size, **dict(config))


def _defaults(dataset: str) -> dict[str, Any]:
  """The config fields of `dataset` a user sets, with their defaults."""
  from reasoning_gym.factory import DATASETS
  return {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
          for f in dataclasses.fields(DATASETS[dataset][1]) if f.name not in SET_BY_TASK}


def _check_config(dataset: str, config: Mapping[str, Any], field: str) -> None:
  """`dataset` is one reasoning-gym has, and `config` names only its config's fields."""
  from reasoning_gym.factory import DATASETS
  if dataset not in DATASETS:
    close = difflib.get_close_matches(dataset, DATASETS, n=3)
    raise ValueError(f'{field}: unknown reasoning-gym dataset {dataset!r}'
                     f'{f" (did you mean {close}?)" if close else ""}; name one of its '
                     f'{len(DATASETS)} datasets (sorted(reasoning_gym.factory.DATASETS) '
                     f'lists them), e.g. {sorted(DATASETS)[:6]}.')
  ours = sorted(SET_BY_TASK & set(config))
  if ours:
    raise ValueError(f'{field}: reasoning-gym dataset {dataset!r} refuses config '
                     f'{dict(config)} here: drop {ours}, the task sets them (from the '
                     'workflow\'s data_seed and held_out).')
  unknown = sorted(set(config) - set(_defaults(dataset)))
  if unknown:
    raise ValueError(f'{field}: reasoning-gym dataset {dataset!r} refuses config '
                     f'{dict(config)}: it has no field(s) {unknown}; its fields, with their '
                     f'defaults: {_defaults(dataset)}.')


class GymTask:
  """One reasoning-gym dataset: training draws, a disjoint held-out split, its scorer.

  Every check runs here, when the workflow is built (before anything compiles): the
  dataset's name, its config (the dataset's own checks, run on one problem) and a
  held-out split that the dataset has enough distinct problems for."""

  def __init__(self, dataset: str, config: Mapping[str, Any] | None = None,
               held_out: int = 64, data_seed: int = 0, field: str = 'workflow'):
    """`field`: the config section of the dataset's config, named in errors."""
    try:
      import reasoning_gym  # noqa: F401 — only workflows on reasoning-gym tasks need it
    except ImportError:
      raise ValueError(f'{field}: reasoning-gym tasks need the package; '
                       'pip install reasoning-gym.') from None
    config = dict(config or {})
    _check_config(dataset, config, field)
    if isinstance(held_out, bool) or not isinstance(held_out, numbers.Integral) \
        or held_out < 0:
      raise ValueError(f'{field}: held_out={held_out!r}: give a whole number >= 0 (0: no '
                       'held-out split).')
    self.name, self.held_out, self.data_seed = dataset, int(held_out), int(data_seed)
    self._config = tuple(sorted(config.items()))
    try:
      self._split('eval')[0]
    except Exception as e:  # noqa: BLE001 — a config the generator cannot use fails anywhere
      raise ValueError(f'{field}: reasoning-gym dataset {dataset!r} refuses config {config} '
                       f'({type(e).__name__}: {e}); change the fields it names (its fields, '
                       f'with their defaults: {_defaults(dataset)}).') from None
    n, distinct = self.held_out, len(self._held_out_questions)
    # n draws of D problems hold n·(1 - (1 - 1/n)^n) distinct ones on average when D = n;
    # fewer (one repeat spared: a small split may repeat a problem by chance), and the
    # dataset has fewer distinct problems than the split asks for.
    if n and distinct + 1 < n * (1 - (1 - 1 / n) ** n):
      raise ValueError(f'{field}: held_out={n}: reasoning-gym dataset {dataset!r} with config '
                       f'{config} has fewer distinct problems than that (its {n} held-out '
                       f'draws hold {distinct}); lower held_out to {distinct // 2} or less, '
                       'or widen the config (e.g. more digits or terms), leaving problems '
                       'for training.')

  def _split(self, split: str):
    if split == 'eval':  # another dataset seed than training's
      return _dataset(self.name, self._config, self.data_seed * 2 + 1, max(self.held_out, 1))
    return _dataset(self.name, self._config, self.data_seed * 2, TRAIN_SIZE)

  @functools.cached_property
  def _held_out_questions(self) -> frozenset[str]:
    data = self._split('eval')
    return frozenset(data[i]['question'] for i in range(self.held_out))

  def entry(self, split: str, index: int) -> dict:
    """The problem (question, answer, metadata) at `index` of `split` ('train' | 'eval')."""
    return self._split(split)[int(index)]

  def draw(self, rng: np.random.Generator) -> int:
    """A training problem's index, never one whose question is held out."""
    for _ in range(MAX_REDRAWS):
      index = int(rng.integers(TRAIN_SIZE))
      if self.entry('train', index)['question'] not in self._held_out_questions:
        return index
    raise ValueError(f'reasoning-gym dataset {self.name!r} with config {dict(self._config)}: '
                     f'{MAX_REDRAWS} training draws in a row were held-out questions; the '
                     'task has too few distinct problems for a held-out split of '
                     f'{self.held_out}: lower held_out or widen the config.')

  def score(self, answer: str, split: str, index: int) -> float:
    """The dataset's scorer on `answer` (the text of the final answer), in [0, 1]."""
    entry = self.entry(split, index)
    return float(self._split(split).score_answer(answer.strip(), entry))
