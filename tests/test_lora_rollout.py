"""LoRA agents of one base served by one rollout instance (`rollout.adapter_groups`):
each agent's rows are those of a dedicated instance, at its own version; `sync` ≡
`flexmarl`; a team on shared instances learns; placement says who shares what; bad
groups are refused."""

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from experiments import planner_workers_judge
from flexmarl.config import ConfigError, build_team_spec
from flexmarl.core.interfaces import Weights
from flexmarl.metrics.writer import read_metrics
from flexmarl.models.lora import LoRAConfig
from flexmarl.models.transformer import Decoder, ModelConfig
from flexmarl.rollout.adapters import SharedAdapterSampler
from flexmarl.rollout.pool import Instance, InstancePool, Request
from flexmarl.run import build, train
from test_lora import _checkpoint, _lora_team

TEAM = ('planner', 'worker', 'judge')
QUIET = dict(log=lambda *_: None)


def _three(steps: int, shared: bool, schedule: str = 'flexmarl'):
  """The planner, worker and judge as adapters on one random base (seed 7), rolling out
  on their training devices; with `shared`, all three on the planner's one instance.
  Two queries fill every batch (per query 8 planner, 16 worker and 8 judge rows), in
  two micro-batches each."""
  c = planner_workers_judge.get_config('runlocal')
  c.steps, c.checkpoint_every, c.schedule = steps, steps, schedule
  c.rollout.devices = 'shared'
  c.rollout.query_concurrency, c.rollout.max_step_queries = 2, 4
  for name, rows in zip(TEAM, (16, 32, 16)):
    a = c.agents[name]
    a.model.lora = dict(rank=8, alpha=16.0)
    a.model.base_seed = 7
    a.global_batch, a.micro_batch = rows, rows // 2
    a.optimizer.learning_rate = 3e-2
  if shared:
    c.rollout.adapter_groups = [list(TEAM)]
  return c


def _trained(params: dict, seed: int) -> dict:
  """`params` with every adapter B drawn at random: an agent whose adapter changed."""
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_map_with_path(
      lambda path, x: (rng.normal(size=x.shape).astype(x.dtype) * 0.3
                       if path[-1].key == 'lora_b' else x), jax.device_get(params))


def _mixed_batch(instance, orchestrator, prompts: dict[str, list[int]]):
  """One batch of `instance` with one group of 4 rows per agent of `prompts`: its rows
  per agent, and each agent's version."""
  requests = [Request(0, f'q-{agent}', 0, agent, ids, 4, 0, None, [])
              for agent, ids in prompts.items()]
  instance.queue.extend(requests)
  instance.submit_next(orchestrator.rollout_engine._keys, orchestrator.rollout_engine.sampling['planner'],
                       max_batch=64, now=0.0)
  batch, out, versions = instance.collect(now=0.0)
  rows = {r.agent: slice(4 * k, 4 * k + 4) for k, r in enumerate(batch)}
  return ({a: (out.tokens[s], out.logprobs[s], out.lengths[s]) for a, s in rows.items()},
          {r.agent: v for r, v in zip(batch, versions)})


def test_one_instance_gives_each_agent_the_rows_of_a_dedicated_one(tmp_path):
  served, built = {}, {}
  try:
    for shared in (False, True):
      orchestrator = built[shared] = build(_three(2, shared), str(tmp_path / f'shared{shared}'),
                                           **QUIET)
      # Each agent publishes its own adapter at its own version (planner 1, worker 2,
      # judge 3): a row's key and adapter are its agent's, whoever shares its batch.
      for k, name in enumerate(TEAM):
        agent = orchestrator.agents[name]
        agent.pool.publish(Weights(_trained(agent.trainer.params, seed=k), version=k + 1))
      results = orchestrator.rollout_engine.run(orchestrator.workflow,
                                        [orchestrator.query(i) for i in range(5)])
      served[shared] = {(g.query_id, g.call): g for r in results for g in r.served}
      assert len(orchestrator.rollout_engine.instances) == (1 if shared else 3)
    # the rollout: every group as its agent's dedicated instance served it
    assert served[True].keys() == served[False].keys()
    assert {g.agent for g in served[True].values()} == set(TEAM)
    for key, own in served[False].items():
      group = served[True][key]
      assert (group.agent, group.version) == (own.agent, TEAM.index(own.agent) + 1)
      for x, y in zip(group.tokens, own.tokens, strict=True):
        np.testing.assert_array_equal(x, y, err_msg=str(key))
      for x, y in zip(group.logprobs, own.logprobs, strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5, err_msg=str(key))
    # one batch mixing all three agents' rows (the rollout's batches mix them only as
    # timing allows): each agent's rows are its dedicated instance's
    prompts = {'judge': [1, 5, 6], 'planner': [1, 7], 'worker': [1, 3, 4, 8]}
    mixed, versions = _mixed_batch(built[True].rollout_engine.instances[0], built[True], prompts)
    assert versions == {a: TEAM.index(a) + 1 for a in TEAM}
    for agent in TEAM:
      own, _ = _mixed_batch(built[False].agents[agent].pool.instances[0], built[False],
                            {agent: prompts[agent]})
      np.testing.assert_array_equal(mixed[agent][0], own[agent][0], err_msg=agent)
      np.testing.assert_allclose(mixed[agent][1], own[agent][1], atol=1e-5, err_msg=agent)
      np.testing.assert_array_equal(mixed[agent][2], own[agent][2], err_msg=agent)
  finally:
    for orchestrator in built.values():
      orchestrator.close()
def test_pools_count_their_own_load_and_keep_a_shared_instance():
  """Two agents' pools hold one shared instance (and one a dedicated, busy one): each
  pool's load is its own agent's requests; a publish moves only its agent's version;
  the balancer's release never hands out the shared instance."""
  cfg = ModelConfig(vocab_size=20, layers=1, lora=LoRAConfig(rank=4, alpha=8.0))
  graphdef, state = nnx.split(Decoder(cfg, nnx.Rngs(params=0)))
  params = nnx.to_pure_dict(state)
  sampler = SharedAdapterSampler(graphdef, cfg.lora, {'a': Weights(params, 0),
                                                      'b': Weights(params, 0)},
                                 {'a': lambda p: p, 'b': lambda p: p}, max_prompt_len=4,
                                 eos_id=2, pad_id=0)
  shared = Instance('a+b/0', (0,), sampler)
  busy = Instance('a/1', (1,), sampler)
  busy.pending = object()  # a batch in flight
  a, b = InstancePool('a', [shared, busy], None), InstancePool('b', [shared], None)
  for agent, cost in (('a', 5), ('b', 7), ('b', 1)):
    shared.queue.append(Request(0, 'q', 0, agent, [1], 1, cost, None, []))
  assert (a.outstanding, b.outstanding, shared.outstanding) == (5, 8, 13)
  b.publish(Weights(_trained(params, seed=0), 4))
  assert (shared.version_of('a'), shared.version_of('b')) == (0, 4)
  assert a.release() is None and b.release() is None
  assert a.instances == [shared, busy]


def test_sync_and_flexmarl_agree_on_a_shared_instance(tmp_path):
  leaves = {}
  for schedule in ('sync', 'flexmarl'):
    workdir = str(tmp_path / schedule)
    train(_three(2, shared=True, schedule=schedule), workdir, **QUIET)
    leaves[schedule] = {a: jax.tree.leaves(_checkpoint(workdir, a, 2)['params']) for a in TEAM}
  for agent in TEAM:
    for x, y in zip(leaves['sync'][agent], leaves['flexmarl'][agent], strict=True):
      assert np.abs(x - y).max() <= 1e-5, (agent, np.abs(x - y).max())


def test_a_team_on_one_shared_instance_learns(tmp_path):
  """test_lora's team of a LoRA solver and verifier, on one instance."""
  c = _lora_team(steps=15)
  c.rollout.adapter_groups = [['solver', 'verifier']]
  workdir = str(tmp_path / 'run')
  train(c, workdir, **QUIET)
  metrics = read_metrics(os.path.join(workdir, 'metrics.jsonl'))
  of = lambda agent, key: [m[key] for m in metrics if m.get('agent') == agent and key in m]
  # As on dedicated instances: the verifier's accuracy from near 0 to about 0.5 (far
  # more than the noise of a 64-row batch); the solver's reward, from about 0.02, rises
  # more slowly (about 0.07 over the second half).
  accuracy = of('verifier', 'accuracy')
  first, last = np.mean(accuracy[:3]), np.mean(accuracy[-3:])
  assert first < 0.1 and last > first + 0.4, accuracy
  reward = of('solver', 'reward_mean')
  assert np.mean(reward[len(reward) // 2:]) > 2 * np.mean(reward[:3]), reward
  # rows sampled by the shared instance carry the trainer's own logprobs (on-policy)
  on_policy = [m['ratio_dev'] for m in metrics if m.get('staleness_max') == 0 and 'ratio_dev' in m]
  assert on_policy and max(on_policy) < 1e-4, on_policy
  with open(os.path.join(workdir, 'placement.json'), encoding='utf-8') as f:
    assert json.load(f)['adapter_groups'] == [['solver', 'verifier']]


def _spec(c, devices: int = 8):
  return build_team_spec(c, 20, list(range(devices)), list(TEAM))


@pytest.mark.quick
def test_placement_shows_who_shares_which_instance():
  c = _three(2, shared=True)
  c.rollout.devices = 'separate'
  c.agents.planner.rollout.instances = 2
  c.agents.worker.rollout.instances = c.agents.judge.rollout.instances = 2
  placement = _spec(c).placement
  # 3 training devices and the group's 2 instances: 5 devices, not 3 + 3 × 2
  # the group's first agent, then the others in config order (ConfigDict sorts its keys)
  assert placement.adapter_groups == (('planner', 'judge', 'worker'),)
  assert placement.fitted is None
  assert placement.rollout['worker'] == placement.rollout['planner'] == placement.rollout['judge']
  assert [m.devices for m in placement.rollout['planner']] == [(3,), (4,)]
  assert 'one adapter of planner, judge, worker on each' in placement.describe()
  assert type(placement).from_dict(placement.to_dict()) == placement


@pytest.mark.parametrize('change, needles', [
    (lambda c: setattr(c.rollout, 'adapter_groups', [['planner', 'critic']]),
     ['rollout.adapter_groups[0]', "['critic']"]),
    (lambda c: setattr(c.rollout, 'adapter_groups', [['planner', 'worker'], ['worker', 'judge']]),
     ['rollout.adapter_groups[1]', "'worker' is in group 0"]),
    (lambda c: setattr(c.agents.judge.model.lora, 'rank', 0),
     ['agents.judge.model.lora.rank=0', 'take it out of the group']),
    (lambda c: setattr(c.agents.judge.model, 'base_seed', -1),
     ['rollout.adapter_groups[0]', "'judge'", 'model.base_seed']),
    (lambda c: setattr(c.agents.judge.sampling, 'temperature', 0.5),
     ['rollout.adapter_groups[0]', 'sampling']),
    (lambda c: setattr(c.agents.judge.rollout, 'instances', 2),
     ['rollout.adapter_groups[0]', 'rollout.instances']),
    (lambda c: setattr(c.cluster, 'backend', 'ray'),
     ['rollout.adapter_groups', 'one process', 'cluster.backend=local']),
])
def test_bad_adapter_groups_are_refused(change, needles):
  c = _three(2, shared=True)
  change(c)
  with pytest.raises(ConfigError) as err:
    _spec(c)
  for needle in needles:
    assert needle in str(err.value), str(err.value)


@pytest.mark.extra('vllm')
def test_vllm_serves_a_group_from_the_first_agents_engines():
  """Under vLLM a group's agents share their first agent's engines: the run plans one
  engine per instance of the group, not one per agent."""
  from flexmarl.rollout import backends
  engines = lambda spec: backends.get('vllm').engine_demand(spec)[0]
  c = _three(2, shared=True)
  c.rollout.backend = 'vllm'
  for name in TEAM:
    c.agents[name].model.head_dim, c.agents[name].model.heads = 32, 2  # vLLM on CPU: >= 32
  spec = _spec(c)
  assert set(spec.placement.group_of('judge')) == set(TEAM)
  assert engines(spec) == spec.agents['planner'].instances
  c.rollout.adapter_groups = []
  assert engines(_spec(c)) == sum(spec.agents[n].instances for n in TEAM)
