"""Benchmarks that check what they measure keep running as the code under them changes
(each in its quick mode, as a user starts it)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import FAST_COMPILE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu',
           XLA_FLAGS=f'--xla_force_host_platform_device_count=8 {FAST_COMPILE}')


def _run(script: str, *args: str) -> str:
  out = subprocess.run([sys.executable, os.path.join(ROOT, 'experiments', 'benchmarks', script),
                        *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


def test_long_run_measures_its_runs_while_the_store_writes():
  # It sizes the store folder after every step, while the store's thread appends.
  # One experiment of the two (each runs the same code in a process of its own).
  result = json.loads(_run('long_run.py', '--quick', '--experiments=planner_workers_judge'
                           ).strip().splitlines()[-1])
  assert [r['experiment'] for r in result] == ['planner_workers_judge']
  assert all(r['steps'] == 12 and len(r['samples']) == 12 for r in result)


@pytest.mark.extra('vllm')
def test_vllm_in_run_replays_the_samples_a_step_served():
  # It checks that replaying a step's batches with the weights they were served with
  # draws the very tokens the step drew (a step starts the next one's rollout early).
  out = _run('vllm_in_run.py', '--shape=small', '--rounds=1', '--warmup=1', '--repeats=1')
  result = json.loads(out.strip().splitlines()[-1])
  assert result['median']['tokens'] > 0 and result['ratio'] > 0
