"""The default experiment on fewer devices than it asks for (8): with no placement given,
placement fits the team to the 1 or 2 devices there are (a training pool over them,
rollout on shared devices), says so at start-up and in placement.json, and trains the
same parameters as a run given that placement explicitly.

Each device count runs in a subprocess of its own (the device count is fixed when JAX
starts). The runs are the runlocal variant cut to 2 steps, with every agent given the
same batch and answer length so that they share compiled steps; the explicit run (and
the 2-device run) find the programs compiled before in a compilation cache."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from conftest import FAST_COMPILE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 2
AGENTS = ('router', 'reverser', 'sorter', 'adder')

RUNS = f'''
import sys
from experiments import hierarchical_assistant
from flexmarl.config import training_config
from flexmarl.run import train

workdir, devices = sys.argv[1], int(sys.argv[2])
for run in ('fitted', 'explicit'):
  c = hierarchical_assistant.get_config('runlocal')
  c.steps = c.checkpoint_every = {STEPS}
  c.rollout.query_concurrency, c.rollout.max_step_queries = 8, 32
  for a in c.agents.values():
    a.global_batch, a.micro_batch, a.sampling.max_new_tokens = 16, 8, 3
    a.grpo.entropy_coef = 0.1
  if run == 'explicit':  # the layout the fit chooses, given
    c.rollout.devices = 'shared'
    c.training = training_config(pool_devices=devices)
  print(f'== {{run}}', flush=True)
  train(c, f'{{workdir}}/{{run}}')
import os
print('memory fraction', os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION'))  # set by the plan
'''


@pytest.fixture(scope='module')
def cache(tmp_path_factory):
  """One compilation cache for the module: programs on device 0 serve both counts."""
  return str(tmp_path_factory.mktemp('jax_cache'))


def _run_both(workdir, devices: int, cache: str) -> str:
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu',
             XLA_FLAGS=f'--xla_force_host_platform_device_count={devices} {FAST_COMPILE}',
             JAX_COMPILATION_CACHE_DIR=cache,
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0')
  for name in ('XLA_PYTHON_CLIENT_MEM_FRACTION', 'XLA_CLIENT_MEM_FRACTION'):
    env.pop(name, None)  # the run plans it
  out = subprocess.run([sys.executable, '-c', RUNS, str(workdir), str(devices)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=400)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


def _params(workdir, agent):
  path = os.path.join(workdir, 'checkpoints', agent, str(STEPS), 'state')
  return [np.asarray(x) for x in
          jax.tree.leaves(ocp.StandardCheckpointer().restore(path)['params'])]


@pytest.mark.parametrize('devices', [1, 2])
def test_default_experiment_fits_fewer_devices(tmp_path, cache, devices):
  stdout = _run_both(tmp_path, devices, cache)
  fitted_out, explicit_out = stdout.split('== explicit')
  assert f'placement fitted to {devices} device(s) (the config asks for 8)' in fitted_out
  assert f'cost: training.pool_devices={devices}: 4 agents take turns' in fitted_out
  assert 'placement fitted' not in explicit_out
  assert 'memory fraction 0.9' in explicit_out  # the embedded sampler: JAX alone on a GPU
  p = json.loads((tmp_path / 'fitted' / 'placement.json').read_text())
  assert p['mode'] == 'shared'
  assert p['fitted']['asked_devices'] == 8 and p['fitted']['devices'] == devices
  assert p['fitted']['changes'] == {'rollout.devices': 'shared', 'training.pool_devices': devices}
  assert [m['devices'] for m in p['pool']] == [[d] for d in range(devices)]
  assert all(m['devices'] == [] for m in p['train'].values())  # the agents take turns
  assert {d for ms in p['rollout'].values() for m in ms for d in m['devices']} == set(
      range(devices))
  lines = [json.loads(l) for l in (tmp_path / 'fitted' / 'metrics.jsonl').read_text().splitlines()]
  assert {l['step'] for l in lines} == {1, 2}
  assert {l['agent'] for l in lines if l['agent'] in AGENTS and l['updated']} == set(AGENTS)

  q = json.loads((tmp_path / 'explicit' / 'placement.json').read_text())
  assert q['fitted'] is None
  assert {k: q[k] for k in ('mode', 'train', 'rollout', 'pool')} == {
      k: p[k] for k in ('mode', 'train', 'rollout', 'pool')}
  for agent in AGENTS:
    for x, y in zip(_params(tmp_path / 'fitted', agent), _params(tmp_path / 'explicit', agent),
                    strict=True):
      np.testing.assert_array_equal(x, y, err_msg=agent)


@pytest.mark.quick
def test_strict_placement_refuses_too_few_devices(tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu',
             XLA_FLAGS=f'--xla_force_host_platform_device_count=1 {FAST_COMPILE}')
  out = subprocess.run(
      [sys.executable, '-m', 'flexmarl.main', '--config=experiments/hierarchical_assistant.py',
       f'--workdir={tmp_path}/run', '--config.placement=strict'], cwd=ROOT, env=env,
      capture_output=True, text=True, timeout=120)
  assert out.returncode != 0
  assert 'no 1 free devices left (1 in all; this placement needs about 8)' in out.stderr
  assert "config.placement='strict'" in out.stderr and 'Traceback' not in out.stderr
  assert not (tmp_path / 'run').exists()
