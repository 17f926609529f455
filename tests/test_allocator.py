"""The allocator's and the host budget's decisions on hand-computed cases; the config
checks of the training pool."""

import jax
import pytest

from flexmarl.core.errors import ConfigError
from flexmarl.models import sharding
from flexmarl.models.transformer import ModelConfig
from flexmarl.train import grpo, pool_meshes, sizing
from flexmarl.train.allocator import FreeMesh, Waiting, allocate, evict_lru
from flexmarl.train.trainer import AgentTrainer, OptimizerConfig

F2 = sharding.layout((2,), ('fsdp',))
T22 = sharding.layout((2, 2), ('fsdp', 'tensor'))


@pytest.mark.quick
def test_oldest_first_then_most_ready_work_then_name():
  waiting = [Waiting('a', 1, F2, since=5.0), Waiting('b', 3, F2, since=2.0),
             Waiting('c', 4, F2, since=5.0), Waiting('d', 9, F2, since=7.0),
             Waiting('e', 1, F2, since=5.0)]
  free = [FreeMesh('m0', F2), FreeMesh('m1', F2), FreeMesh('m2', F2)]
  # b is oldest; a, c, e tie on since: c has the most work, then a before e by name.
  assert allocate(waiting, free) == {'b': 'm0', 'c': 'm1', 'a': 'm2'}


def test_agents_stay_where_their_state_is_and_avoid_other_waiting_states():
  waiting = [Waiting('a', 1, F2, since=0.0), Waiting('b', 1, F2, since=1.0, location='m0'),
             Waiting('z', 1, F2, since=9.0, location='m2')]
  free = [FreeMesh('m0', F2, resident='b'), FreeMesh('m1', F2, resident='idle'),
          FreeMesh('m2', F2, resident='z'), FreeMesh('m3', F2)]
  # b keeps m0; a takes the empty m3 (not m1, which holds an idle agent's state, nor
  # m2, where z's state waits); z stays on m2.
  assert allocate(waiting, free) == {'b': 'm0', 'a': 'm3', 'z': 'm2'}
  # Two free meshes for a, b, z: b is served before z (older) and must move; a avoids
  # m2, where z's state waits for its turn, and b then takes it.
  free = [FreeMesh('m1', F2, resident='idle'), FreeMesh('m2', F2, resident='z')]
  assert allocate(waiting, free) == {'a': 'm1', 'b': 'm2'}
  assert allocate([waiting[0], waiting[2]], free) == {'z': 'm2', 'a': 'm1'}


def test_an_agent_goes_back_to_the_mesh_whose_host_memory_holds_its_state():
  # Both meshes hold idle agents' states; m0 was idle longest, but a's state sits in
  # m1's host memory (a copy back onto the same devices is the cheaper one).
  free = [FreeMesh('m0', F2, resident='x', idle_since=1.0),
          FreeMesh('m1', F2, resident='y', idle_since=2.0)]
  assert allocate([Waiting('a', 1, F2, since=0.0)], free) == {'a': 'm0'}
  assert allocate([Waiting('a', 1, F2, since=0.0, near='m1')], free) == {'a': 'm1'}
  # Near does not beat a mesh that holds no state, nor move a waiting agent's state.
  assert allocate([Waiting('a', 1, F2, since=0.0, near='m1')],
                  [free[0], FreeMesh('m2', F2), free[1]]) == {'a': 'm2'}
  assert allocate([Waiting('a', 1, F2, since=0.0, near='m1'),
                   Waiting('y', 1, F2, since=5.0, location='m1')], free) == {'a': 'm0', 'y': 'm1'}


def test_fairness_beats_locality_and_shapes_must_match():
  # One free mesh: the oldest agent gets it even though another agent's state is there.
  waiting = [Waiting('old', 1, F2, since=0.0), Waiting('home', 5, F2, since=3.0, location='m0')]
  assert allocate(waiting, [FreeMesh('m0', F2, resident='home')]) == {'old': 'm0'}
  # Only meshes of an agent's layout; agents with nothing ready are not bound.
  waiting = [Waiting('big', 2, T22, since=0.0), Waiting('small', 1, F2, since=1.0),
             Waiting('idle', 0, F2, since=-1.0)]
  assert allocate(waiting, [FreeMesh('m0', F2), FreeMesh('m1', F2)]) == {'small': 'm0'}
  assert allocate(waiting, [FreeMesh('t', T22), FreeMesh('m', F2)]) == {'big': 't', 'small': 'm'}
  assert allocate(waiting, []) == {}


def test_evict_least_recently_used_until_the_rest_fits():
  sizes = {'a': 40, 'b': 30, 'c': 20, 'd': 10}
  last = {'a': 3.0, 'b': 1.0, 'c': 2.0, 'd': 0.0}
  assert evict_lru(sizes, last, budget=100) == []
  assert evict_lru(sizes, last, budget=90) == ['d']
  assert evict_lru(sizes, last, budget=60) == ['d', 'b']  # 100 - 10 - 30 = 60
  assert evict_lru(sizes, last, budget=55) == ['d', 'b', 'c']
  assert evict_lru(sizes, last, budget=50, keep={'b'}) == ['d', 'c', 'a']


def test_pool_checks_name_the_field_and_the_fix():
  with pytest.raises(ConfigError, match=r"agents\.coder\.mesh_shape=\(2, 2\).*needs 4 devices.*"
                     r"pool has 2.*smaller mesh"):
    sizing.check_pool(2, {'router': F2, 'coder': T22})
  sizing.check_pool(4, {'router': F2, 'coder': T22, 'other': T22})  # they take turns
  nbytes = sizing.state_nbytes(ModelConfig(), OptimizerConfig(), grpo.GRPOConfig())
  t = AgentTrainer('a', ModelConfig(), OptimizerConfig(), grpo.GRPOConfig(), F2, seed=0)
  assert nbytes == t.state.nbytes  # params, Adam moments, counts, RNG: from shapes
  with pytest.raises(ConfigError, match=rf"host_budget_bytes=1000: agent 'b' alone has a state "
                     rf"of {nbytes} bytes.*at least {nbytes}"):
    sizing.check_host_budget(1000, {'a': 10, 'b': nbytes})
  sizing.check_host_budget(nbytes, {'a': nbytes, 'b': nbytes})


def test_carve_gives_disjoint_meshes_or_refuses():
  meshes = pool_meshes.carve(jax.devices()[:8], [T22, F2, F2])
  assert [m.axis_names for m in meshes] == [('fsdp', 'tensor'), ('fsdp',), ('fsdp',)]
  assert sum(m.size for m in meshes) == len({d for m in meshes for d in m.devices.flat}) == 8
  with pytest.raises(ConfigError, match=r'training\.meshes.*need 10 devices.*has 8'):
    pool_meshes.carve(jax.devices()[:8], [T22, T22, F2])
