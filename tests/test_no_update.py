"""A run whose agent gets no update says so, with the reason and the fix: at start where
the config makes it certain, during the run once it has waited, and in the end table."""

import functools
import json
import os

import ml_collections
import pytest

from flexmarl import orchestrator
from flexmarl.config import agent_config, rollout_config
from flexmarl.metrics.no_update import UpdateWatch, start_warnings
from flexmarl.run import train


def test_a_verifier_whose_batch_never_fills_is_named_at_start_during_the_run_and_at_the_end(
    tmp_path, monkeypatch):
  # Two queries a step: the solver gets 2 rows a query (its batch of 4 fills every step),
  # the verifier 4 (2 answers × 2 verdicts), 24 in 3 steps against its batch of 64.
  monkeypatch.setattr(orchestrator, 'UpdateWatch', functools.partial(UpdateWatch, patience=2))
  c = ml_collections.ConfigDict()
  c.seed, c.steps, c.schedule, c.tokenizer = 0, 3, 'flexmarl', 'char'
  c.max_prompt_len, c.checkpoint_every = 10, 3
  c.workflow = dict(name='solver_verifier', solver='solver', verifier='verifier', family='add',
                    task_args={'max_operand': 4})
  c.rollout = rollout_config(query_concurrency=2, max_step_queries=2)
  sampling = dict(temperature=1.0, top_p=1.0, max_new_tokens=2)
  c.agents = dict(solver=agent_config('tiny', group_size=2, global_batch=4, micro_batch=4,
                                      sampling=sampling),
                  verifier=agent_config('tiny', group_size=2, global_batch=64, micro_batch=16,
                                        sampling=sampling))
  logged = []
  summary = train(c, str(tmp_path), log=logged.append)
  text = '\n'.join(map(str, logged))
  assert ("warning: agent 'verifier' will not train in this run: 3 steps × "
          'rollout.max_step_queries=2 queries × at most 4 rows a query') in text
  assert 'global_batch=64. Fix: raise rollout.max_step_queries' in text
  during = [l for l in logged if 'has had no update' in str(l) and str(l).startswith('warning')]
  assert len(during) == 1 and during[0].startswith("warning: step 2: agent 'verifier' has had "
                                                   'no update in 2 steps: 16 rows wait')
  assert summary['agents']['solver']['updates'] == 3 and 'no_update' not in summary['agents'][
      'solver']
  reason = summary['agents']['verifier']['no_update']
  assert reason.startswith("agent 'verifier' has had no update in 3 steps: 24 rows wait for its "
                           'global_batch=64 (about 8.0 a step')
  assert f'  {reason}' in logged[-1]  # the end table
  with open(os.path.join(tmp_path, 'summary.json'), encoding='utf-8') as f:
    assert json.load(f)['agents']['verifier']['no_update'] == reason


@pytest.mark.quick
def test_start_warnings_count_the_most_rows_a_dry_run_query_gave():
  requests = [('a', 'p', ['q0_0_0', 'q0_0_1']), ('b', 'p', ['q0_1_0']), ('b', 'p', ['q0_2_0']),
              ('a', 'p', ['q1_0_0', 'q1_0_1']), ('b', 'p', ['q1_1_0'])]
  # b: at most 2 rows a query; 2 steps × 3 queries × 2 = 12.
  assert start_warnings(requests, {'a': 12, 'b': 12}, 2, 3) == []
  lines = start_warnings(requests, {'a': 13, 'b': 13}, 2, 3)
  assert [l.split(':')[0] for l in lines] == ["agent 'a' will not train in this run",
                                              "agent 'b' will not train in this run"]
  assert '= 12 rows, fewer than its global_batch=13' in lines[1]


def test_the_watch_warns_once_a_wait_and_again_after_an_update():
  watch = UpdateWatch({'a': 8}, max_step_queries=4, patience=2)
  waiting = {'a': {'updated': 0, 'rows': 2}}
  assert watch.end_step(1, waiting) == []
  assert len(watch.end_step(2, waiting)) == 1
  assert watch.end_step(3, waiting) == []  # once a wait
  assert watch.end_step(4, {'a': {'updated': 1, 'rows': 8}}) == []
  assert watch.end_step(5, {'a': {'updated': 0, 'buffered_rows': 3}}) == []
  assert 'no update in 2 steps: 3 rows wait' in watch.end_step(6, {'a': {'updated': 0,
                                                                        'buffered_rows': 3}})[0]
  # An agent without rows is the starvation watch's to report.
  starved = UpdateWatch({'a': 8}, max_step_queries=4, patience=1)
  assert starved.end_step(1, {'a': {'updated': 0, 'rows': 0}}) == []
