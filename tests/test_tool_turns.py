"""A reasoner and a tool agent in turns (flexmarl/workflows/tool_turns.py): the
environment's checks (flexmarl/tasks/checkers.py) and how an attempt's turns follow
them."""

import asyncio

import pytest

pytest.importorskip('reasoning_gym', reason='tool_turns runs on reasoning-gym puzzles '
                                            '(requirements-real.txt)')

from flexmarl.tasks import checkers
from flexmarl.workflows.base import Completion, Query
from flexmarl.workflows.tool_turns import ToolTurns

SOLVED = [[1, 2, 3, 4], [3, 4, 1, 2], [2, 1, 4, 3], [4, 3, 2, 1]]
SUDOKU = {'metadata': {'puzzle': [[1, 0, 0, 4], [0, 4, 1, 0], [2, 0, 0, 3], [0, 3, 2, 0]],
                       'solution': SOLVED}}
# * O X
# O O O
# X # O
PATH = {'metadata': {'matrix': [['*', 'O', 'X'], ['O', 'O', 'O'], ['X', '#', 'O']],
                     'solution': ['down', 'right', 'down']}}


def _text(grid):
  return '\n'.join(' '.join(map(str, row)) for row in grid)


@pytest.mark.quick
def test_the_sudoku_check_names_what_is_wrong():
  assert checkers.sudoku(SUDOKU, _text(SOLVED)) == checkers.Check(1.0, '')
  wrong = [row[:] for row in SOLVED]
  wrong[0][0] = 2  # a given changed, and row 1 and column 1 and box 1 repeat a 2
  check = checkers.sudoku(SUDOKU, _text(wrong))
  assert 'row 1 column 1 is given as 1' in check.feedback
  assert 'row 1 repeats 2' in check.feedback and 'box 1 repeats 2' in check.feedback
  assert check.score == 0.9 and not check.solved  # every empty cell right, a given not
  swapped = [row[:] for row in SOLVED]
  swapped[0][1], swapped[0][2] = 3, 2  # two empty cells swapped: columns 2 and 3 repeat
  check = checkers.sudoku(SUDOKU, 'Here it is:\n' + _text(swapped))
  assert check.score == pytest.approx(6 / 8) and 'column 2 repeats 3' in check.feedback
  assert checkers.sudoku(SUDOKU, '1 2 3').score == 0.0


@pytest.mark.quick
@pytest.mark.parametrize('path, score, says', [
    ('down right down', 1.0, ''),
    ('right down down', 1.0, ''),  # another shortest path
    ('down right right down left', 0.5, 'a shorter one takes 3'),
    ('down right down left', 0.5, 'stop there'),
    ('right right', 0.4 / 3, 'move 2 (right) from row 1, column 2 runs into a blocked cell'),
    ('up', 0.0, 'leaves the grid'),
    ('down right', 0.4 * 2 / 3, 'the path ends at row 2, column 2'),
    ('infeasible', 0.0, 'a path exists'),
    ('I do not know', 0.0, 'give the path as directions'),
])
def test_the_path_check_says_where_a_path_goes_wrong(path, score, says):
  check = checkers.shortest_path(PATH, path)
  assert check.score == pytest.approx(score) and says in check.feedback
  no_path = {'metadata': {**PATH['metadata'], 'solution': []}}
  assert checkers.shortest_path(no_path, 'infeasible').solved


class Scripted:
  """An agent that answers from a script, keeping the prompts it was given."""

  def __init__(self, name, answers):
    self.name, self.answers, self.prompts = name, list(answers), []

  async def generate(self, prompt, n=1):
    self.prompts.append(prompt)
    return [Completion(f'{self.name}{len(self.prompts)}_{j}', self.name, self.answers.pop(0), 0)
            for j in range(n)]


def _workflow(turns=4, branch=0):
  workflow = ToolTurns(dataset='mini_sudoku', turns=turns, attempts=1, branch=branch, held_out=2)
  workflow._entries[('train', 0)] = SUDOKU  # the puzzle above in place of a drawn one
  return workflow, Query('q0', 'Solve this puzzle.', _text(SOLVED), 'mini_sudoku',
                         {'split': 'train', 'index': 0})


def test_the_tool_corrects_with_the_check_and_the_reasoner_sees_the_exchange():
  wrong = [row[:] for row in SOLVED]
  wrong[1][0] = 4  # row 2 and column 1 repeat a 4
  reasoner = Scripted('reasoner', [_text(wrong), _text(SOLVED)])
  tool = Scripted('tool', [_text(wrong)])
  workflow, query = _workflow()
  episode = asyncio.run(workflow.run(query, {'reasoner': reasoner, 'tool': tool}))
  # The reasoner, the tool (its correction still wrong), the reasoner (right): the
  # attempt stops at the solved answer, before the limit of four.
  assert len(reasoner.prompts) == 2 and len(tool.prompts) == 1
  assert 'row 2 repeats 4' in tool.prompts[0][0]['content']
  second = reasoner.prompts[1]
  assert second[1]['role'] == 'assistant' and isinstance(second[1]['content'], Completion)
  assert 'A tool proposed' in second[2]['content'] and 'row 2 repeats 4' in second[2]['content']
  assert episode.outcomes == {0: 1.0}
  assert sorted(episode.rewards.values()) == [pytest.approx(7 / 8)] * 2 + [1.0]


def test_an_attempt_stops_at_the_turn_limit_with_its_last_answer_as_outcome():
  reasoner = Scripted('reasoner', ['no grid', 'no grid'])
  tool = Scripted('tool', ['still none'])
  workflow, query = _workflow(turns=3)
  episode = asyncio.run(workflow.run(query, {'reasoner': reasoner, 'tool': tool}))
  assert (len(reasoner.prompts), len(tool.prompts)) == (2, 1)
  assert episode.outcomes == {0: 0.0} and len(episode.rewards) == 3


def test_bad_fields_are_refused_with_the_fix():
  with pytest.raises(ValueError, match="workflow.dataset='maze'.*checkers.py"):
    ToolTurns(dataset='maze')
  with pytest.raises(ValueError, match='workflow.turns=0'):
    ToolTurns(turns=0)
