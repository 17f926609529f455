"""Placement as data: derived or explicit, checked before anything compiles, saved."""

import pytest

from flexmarl.core.errors import ConfigError
from flexmarl.placement import plan as pl
from flexmarl.placement.fit import fit
from flexmarl.run import train
from test_team import two_agent_config

IDS = list(range(8))


@pytest.mark.quick
def test_derived_separate_placement():
  p = pl.derive({'a': pl.AgentDemand((1, 1), instances=2), 'b': pl.AgentDemand((2, 1))},
                'separate', IDS)
  assert p.train['a'].devices == (0,) and p.train['b'].devices == (1, 2)
  assert [m.devices for m in p.rollout['a']] == [(3,), (4,)]
  assert [m.devices for m in p.rollout['b']] == [(5, 6)]
  shared = pl.derive({'a': pl.AgentDemand((1, 1), instances=2)}, 'shared', IDS)
  assert [m.devices for m in shared.rollout['a']] == [(0,), (0,)]


def test_explicit_placement_and_round_trip(tmp_path):
  p = pl.derive({'a': pl.AgentDemand((1, 1), 2, train_devices=(7,),
                                     instance_devices=((0,), (1,))),
                 'b': pl.AgentDemand((1, 1))}, 'separate', IDS)
  assert p.train['a'].devices == (7,) and p.train['b'].devices == (2,)
  assert p.rollout['b'][0].devices == (3,)
  pl.save(p, str(tmp_path))
  assert pl.load(str(tmp_path)) == p
  pl.check_resume(p, str(tmp_path))
  other = pl.derive({'a': pl.AgentDemand((2, 1)), 'b': pl.AgentDemand((1, 1))}, 'shared', IDS)
  with pytest.raises(ConfigError, match=r'agents\.a\.mesh_shape=\(2, 1\).*new --workdir'):
    pl.check_resume(other, str(tmp_path))


@pytest.mark.parametrize('demands, mode, match', [
    ({'a': pl.AgentDemand((1, 1), train_devices=(0,)),
      'b': pl.AgentDemand((1, 1), train_devices=(0,))}, 'shared',
     r'agents\.b\.train_devices: device 0 is already used by agents\.a'),
    ({'a': pl.AgentDemand((1, 1), train_devices=(0,), instance_devices=((0,),))}, 'separate',
     r'agents\.a\.rollout\.devices\[0\]: device 0 .*rollout\.devices=shared'),
    ({'a': pl.AgentDemand((1, 1), instances=0)}, 'separate', r'instances=0: .*at least one'),
    ({'a': pl.AgentDemand((4, 2))}, 'separate', r'agents\.a\.rollout\.instances: no 8 free'),
    ({'a': pl.AgentDemand((1, 1), train_devices=(9,))}, 'shared', r'devices \[9\] do not exist'),
    ({'a': pl.AgentDemand((2, 1), train_devices=(1,))}, 'shared', r'give 2'),
    ({'a': pl.AgentDemand((1, 1), instances=2, instance_devices=((3,),))}, 'separate',
     r'one list per instance'),
    ({'a': pl.AgentDemand((1, 1))}, 'elsewhere', r"rollout\.devices='elsewhere'"),
])
def test_bad_placements_name_the_field_and_the_fix(demands, mode, match):
  with pytest.raises(ConfigError, match=match):
    pl.derive(demands, mode, IDS)


def test_bad_placement_fails_before_anything_is_written(tmp_path):
  c = two_agent_config(steps=1)
  c.rollout.devices = 'separate'
  c.agents.solver.rollout.instances = 3
  c.agents.verifier.mesh_shape = (2, 2)  # 1 + 3 + 4 + 4 = 12 devices of 8
  c.placement = 'strict'  # 'fit' would run the instances on the training devices
  with pytest.raises(ConfigError, match='verifier'):
    train(c, str(tmp_path / 'run'), log=lambda *_: None)
  assert not (tmp_path / 'run').exists()


FOUR = {n: pl.AgentDemand((1, 1)) for n in ('router', 'reverser', 'sorter', 'adder')}


@pytest.mark.parametrize('devices, changes, pool', [
    (8, None, []),  # the layout asked for: 4 meshes + 4 instances of their own
    (5, {'rollout.devices': 'shared'}, []),
    (4, {'rollout.devices': 'shared'}, []),
    (3, {'rollout.devices': 'shared', 'training.pool_devices': 3}, [(0,), (1,), (2,)]),
    (1, {'rollout.devices': 'shared', 'training.pool_devices': 1}, [(0,)]),
])
def test_fit_takes_the_first_layout_that_fits(devices, changes, pool):
  p = fit(FOUR, 'separate', IDS[:devices], state_bytes=lambda: {'router': 3 * 2**20})
  assert (p.fitted.changes if p.fitted else None) == changes
  assert [m.devices for m in p.pool] == pool
  assert p.mode == ('separate' if devices == 8 else 'shared')
  used = {d for ms in p.rollout.values() for m in ms for d in m.devices}
  assert used == set(IDS[4:] if devices == 8 else IDS[:min(devices, 4)])
  if changes:
    assert p.fitted.asked == 8 and p.fitted.devices == devices
    assert ('3.0 MiB' in ' '.join(p.fitted.costs)) == bool(pool)
    assert ('devices [4] stay idle' in ' '.join(p.fitted.costs)) == (devices == 5)
    assert 'placement fitted to' in p.describe()


def test_fit_keeps_explicit_and_strict_placements():
  with pytest.raises(ConfigError, match=r"no 1 free devices.*placement='strict'"):
    fit(FOUR, 'separate', [0], strict=True)
  explicit = dict(FOUR, adder=pl.AgentDemand((1, 1), train_devices=(0,)))
  with pytest.raises(ConfigError, match=r'no 1 free devices') as err:
    fit(explicit, 'separate', [0, 1])
  assert 'Fitting' not in str(err.value)
  with pytest.raises(ConfigError, match=r'training\.pool_devices: no 4 free devices'):
    fit(FOUR, 'shared', [0, 1], pool_devices=4)  # a pool given is never resized
  with pytest.raises(ConfigError, match=r'failed too: a training pool needs one mesh of each '
                     r'agent shape, 3 devices'):
    fit(dict(FOUR, router=pl.AgentDemand((2, 1))), 'shared', [0, 1])


def test_fitted_placement_round_trip(tmp_path):
  p = fit(FOUR, 'separate', [0, 1])
  pl.save(p, str(tmp_path))
  assert pl.load(str(tmp_path)) == p and pl.load(str(tmp_path)).fitted.changes == {
      'rollout.devices': 'shared', 'training.pool_devices': 2}
