"""Runs on a Ray cluster (`config.cluster.backend='ray'`): two Ray nodes on this machine,
each rollout instance and each trainer in a process of its own, against the same run in
one process. The team works in turns (experiments/rounds_team.py's `toy`: a solver and a
checker in rounds, four attempts a query, credit per episode). Workers are killed with
SIGKILL mid-run; the runs must still end with the single-process run's parameters and
rows."""

import json
import os
import signal
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from flexmarl.cluster import nodes as nodes_lib
from flexmarl.config import ConfigError, build_team_spec
from flexmarl.metrics.writer import read_metrics
from flexmarl.placement import plan as placement_lib
from flexmarl.run import train
from flexmarl.spec.cluster import ClusterSpec, cluster_config, parse_cores
from flexmarl.store.experience_store import ExperienceStore
from experiments import rounds_team
from test_team import two_agent_config

STEPS = 3
# Under Ray the rollout workers run on the first core, the trainers on the last.
CORES = sorted(os.sched_getaffinity(0))


# -- pure parts -------------------------------------------------------------------------


def _nodes():
  return nodes_lib.split_devices(5, [('a' * 12, '10.0.0.1'), ('b' * 12, '10.0.0.2')])


def test_planned_devices_are_numbered_node_after_node():
  a, b = _nodes()
  assert (a.devices, b.devices) == (3, 2)
  owner = nodes_lib.node_of([a, b])
  assert [owner[d].address for d in range(5)] == ['10.0.0.1'] * 3 + ['10.0.0.2'] * 2


@pytest.mark.quick
def test_a_mesh_over_two_nodes_is_one_process_per_node_or_per_devices_per_process():
  a, b = _nodes()
  assert nodes_lib.slots('train:x', (2, 3, 4), [a, b], 0, False) == [
      nodes_lib.Slot(a, (2,)), nodes_lib.Slot(b, (3, 4))]
  assert nodes_lib.slots('train:x', (0, 1), [a, b], 1, False) == [
      nodes_lib.Slot(a, (0,)), nodes_lib.Slot(a, (1,))]
  with pytest.raises(ValueError, match='rollout instance runs in one process'):
    nodes_lib.slots('rollout:x:2-3', (2, 3), [a, b], 0, True)
  with pytest.raises(ValueError, match='devices_per_process=2'):
    nodes_lib.slots('train:x', (0, 1, 2), [a, b], 2, False)
  with pytest.raises(ValueError, match=r'holds planned devices 0-4.*config.cluster.devices'):
    nodes_lib.slots('train:x', (7,), [a, b], 0, False)


@pytest.mark.parametrize('field, value, match', [
    ('backend', 'slurm', r"choose one of \['local', 'ray'\]"),
    ('temp_dir', '/tmp/' + 'x' * 80, 'socket paths over 107 bytes'),
    ('devices_per_process', -1, 'must be >= 0'),
    ('call_timeout_s', 0, 'must be > 0 seconds'),
    ('rollout_cores', '3-1', 'write cores as taskset -c does'),
    ('trainer_cores', '0,x', 'write cores as taskset -c does'),
    ('trainer_cores', '0', "only Ray workers are pinned to cores: set cluster.backend='ray'"),
])
def test_bad_cluster_fields_are_named(field, value, match):
  with pytest.raises(ConfigError, match=rf'config\.cluster\.{field}=.*{match}'):
    ClusterSpec.from_config({field: value})


def test_cores_are_read_as_taskset_writes_them_and_must_exist_here():
  assert parse_cores('f', '0,2-3, 5') == (0, 2, 3, 5)
  assert parse_cores('f', '') == ()
  with pytest.raises(ConfigError, match=r"config\.cluster\.rollout_cores='4096': this machine "
                     r'has no core 4096 .* it may use \[0'):
    ClusterSpec.from_config({'backend': 'ray', 'rollout_cores': '4096'})


def test_a_training_pool_is_refused_under_ray():
  c = two_agent_config(steps=1)
  c.cluster = cluster_config(backend='ray')
  with pytest.raises(ConfigError, match=r'config\.cluster\.backend=.*training pool'):
    build_team_spec(c, 32, [0], ['solver', 'verifier'])  # 1 device: the agents share a pool


# -- runs on a two-node Ray cluster ----------------------------------------------------


@pytest.fixture(scope='module')
def ray_nodes():
  """Two Ray nodes on this machine (the runs join them; `cluster.devices=4` numbers
  devices 0-1 on the first node, 2-3 on the second)."""
  import ray
  from ray.cluster_utils import Cluster
  cluster = Cluster(initialize_head=True, head_node_args=dict(
      num_cpus=4, object_store_memory=300 * 2**20, include_dashboard=False))
  cluster.add_node(num_cpus=4, object_store_memory=300 * 2**20)
  ray.init(address=cluster.address)
  yield cluster
  ray.shutdown()
  cluster.shutdown()


def _config(schedule: str, backend: str):
  c = rounds_team.get_config('toy')
  c.steps, c.schedule, c.checkpoint_every, c.eval_every = STEPS, schedule, 1, 0
  c.rollout.max_step_queries = 6
  # Trainers on devices 0 and 1 (the first node), instances on 2 and 3 (the second).
  c.rollout.devices = 'separate'
  c.cluster = cluster_config(backend=backend, devices=4, call_timeout_s=300.0)
  if backend == 'ray':
    c.cluster.rollout_cores, c.cluster.trainer_cores = str(CORES[0]), str(CORES[-1])
  return c


def _params(workdir, agent):
  path = os.path.abspath(os.path.join(workdir, 'checkpoints', agent, str(STEPS), 'state'))
  return [np.asarray(x) for x in
          jax.tree.leaves(ocp.StandardCheckpointer().restore(path)['params'])]


def _rows(workdir):
  store = ExperienceStore.open(os.path.join(workdir, 'store'), agents=['solver', 'verifier'])
  try:
    return {a: sorted(r.sample_id for r in store.read(a)) for a in ('solver', 'verifier')}
  finally:
    store.close()


def _kill_after(step: int, workdir: str, group: str, killed: list) -> threading.Thread:
  """SIGKILL the process of `group` (from placement.json) once `step` is written."""
  def watch():
    metrics = os.path.join(workdir, 'metrics.jsonl')
    while not (os.path.exists(metrics) and f'"step": {step}' in open(metrics).read()):
      time.sleep(0.05)
    with open(os.path.join(workdir, placement_lib.FILENAME)) as f:
      pid = json.load(f)['cluster']['processes'][group][0]['pid']
    os.kill(pid, signal.SIGKILL)
    killed.append(pid)
  thread = threading.Thread(target=watch, daemon=True)
  thread.start()
  return thread


@pytest.fixture(scope='module')
def runs(tmp_path_factory, ray_nodes):
  """One process under `sync`, and the same team on Ray under `flexmarl` (the same
  parameters and rows, as schedules promise), whose rollout worker of the solver dies
  after step 1 and whose verifier's trainer dies after step 2 (checkpoint 1 complete)."""
  out = {'local': str(tmp_path_factory.mktemp('local'))}
  train(_config('sync', 'local'), out['local'], log=lambda *_: None)
  out['ray'] = workdir = str(tmp_path_factory.mktemp('ray'))
  killed, log = {}, []
  threads = [_kill_after(step, workdir, victim, killed.setdefault(victim, []))
             for victim, step in (('rollout:solver:2', 1), ('train:verifier', 2))]
  train(_config('flexmarl', 'ray'), workdir, log=log.append)
  for thread in threads:
    thread.join(timeout=1)
  out['killed'], out['log'] = killed, log
  return out


def test_ray_run_has_the_parameters_and_rows_of_one_process(runs):
  assert all(runs['killed'].values()), f'a worker was not killed mid-run: {runs["killed"]}'
  for agent in ('solver', 'verifier'):
    for x, y in zip(_params(runs['local'], agent), _params(runs['ray'], agent), strict=True):
      assert np.abs(x - y).max() <= 1e-5, (agent, np.abs(x - y).max())
  # No sample lost or written twice: the same sample ids, each once.
  assert _rows(runs['ray']) == _rows(runs['local'])
  lines = [l for l in read_metrics(os.path.join(runs['ray'], 'metrics.jsonl'))]
  assert sorted({l['step'] for l in lines}) == list(range(1, STEPS + 1))


def test_a_dead_trainer_resumes_the_run_from_its_checkpoint(runs):
  restarts = [l for l in runs['log'] if 'Resuming from the last checkpoint' in l]
  assert len(restarts) == 1 and "trainer group of 'verifier'" in restarts[0], runs['log']
  assert any(l.startswith('resumed from step 1') or l.startswith('resumed from step 2')
             for l in runs['log']), runs['log']


def test_a_worker_ray_cannot_reach_yet_is_sent_the_call_again(ray_nodes):
  """Ray's ActorUnavailableError (a killed worker it has not yet seen die, or one still
  restarting) is not a death: the call is sent again until the timeout. A dead worker is
  lost at once. (Under load, a rollout worker's restart once took a run restart.)"""
  import ray
  from flexmarl.cluster.remote import WorkerLost, resolve_resent

  @ray.remote(num_cpus=0)
  class Flaky:
    def __init__(self):
      self.calls = 0

    def call(self, unavailable: int) -> int:
      self.calls += 1
      if self.calls <= unavailable:
        raise ray.exceptions.ActorUnavailableError('restarting', None)
      return self.calls

  flaky, dead = Flaky.remote(), Flaky.remote()
  assert resolve_resent(lambda: flaky.call.remote(2), 'flaky', 'call', 60.0) == 3
  ray.kill(dead, no_restart=True)
  start = time.monotonic()
  with pytest.raises(WorkerLost, match='dead died during call'):
    resolve_resent(lambda: dead.call.remote(0), 'dead', 'call', 60.0)
  assert time.monotonic() - start < 30


def test_placement_lists_both_nodes_and_work_runs_on_both(runs):
  with open(os.path.join(runs['ray'], placement_lib.FILENAME)) as f:
    cluster = json.load(f)['cluster']
  assert len(cluster['nodes']) == 2
  processes = cluster['processes']
  assert set(processes) == {'train:solver', 'train:verifier', 'rollout:solver:2',
                            'rollout:verifier:3'}
  node = {g: p[0]['address'] + p[0]['node'] for g, p in processes.items()}
  assert node['train:solver'] == node['train:verifier']  # devices 0, 1: the first node
  assert node['rollout:solver:2'] == node['rollout:verifier:3'] != node['train:solver']
  assert len({p[0]['pid'] for p in processes.values()}) == 4
  # Pinned as `cluster.rollout_cores` / `trainer_cores` ask, JAX's threads included.
  for group, p in processes.items():
    assert p[0]['cores'] == [CORES[-1] if group.startswith('train:') else CORES[0]], group


# -- a trainer group of two processes ---------------------------------------------------


def test_trainer_group_of_two_processes_trains_like_one_process_of_four_devices(ray_nodes):
  """2 processes × 2 CPU devices, one jax.distributed cluster (gloo), one fsdp mesh over
  the four: the same step as this process's four devices (gradients summed over two
  micro-batches, then Adam)."""
  from flexmarl.build import agent_trainer
  from flexmarl.cluster.remote import start_trainer_group
  from flexmarl.cluster.workers import TrainerJob
  from flexmarl.config import AgentSpec
  from flexmarl.models import sharding
  from flexmarl.train.trainer import TrainBatch
  c = two_agent_config(steps=1)
  c.agents.solver.mesh_shape, c.agents.solver.mesh_axes = (4,), ('fsdp',)
  agent = AgentSpec.from_config('solver', c.agents.solver, 32, seed=7)
  rng = np.random.default_rng(0)
  batches = [TrainBatch.from_rows(
      [list(rng.integers(3, 30, 5)) for _ in range(8)],
      [rng.integers(3, 30, 2) for _ in range(8)], [np.full(2, -3.0, np.float32)] * 8,
      rng.normal(size=8).astype(np.float32), prompt_len=8, response_len=2, pad_id=0,
      batch_multiple=4) for _ in range(2)]

  local = agent_trainer('solver', agent, sharding.make_mesh(jax.devices()[:4], (4,),
                                                                ('fsdp',)), ())
  import ray
  node = nodes_lib.Node(ray.get_runtime_context().get_node_id(),
                        ray.util.get_node_ip_address(), 4)  # this driver's node
  group, started = start_trainer_group(
      TrainerJob('solver', agent, (), '/tmp/unused'),
      nodes_lib.slots('train:solver', (0, 1, 2, 3), [node], 2, False), False,
      len(jax.devices()),
      ClusterSpec(call_timeout_s=300.0), 4)
  where = group.get(started, 'start')
  assert [len(w['local_devices']) for w in where] == [2, 2]
  assert where[0]['pid'] != where[1]['pid']
  for batch in batches:  # one optimizer step over two micro-batches
    local.accumulate(batch, 0)
    group.accumulate(batch, 0)
  want, got = local.dispatch_apply()(), group.dispatch_apply()()
  for key in ('loss', 'grad_norm', 'entropy'):
    np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)
  remote = ray.get(group.params.ref)
  # Adam's first step is lr * g / (|g| + eps): where a gradient element is near eps, the
  # last bits of g (another reduction order over two processes) move the step by ~1% of
  # lr; a wrong batch, order or device would move it by lr.
  step_tolerance = 0.01 * agent.optimizer.learning_rate
  for x, y in zip(jax.tree.leaves(jax.device_get(local.params)), jax.tree.leaves(remote),
                  strict=True):
    assert np.abs(x - y).max() <= step_tolerance
  for r in group.ranks:
    ray.kill(r)
