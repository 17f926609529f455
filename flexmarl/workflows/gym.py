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

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

TRAIN_SIZE = 10 ** 9  # indices the training stream draws from (items are made on demand)
MAX_REDRAWS = 100


@functools.lru_cache(maxsize=64)
def _dataset(name: str, config: tuple, seed: int, size: int):
  import reasoning_gym  # only workflows on reasoning-gym tasks need it
  return reasoning_gym.create_dataset(name, seed=seed, size=size, **dict(config))


class GymTask:
  """One reasoning-gym dataset: training draws, a disjoint held-out split, its scorer."""

  def __init__(self, dataset: str, config: Mapping[str, Any] | None = None,
               held_out: int = 64, data_seed: int = 0, field: str = 'workflow'):
    try:
      import reasoning_gym
    except ImportError:
      raise ValueError(f'{field}: reasoning-gym tasks need the package; '
                       'pip install reasoning-gym.') from None
    from reasoning_gym.factory import DATASETS
    if dataset not in DATASETS:
      raise ValueError(f'{field}: unknown reasoning-gym dataset {dataset!r}; known: '
                       f'{sorted(DATASETS)[:12]} ... ({len(DATASETS)} in all).')
    self.name, self.held_out, self.data_seed = dataset, int(held_out), int(data_seed)
    self._config = tuple(sorted(dict(config or {}).items()))
    try:
      self._split('eval')[0]
    except (TypeError, ValueError, AssertionError) as e:
      raise ValueError(f'{field}: reasoning-gym dataset {dataset!r} refuses config '
                       f'{dict(self._config)}: {e}') from None
    del reasoning_gym

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
