"""The default experiment on fewer devices than it asks for (8): with no placement given,
placement fits the team to the 1 or 2 devices there are (a training pool over them,
rollout on shared devices), says so at start-up and in placement.json, and trains the
same parameters as a run given that placement explicitly. Runs as a user runs it (the
command line, in subprocesses with their own device counts), short and with smaller
batches; one compilation cache serves every run of the module."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 2
GROUPS = {'router': 4, 'reverser': 8, 'sorter': 8, 'adder': 8}  # the experiment's group sizes
FLAGS = [f'--config.steps={STEPS}', f'--config.checkpoint_every={STEPS}',
         '--config.rollout.query_concurrency=8', '--config.rollout.max_step_queries=32',
         *(f'--config.agents.{n}.{k}={v}' for n, g in GROUPS.items()
           for k, v in (('global_batch', 2 * g), ('micro_batch', g)))]

# The fitted placement, given explicitly.
EXPLICIT = '''
from experiments import hierarchical_assistant
from flexmarl.config import training_config


def get_config(arg=''):
  c = hierarchical_assistant.get_config(arg)
  c.rollout.devices = 'shared'
  c.training = training_config(pool_devices={devices})
  return c
'''


@pytest.fixture(scope='module')
def cache(tmp_path_factory):
  return str(tmp_path_factory.mktemp('jax_cache'))


def _main(config: str, workdir, devices: int, cache: str, *extra: str):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu',
             XLA_FLAGS=f'--xla_force_host_platform_device_count={devices}',
             JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0')
  out = subprocess.run([sys.executable, '-m', 'flexmarl.main', f'--config={config}',
                        f'--workdir={workdir}', *FLAGS, *extra], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=400)
  assert out.returncode == 0, out.stderr[-3000:]
  return out


def _params(workdir, agent):
  path = os.path.join(workdir, 'checkpoints', agent, str(STEPS), 'state')
  return [np.asarray(x) for x in
          jax.tree.leaves(ocp.StandardCheckpointer().restore(path)['params'])]


@pytest.mark.parametrize('devices', [1, 2])
def test_default_experiment_fits_fewer_devices(tmp_path, cache, devices):
  fitted = tmp_path / 'fitted'
  out = _main('experiments/hierarchical_assistant.py:runlocal', fitted, devices, cache)
  assert f'placement fitted to {devices} device(s) (the config asks for 8)' in out.stdout
  assert 'cost: training.pool_devices' in out.stdout, out.stdout[-2000:]
  p = json.loads((fitted / 'placement.json').read_text())
  assert p['mode'] == 'shared'
  assert p['fitted']['changes'] == {'rollout.devices': 'shared', 'training.pool_devices': devices}
  assert [m['devices'] for m in p['pool']] == [[d] for d in range(devices)]
  assert all(m['devices'] == [] for m in p['train'].values())
  assert {d for ms in p['rollout'].values() for m in ms for d in m['devices']} == set(
      range(devices))
  lines = [json.loads(l) for l in (fitted / 'metrics.jsonl').read_text().splitlines()]
  assert {l['step'] for l in lines} == {1, 2}

  (tmp_path / 'explicit.py').write_text(EXPLICIT.format(devices=devices))
  explicit = tmp_path / 'explicit'
  out = _main(f'{tmp_path}/explicit.py:runlocal', explicit, devices, cache)
  assert 'placement fitted' not in out.stdout
  q = json.loads((explicit / 'placement.json').read_text())
  assert q['fitted'] is None
  assert {k: q[k] for k in ('mode', 'train', 'rollout', 'pool')} == {
      k: p[k] for k in ('mode', 'train', 'rollout', 'pool')}
  for agent in GROUPS:
    for x, y in zip(_params(fitted, agent), _params(explicit, agent), strict=True):
      np.testing.assert_array_equal(x, y, err_msg=agent)


def test_strict_placement_refuses_too_few_devices(tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu',
             XLA_FLAGS='--xla_force_host_platform_device_count=1')
  out = subprocess.run(
      [sys.executable, '-m', 'flexmarl.main', '--config=experiments/hierarchical_assistant.py',
       f'--workdir={tmp_path}/run', '--config.placement=strict'], cwd=ROOT, env=env,
      capture_output=True, text=True, timeout=120)
  assert out.returncode != 0
  assert 'no 1 free devices left (1 in all; this placement needs about 8)' in out.stderr
  assert "config.placement='strict'" in out.stderr and 'Traceback' not in out.stderr
  assert not (tmp_path / 'run').exists()
