"""Environments that check a proposed answer and say what is wrong with it: the
environment side of a team working in turns (flexmarl/workflows/tool_turns.py).

Each checker takes a reasoning-gym entry (question, answer, metadata) and an answer's
text, and gives a `Check`: how much of the problem the answer gets right (a score in
[0, 1], 1.0 only when it is solved) and what is wrong, in words the next turn's prompt
carries (environment text: prompt, never trained on). Pure functions of their input.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

MOVES = {'up': (-1, 0), 'down': (1, 0), 'left': (0, -1), 'right': (0, 1)}


@dataclasses.dataclass(frozen=True)
class Check:
  score: float  # in [0, 1]; 1.0: solved
  feedback: str  # what is wrong ('' when solved)

  @property
  def solved(self) -> bool:
    return self.score >= 1.0


def sudoku(entry: Mapping[str, Any], text: str) -> Check:
  """A proposed Sudoku grid (`mini_sudoku`: rows of numbers separated by spaces). Score:
  the share of the puzzle's empty cells filled as the solution has them (1.0 with every
  rule kept); feedback: the givens changed, the rows, columns and boxes that repeat a
  number."""
  puzzle, solution = entry['metadata']['puzzle'], entry['metadata']['solution']
  n = len(puzzle)
  grid = _grid(text, n)
  if grid is None:
    return Check(0.0, f'Give the whole grid: {n} rows of {n} numbers from 1 to {n}, '
                      'separated by spaces, one row a line.')
  problems = [f'row {r + 1} column {c + 1} is given as {puzzle[r][c]}'
              for r in range(n) for c in range(n) if puzzle[r][c] and grid[r][c] != puzzle[r][c]]
  side = int(round(n ** 0.5))
  units = ([(f'row {r + 1}', [grid[r][c] for c in range(n)]) for r in range(n)]
           + [(f'column {c + 1}', [grid[r][c] for r in range(n)]) for c in range(n)]
           + [(f'box {b + 1}', [grid[r][c] for r in range(b // side * side, b // side * side + side)
                                for c in range(b % side * side, b % side * side + side)])
              for b in range(n)])
  for name, values in units:
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
      problems.append(f'{name} repeats {" and ".join(map(str, repeated))}')
  empty = [(r, c) for r in range(n) for c in range(n) if not puzzle[r][c]]
  right = sum(grid[r][c] == solution[r][c] for r, c in empty)
  if not problems and right == len(empty):
    return Check(1.0, '')
  return Check(min(right / max(len(empty), 1), 0.9), '; '.join(problems) or
               'the grid keeps the rules but is not the solution')


def _grid(text: str, n: int) -> list[list[int]] | None:
  """The first n lines of n numbers 1..n in `text`, or None."""
  rows = []
  for line in text.splitlines():
    values = re.findall(r'\d', line)
    if len(values) == n and all(1 <= int(v) <= n for v in values):
      rows.append([int(v) for v in values])
  return rows[:n] if len(rows) >= n else None


def shortest_path(entry: Mapping[str, Any], text: str) -> Check:
  """A proposed path (`shortest_path`: directions up/down/left/right, or 'infeasible').
  Score: 1.0 for a shortest path, 0.5 for a longer one that arrives, else the share of
  the way covered before the path goes wrong; feedback: where it leaves the grid or
  runs into a blocked cell, or where it stops short."""
  matrix = entry['metadata']['matrix']
  shortest = entry['metadata']['solution'] or []  # no moves: no path exists
  feasible = bool(shortest)
  words = re.findall(r'[a-z]+', text.lower())
  if 'infeasible' in words:
    return (Check(1.0, '') if not feasible else
            Check(0.0, 'a path exists: give it as directions (up, down, left, right)'))
  moves = [w for w in words if w in MOVES]
  if not feasible:
    return Check(0.0, 'no path reaches the destination: say infeasible')
  if not moves:
    return Check(0.0, 'give the path as directions: up, down, left, right')
  start, goal = (_find(matrix, mark) for mark in '*#')
  r, c = start
  for k, move in enumerate(moves):
    dr, dc = MOVES[move]
    nr, nc = r + dr, c + dc
    where = f'move {k + 1} ({move}) from row {r + 1}, column {c + 1}'
    if not (0 <= nr < len(matrix) and 0 <= nc < len(matrix[0])):
      return Check(0.4 * _progress(start, (r, c), goal), f'{where} leaves the grid')
    if matrix[nr][nc] == 'X':
      return Check(0.4 * _progress(start, (r, c), goal), f'{where} runs into a blocked cell')
    r, c = nr, nc
    if (r, c) == goal:
      if k + 1 < len(moves):
        return Check(0.5, f'the path reaches the destination after {k + 1} moves; '
                          f'stop there ({len(moves) - k - 1} more moves follow)')
      break
  if (r, c) != goal:
    return Check(0.4 * _progress(start, (r, c), goal),
                 f'the path ends at row {r + 1}, column {c + 1}; the destination is at row '
                 f'{goal[0] + 1}, column {goal[1] + 1}')
  if len(moves) > len(shortest):
    return Check(0.5, f'the path arrives in {len(moves)} moves; a shorter one takes '
                      f'{len(shortest)}')
  return Check(1.0, '')


def _find(matrix: Sequence[Sequence[str]], mark: str) -> tuple[int, int]:
  return next((r, c) for r, row in enumerate(matrix) for c, v in enumerate(row) if v == mark)


def _progress(start: tuple[int, int], at: tuple[int, int], goal: tuple[int, int]) -> float:
  """How much closer to the goal `at` is than `start`, in grid steps (0 to 1)."""
  far = abs(start[0] - goal[0]) + abs(start[1] - goal[1])
  left = abs(at[0] - goal[0]) + abs(at[1] - goal[1])
  return max(0.0, (far - left) / far) if far else 0.0


CHECKERS: dict[str, Callable[[Mapping[str, Any], str], Check]] = {
    'mini_sudoku': sudoku, 'shortest_path': shortest_path}
