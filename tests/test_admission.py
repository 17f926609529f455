"""Admission by demand (flexmarl/rollout/admission.py): a step starts a query only while a
batch still takes its rows, and what it trains on stays a function of the stream alone."""

import asyncio
import os

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest

from flexmarl import tasks
from flexmarl.config import agent_config, rollout_config
from flexmarl.metrics.writer import read_metrics
from flexmarl.rollout.admission import Admission, Decision, Verdict
from flexmarl.run import train
from flexmarl.workflows.base import Episode, Query
from flexmarl.workflows.checks import WorkflowError, check_workflow

STEPS = 3
OWNERS = {'add': 'adder', 'double': 'doubler'}


class OwnerRouted:
  """A router labels a query's family; the family's owner answers it. The two calls are
  independent and declared, as in chat_router's owner-routed training problems."""

  def __init__(self, declare: dict | None = None):
    self.declare = declare  # a wrong declaration, for the dry run's check

  def agent_names(self):
    return ['router', *OWNERS.values()]

  def make_query(self, rng, query_id):
    task = tasks.FAMILIES[list(OWNERS)[int(rng.integers(2))]](rng)
    return Query(query_id, task.prompt, task.answer, task.family)

  def demand(self, query):
    return self.declare or {'router': 1, OWNERS[query.family]: 1}

  async def run(self, query, agents):
    episode = Episode()
    owner = OWNERS[query.family]

    async def route():
      for c in await agents['router'].generate(f'{query.prompt}?'):
        episode.score(c, tasks.partial_credit(c.text, query.family[0]))

    async def solve():
      for c in await agents[owner].generate(query.prompt):
        episode.score(c, tasks.partial_credit(c.text, query.answer))

    await asyncio.gather(*[call() for call, agent in ((route, 'router'), (solve, owner))
                           if agents[agent].wanted])
    return episode


def _config(schedule: str, concurrency: int) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed, c.steps, c.schedule, c.tokenizer = 0, STEPS, schedule, 'char'
  c.max_prompt_len, c.checkpoint_every = 8, STEPS
  # Without admission the first `concurrency` queries all run, and each step's batches
  # (4 router calls, 2 calls of each owner) fill before most of them are consumed.
  c.rollout = rollout_config(query_concurrency=concurrency, max_step_queries=64)
  # Replayed answers are trained but were not sampled this step: off, to count exactly.
  grpo = dict(entropy_coef=0.0, self_imitation=0.0)
  sampling = dict(temperature=1.0, top_p=1.0, max_new_tokens=2)
  c.agents = dict(
      router=agent_config('tiny', group_size=2, global_batch=8, micro_batch=4,
                          sampling=sampling, grpo=grpo),
      adder=agent_config('tiny', group_size=4, global_batch=8, micro_batch=4,
                         sampling=sampling, grpo=grpo),
      doubler=agent_config('tiny', group_size=4, global_batch=8, micro_batch=4,
                           sampling=sampling, grpo=grpo))
  return c


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  out = {}
  for schedule, concurrency in (('flexmarl', 8), ('sync', 8), ('sync', 1)):
    workdir = str(tmp_path_factory.mktemp(f'{schedule}{concurrency}'))
    summary = train(_config(schedule, concurrency), workdir, OwnerRouted(), log=lambda *_: None)
    out[schedule, concurrency] = workdir, summary
  return out


def _params(workdir, agent):
  path = os.path.abspath(os.path.join(workdir, 'checkpoints', agent, str(STEPS), 'state'))
  return jax.tree.leaves(ocp.StandardCheckpointer().restore(path)['params'])


def test_nothing_sampled_in_vain(runs):
  """Sixteen queries could run at once, but every token sampled is trained on: queries
  no batch takes are skipped, calls no batch takes are left out, none is cut."""
  workdir, summary = runs['flexmarl', 8]
  lines = read_metrics(os.path.join(workdir, 'metrics.jsonl'))
  for agent in ('router', 'adder', 'doubler'):
    mine = [l for l in lines if l['agent'] == agent]
    assert [l['updated'] for l in mine] == [1] * STEPS, agent
    assert all(l.get('surplus_rows', 0) == 0 for l in mine), agent
    s = summary['agents'][agent]
    assert s['generated_tokens'] == s['trained_tokens'] > 0, (agent, s)
    assert s['trained_share'] == 1.0
  team = [l for l in lines if l['agent'] == 'team']
  assert sum(l['skipped_queries'] for l in team) > 0  # the config makes some unneeded
  assert all(l['queries'] > 4 for l in team)


def test_parameters_equal_a_run_that_never_started_them(runs):
  """One query at a time starts none beyond need; sixteen at once, under either
  schedule, train to the same parameters and consume the same queries."""
  reference, _ = runs['sync', 1]
  for key in (('sync', 8), ('flexmarl', 8)):
    workdir, _ = runs[key]
    for agent in ('router', 'adder', 'doubler'):
      for x, y in zip(_params(reference, agent), _params(workdir, agent), strict=True):
        assert np.abs(x - y).max() <= 1e-5, (key, agent)
    queries = lambda w: [(l['queries'], l['skipped_queries'])
                         for l in read_metrics(os.path.join(w, 'metrics.jsonl'))
                         if l['agent'] == 'team']
    assert queries(workdir) == queries(reference), key


@pytest.mark.quick
def test_decisions_follow_the_declared_calls():
  need = {'router': 4, 'a': 4, 'b': 4}
  admission = Admission(lambda: need, {'router': 2, 'a': 4, 'b': 4})
  start = lambda calls, quiet=False: admission.consider(calls, quiet)
  assert start({'router': 1, 'a': 1}).wanted == {'router', 'a'}
  assert start({'router': 1, 'a': 1}).wanted == {'router'}  # a's batch is planned full
  # Nothing it brings is wanted, and b still wants rows: skipped at once.
  assert start({'router': 1, 'a': 1}).decision is Decision.SKIP
  assert start({'router': 1, 'b': 1}).wanted == {'b'}
  # Every batch planned full: held (the step ends once the rows in flight are in).
  assert start({'router': 1, 'b': 1}).decision is Decision.HOLD


@pytest.mark.quick
def test_filtered_agents_are_planned_from_their_exact_need():
  need = {'b': 8}
  admission = Admission(lambda: need, {'b': 4}, filtered=frozenset({'b'}))
  assert admission.consider({'b': 1}, False).wanted == {'b'}
  assert admission.consider({'b': 1}, False).wanted == {'b'}
  assert admission.consider({'b': 1}, False).decision is Decision.HOLD
  need['b'] = 4  # a group was filtered out: one more query's rows are wanted
  assert admission.consider({'b': 1}, True).wanted == {'b'}


@pytest.mark.quick
def test_undeclared_queries_always_run():
  admission = Admission(lambda: {'x': 0}, {'x': 4})
  assert admission.consider(None, False).decision is Decision.START
  assert admission.consider(None, True) == Verdict(Decision.START)  # every agent wanted


@pytest.mark.quick
def test_a_wrong_declaration_is_refused_before_any_work():
  sizes = {'router': 2, 'adder': 4, 'doubler': 4}
  with pytest.raises(WorkflowError, match=r'demand\(query\) declares the calls'):
    check_workflow(OwnerRouted(declare={'router': 1}), sizes)
  with pytest.raises(ValueError, match=r"names agents \['judge'\]"):
    check_workflow(OwnerRouted(declare={'judge': 1}), sizes)
