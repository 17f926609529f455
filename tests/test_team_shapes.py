"""The robustness suite's debate, chain and router_six shapes: valid workflows, tasks that
no constant answer solves, and configs that train end to end."""

import asyncio
import collections
import importlib
import string
from collections.abc import Callable, Mapping

import jax
import numpy as np
import pytest

from experiments import chain_team, debate_team
from experiments.benchmarks import robustness
from flexmarl import run
from flexmarl.config import build_team_spec, check_prompt_lengths
from flexmarl.metrics.writer import read_metrics
from flexmarl.models.tokenizer import build_char_tokenizer
from flexmarl.workflows import build_workflow
from flexmarl.workflows.base import Completion, Query
from flexmarl.workflows.checks import check_workflow

SHAPES = ['debate', 'chain', 'router_six', 'planner_outcome', 'claim_checker', 'sort3']
QUERIES = 300
Answers = Mapping[str, Callable[[str], str]]  # agent -> its answer to a prompt


def _config(name: str, arg: str = ''):
  return importlib.import_module(f'experiments.{name}').get_config(arg)


class _Answering:
  """An agent that answers every prompt with `answer(prompt)`; records who served what
  (and, given a list, the prompts in the order they came)."""

  def __init__(self, name: str, answer: Callable[[str], str], query_id: str,
               owners: dict[str, str], prompts: list | None = None):
    self.name, self.answer, self.query_id, self.owners = name, answer, query_id, owners
    self.prompts = [] if prompts is None else prompts

  async def generate(self, prompt: str, n: int | None = None, **_) -> list[Completion]:
    self.prompts.append(prompt)
    first = len(self.owners)  # sample ids unique within the query
    out = [Completion(f'{self.query_id}_{first + j}', self.name, self.answer(prompt), 0)
           for j in range(n or 4)]
    self.owners.update({c.sample_id: self.name for c in out})
    return out


def _exact_rates(workflow, answers: Callable[[Query], Answers]
                 ) -> tuple[dict[str, float], list[float]]:
  """Run `workflow` on QUERIES queries with agents answering as `answers(query)` says;
  returns each agent's exact-match rate and every reward given."""
  right, total, rewards = collections.Counter(), collections.Counter(), []

  async def all_queries() -> None:
    for i in range(QUERIES):
      query = workflow.make_query(np.random.default_rng([7, i]), f'q{i}')
      owners: dict[str, str] = {}
      agents = {name: _Answering(name, fn, query.query_id, owners)
                for name, fn in answers(query).items()}
      episode = await workflow.run(query, agents)
      assert set(episode.rewards) == set(owners)  # every served sample scored
      for sid, correct in episode.correct.items():
        right[owners[sid]] += correct
        total[owners[sid]] += 1
      rewards.extend(episode.rewards.values())
  asyncio.run(all_queries())
  return {a: right[a] / total[a] for a in total}, rewards


def _debate_truth(query: Query) -> Answers:
  return {'a': lambda p: query.answer, 'b': lambda p: query.answer}


def _chain_truth(query: Query) -> Answers:
  del query  # each agent's right answer follows from its own prompt
  return {'adder': lambda p: str(sum(map(int, p[:-1].split('+')))),  # '3+2=' -> '5'
          'flipper': lambda p: str(8 - int(p[1:-1])),  # '-5=' -> '3'
          'speller': lambda p: string.ascii_lowercase[int(p[:-1])]}  # '3>' -> 'd'


def _router_truth(workflow) -> Callable[[Query], Answers]:
  def answers(query: Query) -> Answers:
    out = {agent: (lambda p: query.answer) for agent in workflow.specialists.values()}
    out[workflow.router] = lambda p: str(workflow.families.index(query.family))
    return out
  return answers


@pytest.mark.quick
def test_the_docstring_examples():
  """The worked examples in the workflows' docstrings, by hand."""
  owners: dict[str, str] = {}
  prompts: list[str] = []

  def agent(name: str, answer: str) -> _Answering:
    return _Answering(name, lambda p: answer, 'q', owners, prompts)
  chain = chain_team.Chain()
  query = Query('q', '3+2', answer='d', meta={'sum': 5})
  episode = asyncio.run(chain.run(query, {'adder': agent('adder', '5'),
                                          'flipper': agent('flipper', '3'),
                                          'speller': agent('speller', 'd')}))
  assert prompts == ['3+2=', '-5=', '3>'] and all(episode.correct.values())
  prompts.clear()
  episode = asyncio.run(debate_team.Debate().run(Query('q', '3+1', answer='4'), {
      'a': agent('a', '4'), 'b': agent('b', '5')}))
  assert prompts == ['3+1=', '3+1|4=', '3+1|4|5=', '3+1|4|5|4=']
  assert collections.Counter(episode.correct.values()) == {True: 8, False: 8}


def test_an_agent_without_a_valid_answer_passes_on_the_truth():
  """Until an agent answers validly, the next one gets the true value (nobody waits)."""
  owners: dict[str, str] = {}
  prompts: list[str] = []

  def agent(name: str, answer: str) -> _Answering:
    return _Answering(name, lambda p: answer, 'q', owners, prompts)
  query = Query('q', '3+2', answer='d', meta={'sum': 5})
  asyncio.run(chain_team.Chain().run(query, {'adder': agent('adder', '9'),  # not in 0..8
                                             'flipper': agent('flipper', ''),
                                             'speller': agent('speller', 'x')}))
  assert prompts == ['3+2=', '-5=', '3>']
  prompts.clear()
  asyncio.run(debate_team.Debate().run(Query('q', '3+1', answer='4'), {
      'a': agent('a', ''), 'b': agent('b', 'no')}))
  assert prompts == ['3+1=', '3+1|4=', '3+1|4|4=', '3+1|4|4|4=']


@pytest.mark.parametrize('name', SHAPES)
@pytest.mark.parametrize('arg', ['', 'runlocal'])
def test_passes_the_workflow_checks(name, arg):
  config = _config(name, arg)
  workflow = build_workflow(config.workflow)
  tokenizer = build_char_tokenizer()
  spec = build_team_spec(config, tokenizer.vocab_size, [d.id for d in jax.devices()],
                         workflow.agent_names())
  requests = check_workflow(workflow, {n: a.group_size for n, a in spec.agents.items()}, 0)
  check_prompt_lengths(requests, tokenizer, spec.max_prompt_len)


@pytest.mark.parametrize('name,truth,constants', [
    ('debate', _debate_truth, string.digits),
    ('chain', _chain_truth, string.digits + string.ascii_lowercase[:9]),
])
def test_true_answers_score_1_and_no_constant_answer_reaches_the_best_constant(
    name, truth, constants):
  workflow = build_workflow(_config(name).workflow)
  rates, rewards = _exact_rates(workflow, truth)
  assert set(rates) == set(workflow.agent_names())
  assert all(r == 1.0 for r in rates.values()) and set(rewards) == {1.0}
  best = robustness.best_constants(_config(name))
  assert set(best) == set(workflow.agent_names()) and max(best.values()) < 0.5
  for agent in workflow.agent_names():
    # `agent` answers a constant; the others answer right (the best constant's setting).
    found = max(_exact_rates(workflow, lambda q, a=agent, c=c: {**truth(q), a: lambda p: c}
                             )[0][agent] for c in constants)
    assert found == pytest.approx(best[agent], abs=0.06), (agent, found, best[agent])


def test_router_six_routes_a_tenth_of_the_queries_to_the_rarest_and_beats_constants():
  config = _config('router_six')
  workflow = build_workflow(config.workflow)
  assert len(workflow.specialists) == 6
  assert workflow.probs[-1] == pytest.approx(0.1, abs=0.005)
  rates, rewards = _exact_rates(workflow, _router_truth(workflow))
  assert set(rates) == set(workflow.agent_names())
  assert all(r == 1.0 for r in rates.values()) and set(rewards) == {1.0}
  best = robustness.best_constants(config)
  assert set(best) == set(workflow.agent_names()) and max(best.values()) < 0.5
  # A router naming one specialist always is right on that family's share of queries.
  truth = _router_truth(workflow)
  found = [_exact_rates(workflow, lambda q, i=i: {**truth(q), 'router': lambda p: str(i)}
                        )[0]['router'] for i in range(6)]
  np.testing.assert_allclose(found, workflow.probs, atol=0.05)
  assert max(found) == pytest.approx(best['router'], abs=0.05)


# router_six is the default experiment's workflow with six specialists: its config and
# dry run are checked above, and that workflow trains in every test of the default
# experiment; seven agents compiled here again would cost two minutes of the suite.
@pytest.mark.parametrize('name', ['debate', 'chain'])
def test_runlocal_trains_every_agent(name, tmp_path):
  config = _config(name, 'runlocal')
  config.steps = config.checkpoint_every = 2
  config.rollout.devices = 'shared'  # fewest devices and compiles
  run.train(config, str(tmp_path), log=lambda *_: None, experiment=f'experiments/{name}.py')
  lines = read_metrics(str(tmp_path / 'metrics.jsonl'))
  updated = collections.Counter(l['agent'] for l in lines if l.get('updated'))
  agents = build_workflow(config.workflow).agent_names()
  assert {a: updated[a] for a in agents} == dict.fromkeys(agents, 2)
  assert all(np.isfinite(l['entropy']) for l in lines if l['agent'] in agents and l.get('updated'))


def test_the_suite_fails_a_constant_verifier_and_passes_a_skilled_one(tmp_path):
  """A verifier that always says 'y' is right as often as 'y' is the truth (0.94 here):
  above 0.9, yet no skill; the suite's verdict reads its run's best constant and fails
  it. One right 0.97 of the time on calls that are 'y' half the time passes."""
  import json
  lines = []
  for step in range(1, 101):
    lines.append(dict(step=step, agent='verifier', updated=1, accuracy=0.94, zero_spread=1.0,
                      entropy=0.01, best_constant=0.94, above_constant=0.0,
                      balanced_accuracy=0.5))
    lines.append(dict(step=step, agent='solver', updated=1, accuracy=0.97, zero_spread=0.1,
                      entropy=0.5, best_constant=0.5, above_constant=0.47,
                      balanced_accuracy=0.97))
  (tmp_path / 'metrics.jsonl').write_text('\n'.join(json.dumps(l) for l in lines))
  result = robustness.report(str(tmp_path), {})
  assert result['verifier']['end_accuracy'] == pytest.approx(0.94)
  assert result['verifier']['verdict'] != 'pass' and result['solver']['verdict'] == 'pass'
  assert robustness.verdict(dict(end_above_constant=-0.1)) == 'below constant'
  # A y/n judge that sees right answers 3 times in 4: accuracy can be at most 0.25 above
  # its constant; its balanced accuracy 0.9 is 0.4 above a constant's 0.5: a pass.
  assert robustness.verdict(dict(end_above_constant=0.2, end_balanced_above=0.4)) == 'pass'
  assert robustness.verdict(dict(end_above_constant=0.0, end_balanced_above=0.0)) == 'weak'
  # One answer right on every call (the solver always right): nothing is above it.
  assert robustness.verdict(dict(end_best_constant=1.0, end_accuracy=1.0,
                                 end_above_constant=0.0)) == 'no room'
  assert robustness.verdict(dict(end_best_constant=1.0, end_accuracy=0.9,
                                 end_above_constant=-0.1)) == 'below constant'
