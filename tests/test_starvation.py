"""An agent that gets no work is named, with the agent upstream that stopped sending it,
and the rest of the team trains on, each step ending on its query budget."""

import functools
import os

import ml_collections
import pytest

from flexmarl import orchestrator
from flexmarl import tasks
from flexmarl.config import agent_config, rollout_config
from flexmarl.metrics.starvation import StarvationWatch
from flexmarl.metrics.writer import TEAM, read_metrics
from flexmarl.run import train
from flexmarl.workflows.base import Episode, Query


class RouterSkipsOne:
  """A router whose every query goes to 'busy': the 'idle' specialist is never called."""

  def agent_names(self):
    return ['router', 'busy', 'idle']

  def make_query(self, rng, query_id):
    task = tasks.FAMILIES['add'](rng, max_operand=2)
    return Query(query_id, task.prompt, task.answer, 'add')

  async def run(self, query, agents):
    episode = Episode()
    for route in await agents['router'].generate(f'{query.prompt}?'):
      episode.score(route, float(route.text == '0'), correct=route.text == '0')
    for answer in await agents['busy'].generate(f'{query.prompt}='):
      episode.score(answer, tasks.partial_credit(answer.text, query.answer),
                    correct=answer.text == query.answer)
    return episode


def test_a_specialist_the_router_never_calls_is_named_with_its_router(tmp_path, monkeypatch):
  monkeypatch.setattr(orchestrator, 'StarvationWatch',
                      functools.partial(StarvationWatch, patience=3))
  c = ml_collections.ConfigDict()
  c.seed, c.steps, c.schedule, c.tokenizer = 0, 4, 'sync', 'char'
  c.max_prompt_len, c.checkpoint_every = 8, 4
  c.workflow = dict(name='test_starvation:RouterSkipsOne')
  c.rollout = rollout_config(query_concurrency=4, max_step_queries=4)
  sampling = dict(temperature=1.0, top_p=1.0, max_new_tokens=2)
  c.agents = {name: agent_config('tiny', group_size=2, global_batch=8, micro_batch=8,
                                 sampling=sampling) for name in ('router', 'busy', 'idle')}
  logged = []
  train(c, str(tmp_path), log=logged.append)
  warnings = [l for l in logged if 'got no rows' in str(l)]
  assert len(warnings) == 1, logged  # once, at the patience
  assert warnings[0].startswith('warning: step 3: agent \'idle\'')
  assert "no query has called it yet; the queries start at 'router' (12 queries)" in warnings[0]
  assert 'rollout.max_step_queries=4' in warnings[0]
  lines = read_metrics(os.path.join(tmp_path, 'metrics.jsonl'))
  team = [l for l in lines if l['agent'] == TEAM]
  assert [l['queries'] for l in team] == [4] * 4  # every step ends on its budget
  updated = {a: sum(l['updated'] for l in lines if l['agent'] == a) for a in ('router', 'busy')}
  assert updated == {'router': 4, 'busy': 4}  # the others train every step
  assert not any(l['updated'] for l in lines if l['agent'] == 'idle')


@pytest.mark.quick
def test_the_warning_names_the_agent_called_before_it_when_it_was_fed_before():
  watch = StarvationWatch(['router', 'adder', 'sorter'], max_step_queries=96, patience=2)
  watch.served({'router': 0, 'adder': 1})
  watch.served({'router': 0, 'sorter': 1})
  assert watch.end_step(1) == []
  said = {}
  for step in (2, 3, 4):  # the router drifted: it routes everything to the sorter
    for _ in range(5):
      watch.served({'router': 0, 'sorter': 1})
    said[step] = watch.end_step(step)
  assert said[2] == said[4] == [] and len(said[3]) == 1
  assert said[3][0].startswith("step 3: agent 'adder' has got no rows for 2 steps")
  assert "before it in the last query that reached it, 'router' (10 queries)" in said[3][0]


def test_it_warns_again_only_after_the_agent_got_rows_and_starved_anew():
  watch = StarvationWatch(['a', 'b'], max_step_queries=4, patience=1)
  assert [w[:17] for w in watch.end_step(1)] == ["step 1: agent 'a'", "step 1: agent 'b'"]
  assert watch.end_step(2) == []  # still starving: said already
  watch.served({'a': 0, 'b': 1})
  assert watch.end_step(3) == []
  watch.served({'a': 0})
  (warning,) = watch.end_step(4)
  assert warning.startswith("step 4: agent 'b'") and "'a' (1 queries)" in warning
