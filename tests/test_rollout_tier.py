"""The streaming rollout tier: admission, concurrent instances, routing, balancing."""

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import threading

import jax
import numpy as np
from flax import nnx
import pytest

from flexmarl.core.interfaces import Weights
from flexmarl.models import sharding, transformer
from flexmarl.models.tokenizer import build_char_tokenizer
from flexmarl.rollout import balancer as bal
from flexmarl.rollout.engine import RolloutEngine
from flexmarl.rollout.pool import Instance, InstancePool, Request, least_loaded
from flexmarl.rollout.sampler import EmbeddedSampler, SampleBatch, SamplingParams, sample_key
from flexmarl.workflows.base import Episode, Query

TOK = build_char_tokenizer()
SP = SamplingParams(max_new_tokens=2)


class SlowEcho:
  """Answers each prompt with its last character after `delay_s`, on a thread."""

  def __init__(self, delay_s=0.02):
    self.version, self.delay_s = 0, delay_s

  def submit(self, prompts, keys, params, limits=None):
    future = concurrent.futures.Future()
    tokens = np.array([[p[-1], TOK.eos_id] for p in prompts], np.int32)
    out = SampleBatch(tokens, np.full(tokens.shape, -0.5, np.float32), np.full(len(prompts), 2))
    threading.Timer(self.delay_s, future.set_result, (out,)).start()
    return future

  def update_weights(self, state, version):
    self.version = version

  def close(self):
    pass


class Turns:
  """Query 'long' talks to agent a five times in a row; every other query once."""

  def agent_names(self):
    return ['a']

  async def run(self, query, agents):
    ep = Episode()
    for _ in range(5 if query.prompt == 'long' else 1):
      for c in await agents['a'].generate('x', n=1):
        ep.score(c, 1.0)
    return ep


def _single_pool_engine(concurrency=2):
  pool = InstancePool('a', [Instance('a/0', (0,), SlowEcho())], make_sampler=None)
  return RolloutEngine({'a': pool}, {'a': SP}, {'a': 1}, TOK, seed=0,
                       concurrency=concurrency)


def test_a_long_query_holds_back_no_later_one():
  queries = [Query('q0', 'long')] + [Query(f'q{i}', 'short') for i in range(1, 4)]
  results = _single_pool_engine().run(Turns(), queries)
  assert [r.query.query_id for r in results] == ['q0', 'q1', 'q2', 'q3']  # stream order
  finished = {r.query.query_id: r.finished for r in results}
  # q2 and q3 took q1's slot, one after the other, while q0 was still talking.
  assert finished['q1'] < finished['q2'] < finished['q3'] < finished['q0']


def test_results_are_consumed_in_stream_order_and_the_rest_abandoned():
  engine = _single_pool_engine(concurrency=3)
  seen = []
  source = ((i, Query(f'q{i}', 'long' if i == 0 else 'short')) for i in range(100))
  results = engine.stream(Turns(), source)
  for result in results:
    seen.append(result.index)
    if len(seen) == 3:
      break
  results.close()  # leaving the loop: the queries in flight are abandoned
  assert seen == [0, 1, 2]
  assert all(not i.queue for i in engine.instances)


class CountingEcho(SlowEcho):
  """SlowEcho that counts its batches."""

  def __init__(self, delay_s=0.02):
    super().__init__(delay_s)
    self.batches = 0

  def submit(self, prompts, keys, params, limits=None):
    self.batches += 1
    return super().submit(prompts, keys, params, limits)


def test_a_started_stream_generates_before_it_is_iterated_and_gives_the_same_results():
  def engine():
    pool = InstancePool('a', [Instance('a/0', (0,), CountingEcho())], make_sampler=None)
    return RolloutEngine({'a': pool}, {'a': SP}, {'a': 1}, TOK, seed=0, concurrency=3)

  def source():
    return ((i, Query(f'q{i}', 'long' if i == 1 else 'short')) for i in range(6))

  plain = [(r.query.query_id, r.finished > 0) for r in engine().run(Turns(), [
      q for _, q in source()])]
  started_engine = engine()
  inst = started_engine.instances[0]
  stream = started_engine.stream(Turns(), source())
  stream.start()
  assert inst.sampler.batches == 1 and inst.pending is not None  # generating already
  results = [(r.query.query_id, r.finished > 0) for r in stream]
  stream.close()
  assert results == plain
  # A started stream closed unread abandons what it dispatched.
  stream = started_engine.stream(Turns(), source())
  stream.start()
  stream.close()
  assert not inst.queue


def _tiny(seed, devices):
  cfg = transformer.ModelConfig(**transformer.PRESETS['tiny'], vocab_size=TOK.vocab_size)
  graphdef, state = nnx.split(transformer.Decoder(cfg, nnx.Rngs(params=seed)))
  mesh = sharding.make_mesh(devices, (1, 1))
  shardings = sharding.param_shardings(state, mesh)
  params = jax.device_put(nnx.to_pure_dict(state), shardings)
  return graphdef, params, shardings


def _embedded(graphdef, params, shardings, device, version=0):
  mesh = sharding.make_mesh([device], (1, 1))
  return EmbeddedSampler(graphdef, params, max_prompt_len=8, eos_id=TOK.eos_id,
                         pad_id=TOK.pad_id, version=version,
                         place=functools.partial(jax.device_put,
                                                 device=sharding.same_layout(shardings, mesh)))


class Both:
  """Every query asks agents a and b at the same time."""

  def agent_names(self):
    return ['a', 'b']

  async def run(self, query, agents):
    ep = Episode()
    for group in await asyncio.gather(agents['a'].generate('1+2='),
                                      agents['b'].generate('2+1=')):
      for c in group:
        ep.score(c, 0.0)
    return ep


def test_instances_of_two_agents_generate_at_the_same_time():
  devices = jax.devices()
  pools = {}
  for i, name in enumerate('ab'):
    graphdef, params, shardings = _tiny(i, devices[i:i + 1])
    sampler = _embedded(graphdef, params, shardings, devices[4 + i])
    pools[name] = InstancePool(name, [Instance(f'{name}/0', (4 + i,), sampler)], None)
  sp = SamplingParams(max_new_tokens=24)
  engine = RolloutEngine(pools, {'a': sp, 'b': sp}, {'a': 64, 'b': 64}, TOK, seed=0,
                         concurrency=4)
  queries = [Query(f'q{i}', '') for i in range(4)]
  engine.run(Both(), queries)  # compile
  engine.run(Both(), queries)
  [a], [b] = pools['a'].instances, pools['b'].instances
  overlap = lambda x, y: x[0] < y[1] and y[0] < x[1]
  assert sum(overlap(x, y) for x in list(a.busy)[-4:] for y in list(b.busy)[-4:]) > 0


def _request(i, cost):
  return Request(0, f'q{i}', 0, 'a', [1], 1, cost, future=None, served=[])


def test_router_keeps_outstanding_tokens_within_one_request():
  class Never:
    version = 0

  pool = InstancePool('a', [Instance(f'a/{i}', (i,), Never()) for i in range(3)], None)
  rng = np.random.default_rng(0)
  biggest = 0
  for i in range(200):
    cost = int(rng.integers(1, 50))
    biggest = max(biggest, cost)
    pool.route(_request(i, cost))
    loads = [inst.outstanding for inst in pool.instances]
    assert max(loads) - min(loads) <= biggest
  assert least_loaded([5, 3, 3]) == 1


class Recording(SlowEcho):
  """SlowEcho that keeps every prompt row it was asked to sample."""

  def __init__(self):
    super().__init__(delay_s=0.0)
    self.rows = []

  def submit(self, prompts, keys, params, limits=None):
    self.rows += [tuple(p) for p in prompts]
    return super().submit(prompts, keys, params, limits)


class Fanout:
  """One query asks agent a for a long prompt once, then three short prompts twice,
  all at the same time."""

  ASKS = (('9' * 30, 1), ('1', 2), ('2', 2), ('3', 2))

  def agent_names(self):
    return ['a']

  async def run(self, query, agents):
    ep = Episode()
    for group in await asyncio.gather(*(agents['a'].generate(p, n=n) for p, n in self.ASKS)):
      for c in group:
        ep.score(c, 0.0)
    return ep


@pytest.mark.quick
def test_router_balances_tokens_not_requests():
  """Bug: the router counting requests (or rows) instead of prompt + n × max_new_tokens.

  Token costs 33, 6, 6, 6 (BOS + prompt + n × 2): the long request fills instance 0, the
  three short ones go to instance 1; counting requests or rows would put two on each."""
  samplers = [Recording(), Recording()]
  pool = InstancePool('a', [Instance(f'a/{i}', (i,), s) for i, s in enumerate(samplers)], None)
  engine = RolloutEngine({'a': pool}, {'a': SP}, {'a': 1}, TOK, seed=0, concurrency=1)
  engine.run(Fanout(), [Query('q0', 'x')])
  cost = {tuple(TOK.encode(p)): len(TOK.encode(p)) + n * SP.max_new_tokens for p, n in Fanout.ASKS}
  served = [sum(cost[p] for p in set(s.rows)) for s in samplers]
  assert served == [31 + 2, 3 * (2 + 2 * 2)]
  assert [sorted(collections.Counter(s.rows).values()) for s in samplers] == [[1], [2, 2, 2]]


def test_sticky_conversations_stay_on_one_instance():
  class Never:
    version = 0

  pool = InstancePool('a', [Instance(f'a/{i}', (i,), Never()) for i in range(2)], None,
                      sticky=True)
  first = pool.route(_request(0, 10))
  pool.route(_request(1, 100))
  assert pool.route(_request(0, 10)) is first


LIMITS = {a: bal.Limits(1, 4, (1, 1)) for a in 'abc'}


def test_balancer_moves_toward_the_hot_agent_and_respects_minimums():
  move = bal.decide({'a': 1000.0, 'b': 10.0, 'c': 50.0}, {'a': 1, 'b': 2, 'c': 2}, LIMITS, 5.0)
  assert (move.source, move.target) == ('b', 'a')
  # b and c at their minimum: nothing to give
  assert bal.decide({'a': 1000.0, 'b': 0.0, 'c': 0.0}, {'a': 1, 'b': 1, 'c': 1}, LIMITS, 5) is None
  # below the threshold: no move
  assert bal.decide({'a': 40.0, 'b': 20.0, 'c': 20.0}, {'a': 1, 'b': 2, 'c': 2}, LIMITS, 5) is None
  # the hot agent at its maximum: the next hottest gets it
  limits = dict(LIMITS, a=bal.Limits(1, 1, (1, 1)))
  move = bal.decide({'a': 1000.0, 'b': 0.0, 'c': 500.0}, {'a': 1, 'b': 2, 'c': 1}, limits, 5)
  assert (move.source, move.target) == ('b', 'c')
  # instances only move between agents of the same shape
  limits = dict(LIMITS, b=bal.Limits(1, 4, (2, 1)), c=bal.Limits(1, 4, (2, 1)))
  assert bal.decide({'a': 1000.0, 'b': 0.0, 'c': 0.0}, {'a': 1, 'b': 2, 'c': 2}, limits, 5) is None


def test_balancer_gives_the_instance_to_the_hottest_of_three_agents():
  """Bug: the target taken from the wrong end of the load order (with two agents the
  only candidate is the right one)."""
  move = bal.decide({'a': 1000.0, 'b': 100.0, 'c': 0.0}, {'a': 1, 'b': 1, 'c': 2}, LIMITS, 5.0)
  assert (move.source, move.target) == ('c', 'a')
  move = bal.decide({'a': 0.0, 'b': 100.0, 'c': 1000.0, 'd': 0.0},
                    {'a': 2, 'b': 1, 'c': 1, 'd': 2}, dict(LIMITS, d=LIMITS['a']), 5.0)
  assert (move.source, move.target) == ('a', 'c')


def test_balancer_cooldown_stops_thrashing():
  b = bal.Balancer(LIMITS, threshold=5.0, cooldown_s=1.0, smoothing=0.0)
  b.observe({'a': 1000.0, 'b': 0.0, 'c': 0.0})
  counts = {'a': 1, 'b': 2, 'c': 2}
  move = b.propose(counts, now=10.0)
  assert move is not None
  b.moved(move, now=10.0)
  assert b.propose(counts, now=10.5) is None
  assert b.propose(counts, now=11.1) is not None
  assert b.log[0]['source'] in 'bc' and b.log[0]['target'] == 'a' and b.log[0]['time'] == 10.0


def test_a_moved_instance_serves_the_receiving_agents_current_weights():
  devices = jax.devices()
  models = {name: _tiny(i, devices[i:i + 1]) for i, name in enumerate('ab')}

  def factory(name):
    graphdef, _, shardings = models[name]
    return lambda devs, weights: _embedded(graphdef, weights.params, shardings,
                                           devices[devs[0]], weights.version)

  pools = {name: InstancePool(name, [], factory(name), Weights(models[name][1], version))
           for name, version in (('a', 3), ('b', 7))}
  for i, name in ((4, 'a'), (5, 'a'), (6, 'b')):
    pools[name].instances.append(
        Instance(f'{name}/{i}', (i,), pools[name].make_sampler((i,), pools[name].weights)))
  moved = pools['a'].release()
  assert moved is not None and len(pools['a'].instances) == 1
  pools['b'].adopt(moved)
  assert moved.sampler.version == 7 and len(pools['b'].instances) == 2
  prompts = [TOK.encode('3+4=')] * 4
  keys = np.stack([sample_key(0, 'b', 7, f's{i}') for i in range(4)])
  sp = SamplingParams(max_new_tokens=4)
  theirs = pools['b'].instances[0].sampler.generate(prompts, keys, sp)
  ours = moved.sampler.generate(prompts, keys, sp)
  np.testing.assert_array_equal(ours.tokens, theirs.tokens)
  np.testing.assert_allclose(ours.logprobs, theirs.logprobs, atol=1e-6)
  assert set(jax.tree.leaves(moved.sampler.state)[0].sharding.device_set) == {devices[moved.devices[0]]}


def test_a_moved_instance_keeps_its_sampler_when_the_pool_can_retarget_it():
  """`retarget` that takes the sampler over: no new sampler, the old one not closed;
  one that refuses: the old sampler closed and a new one made."""
  closed, made = [], []

  class Tracked(SlowEcho):
    def close(self):
      closed.append(self)

  def make(devices, weights):
    made.append(Tracked())
    made[-1].version = weights.version
    return made[-1]

  def takes_over(sampler, weights):
    if weights.version == 9:  # "another architecture"
      return False
    sampler.update_weights(weights.params, weights.version)
    return True

  for version, kept in ((7, True), (9, False)):
    closed.clear()
    made.clear()
    a = InstancePool('a', [Instance(f'a/{i}', (i,), Tracked()) for i in range(2)], make,
                     Weights({}, 0))
    b = InstancePool('b', [], make, Weights({}, version), retarget=takes_over)
    moved = a.release()
    old = moved.sampler
    b.adopt(moved)
    assert b.instances == [moved] and moved.sampler.version == version
    assert (moved.sampler is old) == kept and (closed == []) == kept and (made == []) == kept


def test_under_vllm_instances_move_only_between_agents_of_one_architecture():
  """The balancer's groups (`build.balance_group`): the mesh shape, and under vLLM the
  model too, but not the trained dtype (an engine casts weights to its own)."""
  from types import SimpleNamespace

  from flexmarl.build import balance_group
  model = transformer.ModelConfig(heads=2, kv_heads=1, head_dim=32)
  agent = lambda **m: SimpleNamespace(mesh_shape=(1,), model=dataclasses.replace(model, **m))
  spec = lambda backend: SimpleNamespace(rollout=SimpleNamespace(backend=backend))
  groups = {name: [balance_group(spec(backend), agent(**m)) for m in
                   ({}, {'dtype': 'bfloat16'}, {'mlp': 2 * model.mlp})]
            for name, backend in (('embedded', 'embedded'), ('vllm', 'vllm'))}
  assert groups['embedded'] == [(1,)] * 3
  same, cast, other = groups['vllm']
  assert same == cast != other and same[:1] == (1,)
