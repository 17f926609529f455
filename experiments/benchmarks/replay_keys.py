"""What self-imitation's memory key does on the checked puzzles: how often a right answer
kept under one problem's expected answer (`grpo.self_imitation_key='answer'`) would be
replayed into another problem with the same expected answer, and how often it is wrong
there.

  python experiments/benchmarks/replay_keys.py [--puzzles=1000]

For each task of `experiments/tool_team.py` (Sudoku, Plan-Path, and their `easy` forms),
over the first `--puzzles` training problems: the problems that share their expected
answer with another one (where `'answer'` replays across problems at all), and, over
every right answer of such a problem (Sudoku: its one solution; Plan-Path: each of its
shortest paths) and every other problem with the same expected answer, the share the
task's checker does not solve. With `'prompt'` nothing crosses problems: that share is
0 by construction. Prints one JSON line per task. CPU only, seconds.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from experiments import tool_team  # pylint: disable=g-import-not-at-top
from flexmarl.tasks.checkers import CHECKERS, MOVES  # pylint: disable=g-import-not-at-top
from flexmarl.tasks.gym import GymTask  # pylint: disable=g-import-not-at-top


def right_answers(dataset: str, entry: dict) -> list[str]:
  """Every answer the checker solves: Sudoku's solution; Plan-Path's shortest paths."""
  if dataset == 'mini_sudoku' or not entry['metadata']['solution']:
    return [entry['answer']]
  matrix = entry['metadata']['matrix']
  start, goal = ((r, c) for mark in '*#' for r, row in enumerate(matrix)
                 for c, v in enumerate(row) if v == mark)
  paths, length = [], len(entry['metadata']['solution'])

  def walk(at: tuple[int, int], moves: list[str], seen: set) -> None:
    if at == goal:
      paths.append(' '.join(moves))
      return
    if len(moves) == length:
      return
    for name, (dr, dc) in MOVES.items():
      r, c = at[0] + dr, at[1] + dc
      if (0 <= r < len(matrix) and 0 <= c < len(matrix[0]) and matrix[r][c] != 'X'
          and (r, c) not in seen):
        walk((r, c), moves + [name], seen | {(r, c)})

  walk(start, [], {start})
  return paths


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--puzzles', type=int, default=1000)
  args = parser.parse_args()
  for variants in ('sudoku', 'sudoku,easy', 'path', 'path,easy'):
    chosen = tool_team.task_of(set(variants.split(',')))
    dataset = chosen['dataset']
    task, check = GymTask(dataset, chosen['dataset_config'], held_out=0), CHECKERS[dataset]
    entries = [task.entry('train', i) for i in range(args.puzzles)]
    by_answer = collections.defaultdict(list)
    for e in entries:
      by_answer[e['answer']].append(e)
    shared = [e for e in entries if len(by_answer[e['answer']]) > 1]
    replays = wrong = 0
    for a in shared:
      for answer in right_answers(dataset, a):
        for b in by_answer[a['answer']]:
          if b is not a:
            replays += 1
            wrong += not check(b, answer).solved
    print(json.dumps(dict(task=variants, puzzles=len(entries), distinct_answers=len(by_answer),
                          share_with_another=round(len(shared) / len(entries), 3),
                          replays=replays, wrong=wrong,
                          wrong_share=round(wrong / max(replays, 1), 3))), flush=True)


if __name__ == '__main__':
  main()
