"""RolloutEngine: batching of concurrent workflows, served groups, workflow checks."""

import asyncio
import concurrent.futures

import numpy as np
import pytest

from flexmarl.models.tokenizer import build_char_tokenizer
from flexmarl.rollout.engine import RolloutEngine
from flexmarl.rollout.pool import Instance, InstancePool
from flexmarl.rollout.sampler import SampleBatch, SamplingParams
from flexmarl.workflows.base import Episode, Query
from flexmarl.workflows.checks import WorkflowError

TOK = build_char_tokenizer()


class EchoSampler:
  """Answers each prompt with its last character; records the batches it got."""

  def __init__(self):
    self.version, self.calls = 0, []

  def submit(self, prompts, keys, params, limits=None):
    self.calls.append(len(prompts))
    tokens = np.array([[p[-1], TOK.eos_id] for p in prompts], np.int32)
    done = concurrent.futures.Future()
    done.set_result(SampleBatch(tokens, np.full(tokens.shape, -0.5, np.float32),
                                np.full(len(prompts), 2)))
    return done

  def update_weights(self, state, version):
    self.version = version

  def close(self):
    pass


def pools_of(samplers):
  return {a: InstancePool(a, [Instance(f'{a}/0', (0,), s)], make_sampler=None)
          for a, s in samplers.items()}


class Fanout:
  """a answers; two b branches then check it concurrently."""

  def __init__(self, score_all=True, invent=False):
    self.score_all, self.invent = score_all, invent

  def agent_names(self):
    return ['a', 'b']

  def make_query(self, rng, query_id):
    return Query(query_id, str(rng.integers(10)))

  async def run(self, query, agents):
    ep = Episode()
    [ans] = await agents['a'].generate(query.prompt + '=', n=1)
    ep.score(ans, 1.0, correct=ans.text == query.prompt[-1])
    checks = await asyncio.gather(agents['b'].generate(ans.text + 'x'),
                                  agents['b'].generate(ans.text + 'y'))
    for group in checks:
      for c in group[: None if self.score_all else 1]:
        ep.score(c, 0.5)
    if self.invent:
      ep.rewards[f'{query.query_id}_9_0'] = 1.0
    return ep


def _engine():
  samplers = {'a': EchoSampler(), 'b': EchoSampler()}
  sp = SamplingParams(max_new_tokens=2)
  return RolloutEngine(pools_of(samplers), {'a': sp, 'b': sp}, {'a': 4, 'b': 3}, TOK,
                       seed=0), samplers


def _queries(n):
  return [Query(f'q{i}', str(i % 10)) for i in range(n)]


@pytest.mark.quick
def test_requests_waiting_together_are_batched_and_recorded():
  engine, samplers = _engine()
  results = engine.run(Fanout(), _queries(5))
  # The five `a` requests wait together: one batch; then all ten `b` branches: one.
  assert samplers['a'].calls == [5]
  assert samplers['b'].calls == [5 * 2 * 3]
  for res in results:
    assert [g.call for g in res.served] == [0, 1, 2]
    assert [g.agent for g in res.served] == ['a', 'b', 'b']
    assert res.served[1].sample_ids == [f'{res.query.query_id}_1_{j}' for j in range(3)]
    assert res.episode.rewards[f'{res.query.query_id}_0_0'] == 1.0
    assert res.served[0].tokens[0].tolist() == [TOK.encode('=')[-1], TOK.eos_id]


def test_unscored_or_invented_samples_are_errors():
  engine, _ = _engine()
  with pytest.raises(ValueError, match='without a reward'):
    engine.run(Fanout(score_all=False), _queries(2))
  with pytest.raises(ValueError, match='never served'):
    engine.run(Fanout(invent=True), _queries(2))


def test_unknown_agent_is_an_error():
  class Bad(Fanout):
    async def run(self, query, agents):
      return await agents['nobody'].generate('x')
  engine, _ = _engine()
  with pytest.raises(WorkflowError, match="q0: .*KeyError: 'nobody'"):
    engine.run(Bad(), _queries(1))


def test_runs_inside_a_running_event_loop():
  engine, _ = _engine()

  async def from_a_notebook():
    return engine.run(Fanout(), _queries(2))
  assert len(asyncio.run(from_a_notebook())) == 2
