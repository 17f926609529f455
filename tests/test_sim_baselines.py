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


@pytest.mark.quick
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


def test_a_variant_override_changes_only_its_variant():
  # MAS-RL with two queries in flight: both router calls in one batch [0, 1], both
  # specialist calls [1, 3], so a rollout takes 3 s. Turn a: 3 + 3.4; turn b: 3 + 7.4
  # -> 16.8. MARTI (colocated) keeps one query at a time: 13.4 as above.
  setup = _colocated()
  setup.query_concurrency = 1  # a field is overridden only where the setup has it
  setup.variant_overrides = dict(agents_in_turn=dict(query_concurrency=2))
  r = simulate(setup, 'agents_in_turn')
  assert r.step_times == [pytest.approx(16.8)]
  assert r.rollout_times == [pytest.approx(6.0)]
  assert simulate(setup, 'colocated').step_times == [pytest.approx(13.4)]
  setup.variant_overrides = dict(agents_in_turn=dict(query_concurency=2))
  with pytest.raises(ValueError, match=r"agents_in_turn names \['query_concurency'\]"):
    simulate(setup, 'agents_in_turn')


def _pool():
  """Two agents, one training mesh of one device; a swap moves 1 GB at 1 GB/s: 1 s."""
  setup = _setup()
  setup.training_meshes = 1
  setup.links = dict(host_bytes_per_s_per_device=1e9)
  for a in setup.agents.values():
    a.state_bytes = int(1e9)
  return setup


def test_more_agents_than_meshes_swap_in_turn():
  # sync: the rollout begins and both agents expect to train: a's state is prefetched
  # [0, 1] (one prefetch per mesh: b's waits). Rollout 6. a binds, its copy there, and
  # b's state is prefetched at once [6, 7], while a's update runs [6, 8.9]. b binds: a's
  # state leaves on the mesh's copy thread once its work is done [8.9, 9.9], holding no
  # one up, and b's copy is there already (the two states shared the mesh meanwhile);
  # b's update [8.9, 15.8]   ->   15.8 (before the rollout's start prefetched: 17.8)
  r = simulate(_pool(), 'sync')
  assert r.step_times == [pytest.approx(15.8)]


def test_pipelined_pool_swaps_once_per_update_and_holds_up_the_rollout():
  # flexmarl, one mesh. The rollout begins: a's state is prefetched [0, 1] (b's waits:
  # one prefetch per mesh). Query 0 ends at 3 with a group for each agent:
  #   a: binds, its copy there; micro-batch [3, 4.2]
  #   b: its micro-batch waits (the mesh holds a's state; a micro-batch is not worth a
  #      swap); its state is prefetched onto the mesh meanwhile [3, 4]. No bind held
  #      the rollout: query 1 ends at 6.
  #   a: micro-batch and step [6, 7.7]
  #   b: its step is urgent: a leaves on the mesh's copy thread once its work is done
  #      [7.7, 8.7], holding no one up; b's state is there already; b's two
  #      micro-batches and step [7.7, 14.6]   ->   14.6 (as with overlapped swaps)
  r = simulate(_pool(), 'flexmarl')
  assert r.step_times == [pytest.approx(14.6)]
  # Busy on the mesh: 2.9 + 6.9 s of training over the 14.6 s step.
  assert r.utilization['train'] == pytest.approx(9.8 / 14.6)


def test_overlapped_swaps_leave_the_rollout_alone():
  # As above with swaps that do not block (the paper's engine): the same times, as no
  # swap blocks there either. a's copy [0, 1], its micro-batch [3, 4.2]; b's state is
  # prefetched [3, 4]. Query 1 starts at 3, ends at 6. a: micro-batch and step [6, 7.7]. b's step: a's
  # copy out waits for a's work [7.7, 8.7] but nothing waits for it; b's state is
  # there already; b's two micro-batches and step [7.7, 14.6]   ->   14.6
  setup = _pool()
  setup.overlapped_swaps = True
  r = simulate(setup, 'flexmarl')
  assert r.step_times == [pytest.approx(14.6)]
  assert r.rollout_times == [pytest.approx(6.0)]


def test_first_calls_compile_and_warm_up_steps_are_left_out():
  # sync, two steps; compiling costs 1 s for the first micro-batch and 0.5 s for the
  # first generate call (both agents share one kind here: the rates give no model).
  # Step 0: 6 + 0.5 (query 0's router call) + 2.9 + 1 + 6.9 = 17.3. Step 1: a's new
  # weights are published at 10.4, before b's update [10.4, 17.3], and the next rollout
  # starts with them: query 0's router call [10.4, 11.4] runs while b trains, so step 1
  # takes 6 - 1 + 2.9 + 6.9 = 14.8 after step 0's end.
  setup = _setup()
  setup.steps, setup.warmup_steps = 2, 1
  setup.compile_s = dict(train=1.0, rollout=0.5)
  r = simulate(setup, 'sync')
  assert r.step_times == [pytest.approx(17.3), pytest.approx(14.8)]
  assert r.step_s == pytest.approx(14.8)
  setup.warmup_steps = 2
  with pytest.raises(ValueError, match='warmup_steps=2'):
    simulate(setup, 'sync')
