"""The baselines as built and the training pool, in simulated time: cases worked out on
paper give the step times computed by hand (the setup of test_simulate: router `a` then
specialist `b`, one query at a time, each query 3 s of rollout, 2 queries a step)."""

import pytest

from flexmarl.sim.run import simulate
from tests.test_simulate import _setup

# Training, as in test_simulate: a's update 1.2 + 1.2 + 0.5 = 2.9 s, b's 3.2 + 3.2 + 0.5 = 6.9 s.
LOAD_S, OFFLOAD_S = 0.3, 0.2


def _colocated():
  setup = _setup()
  for a in setup.agents.values():
    a.rates.load_s, a.rates.offload_s = LOAD_S, OFFLOAD_S
  return setup


def test_colocated_loads_and_offloads_around_training():
  # Rollout 6 s, then both agents at once, each: load 0.3, its update, offload 0.2.
  # a: 0.3 + 2.9 + 0.2 = 3.4; b: 0.3 + 6.9 + 0.2 = 7.4   ->   6 + 7.4 = 13.4
  r = simulate(_colocated(), 'colocated')
  assert r.step_times == [pytest.approx(13.4)]
  assert r.rollout_times == [pytest.approx(6.0)]


def test_agents_in_turn_roll_out_afresh_for_each_agent():
  # Turn a: rollout 6 (queries 0-1), a trains 3.4 -> 9.4; turn b: rollout 6 (queries 2-3),
  # b trains 7.4 -> 9.4 + 13.4 = 22.8. Four queries, two rollouts of 6 s.
  r = simulate(_colocated(), 'agents_in_turn')
  assert r.step_times == [pytest.approx(22.8)]
  assert r.rollout_times == [pytest.approx(12.0)] and r.queries == 4


def _pool():
  """Two agents, one training mesh of one device; a swap moves 1 GB at 1 GB/s: 1 s."""
  setup = _setup()
  setup.training_meshes = 1
  setup.links = dict(host_bytes_per_s_per_device=1e9)
  for a in setup.agents.values():
    a.state_bytes = int(1e9)
  return setup


def test_more_agents_than_meshes_swap_in_turn():
  # sync: rollout 6. a binds: swap in on the link [6, 7], a's update [7, 9.9].
  # b binds: swap in [9.9, 10.9] (the link is free, a's work is done), then a's state
  # leaves [10.9, 11.9] while b's update runs [10.9, 17.8]   ->   17.8
  r = simulate(_pool(), 'sync')
  assert r.step_times == [pytest.approx(17.8)]


def test_pipelined_pool_prefetches_and_swaps_per_micro_batch():
  # flexmarl, one mesh. Query 0 ends at 3 with a group for each agent:
  #   a: swap in [3, 4], micro-batch [4, 5.2]
  #   b: swap in [4, 5] (the link is busy until 4) while a computes; a leaves [5.2, 6.2];
  #      b's micro-batch [5.2, 8.4]
  # Query 1 ends at 6:
  #   a: swap in [6.2, 7.2]; b leaves after its work [8.4, 9.4]; a's micro-batch and
  #      optimizer step [8.4, 10.1]
  #   b: swap in [9.4, 10.4]; a leaves [10.4, 11.4]; b's micro-batch and step
  #      [10.4, 14.1]   ->   14.1
  r = simulate(_pool(), 'flexmarl')
  assert r.step_times == [pytest.approx(14.1)]
  # Busy on the mesh: 2.9 + 6.9 s of training over the 14.1 s step.
  assert r.utilization['train'] == pytest.approx(9.8 / 14.1)


def test_first_calls_compile_and_warm_up_steps_are_left_out():
  # sync, two steps; compiling costs 1 s for the first micro-batch and 0.5 s for the
  # first generate call (both agents share one kind here: the rates give no model).
  # Step 0: 6 + 0.5 (query 0's router call) + 2.9 + 1 + 6.9 = 17.3; step 1: 15.8.
  setup = _setup()
  setup.steps, setup.warmup_steps = 2, 1
  setup.compile_s = dict(train=1.0, rollout=0.5)
  r = simulate(setup, 'sync')
  assert r.step_times == [pytest.approx(17.3), pytest.approx(15.8)]
  assert r.step_s == pytest.approx(15.8)
  setup.warmup_steps = 2
  with pytest.raises(ValueError, match='warmup_steps=2'):
    simulate(setup, 'sync')


def test_pool_sends_least_recently_used_states_to_storage():
  # One mesh, three agents taking turns (a, b, c, a), each piece of work 1 s; a state is
  # 1 GB, the host link moves 1 GB/s, storage 0.5 GB/s, host memory holds one state.
  # Every state starts on the host.
  # a: in [0, 1], works [1, 2].
  # b: in [1, 2], works [2, 3]; a out [2, 3]: a and c (never used) on the host exceed the
  #    budget, the least recently used (c) goes to storage.
  # c: in from storage [3, 5], works [5, 6]; b out [5, 6]: a to storage.
  # a: in from storage [6, 8], works [8, 9]; c out [8, 9]: b (not c, newer) to storage.
  import types
  from flexmarl.clock import SimClock
  from flexmarl.sim.devices import DeviceGroup
  from flexmarl.sim.pool import HOST, STORAGE, SimTrainingPool
  clock = SimClock()
  mesh = DeviceGroup(clock, 'train/pool0')
  trainers = {n: types.SimpleNamespace(group=None) for n in 'abc'}
  pool = SimTrainingPool(clock, trainers, [mesh], dict.fromkeys('abc', int(1e9)), 1e9, 0.5e9,
                         host_budget=int(1.5e9))
  ends = []
  for name in 'abca':
    pool.submit(name, lambda name=name: ends.append(trainers[name].group.run('work', 1.0)))
    pool.run()
  assert ends == [2.0, 3.0, 6.0, 9.0]
  assert pool.where == {'a': 'train/pool0', 'b': STORAGE, 'c': HOST}
  assert pool.links['train/pool0'].busy_until == 9.0
  stats = pool.step_stats('a')
  assert stats['swaps'] == 3 and stats['swap_s'] == pytest.approx(1 + 1 + 2)
  assert stats['meshes'] == 'train/pool0'
