"""Two agents train together end to end; the workdir holds what users rely on."""

import json
import os

import numpy as np
import ml_collections
import pytest

from flexmarl.config import agent_config, rollout_config
from flexmarl.metrics.writer import read_metrics
from flexmarl.run import train

STEPS = 80  # enough for both agents' rewards to rise by well over 0.2
REQUIRED = {'step', 'agent', 'reward_mean', 'reward_std', 'accuracy', 'tokens',
            'step_time_s'}


def two_agent_config(steps: int) -> ml_collections.ConfigDict:
  """A solver (a+b, a,b <= 2) and a verifier that says y/n to each of its answers."""
  c = ml_collections.ConfigDict()
  c.seed, c.steps, c.schedule, c.tokenizer = 0, steps, 'sync', 'char'
  c.max_prompt_len, c.checkpoint_every = 8, 5
  c.workflow = dict(name='solver_verifier', solver='solver', verifier='verifier', family='add',
                    task_args={'max_operand': 2})
  # At most 6 queries a step: the verifier (96 rows, batch 64) trains every step; the
  # solver (48 rows, batch 64) every other step, carrying rows over in between.
  c.rollout = rollout_config(query_concurrency=6, max_step_queries=6)
  grpo = dict(clip_eps=0.2, kl_coef=0.0, entropy_coef=0.1, entropy_decay_steps=0,
              normalize_std=True)
  c.agents = dict(
      solver=agent_config('tiny', group_size=8, global_batch=64, micro_batch=16,
                          sampling=dict(temperature=1.0, top_p=1.0, max_new_tokens=2), grpo=grpo),
      verifier=agent_config('tiny', group_size=2, global_batch=64, micro_batch=32,
                            sampling=dict(temperature=1.0, top_p=1.0, max_new_tokens=2),
                            grpo=grpo))
  return c


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('team'))
  summary = train(two_agent_config(steps=STEPS), workdir, log=lambda *_: None)
  return workdir, summary


def test_rewards_rise_for_both_agents(run):
  workdir, _ = run
  lines = read_metrics(os.path.join(workdir, 'metrics.jsonl'))
  for agent in ('solver', 'verifier'):
    r = [l['reward_mean'] for l in lines if l['agent'] == agent and l['updated']]
    assert np.mean(r[-8:]) > np.mean(r[:8]) + 0.2, (agent, r)


@pytest.mark.quick
def test_workdir_contract(run):
  workdir, summary = run
  lines = read_metrics(os.path.join(workdir, 'metrics.jsonl'))
  assert {l['agent'] for l in lines} == {'solver', 'verifier', 'team'}
  for l in lines:
    assert REQUIRED <= set(l), set(l)
    # an agent's lines carry its version; the team has none (a step is a step)
    assert ('policy_version' in l) == (l['agent'] != 'team'), l
  steps = sorted({l['step'] for l in lines})
  assert steps == list(range(1, STEPS + 1))
  # versions count the agent's own updates: +1 for each step it updated
  solver = [l for l in lines if l['agent'] == 'solver']
  assert [l['policy_version'] for l in solver] == list(
      np.cumsum([0] + [l['updated'] for l in solver[:-1]]))
  assert [l['updated'] for l in solver[:4]] == [0, 1, 0, 1]  # 48 rows, 96 → 64 (+32 dropped)
  assert [l['rows'] for l in solver[:4]] == [48, 64, 48, 64]
  assert all(l['updated'] for l in lines if l['agent'] == 'verifier')
  with open(os.path.join(workdir, 'summary.json')) as f:
    assert json.load(f) == json.loads(json.dumps(summary))
  assert set(summary['agents']) == {'solver', 'verifier'}
  assert summary['tokens_per_s'] > 0
  # The workflow gives expected answers: each update's line weighs the accuracy against
  # the best constant answer's, and the summary keeps its last window.
  for l in lines:
    if l['agent'] != 'team' and l['updated']:
      assert 0 < l['best_constant'] <= 1, l
      assert l['above_constant'] == pytest.approx(l['accuracy'] - l['best_constant'], abs=1e-6)
  for agent in ('solver', 'verifier'):
    assert 0 < summary['agents'][agent]['last_best_constant'] <= 1
  for agent in ('solver', 'verifier'):
    ckpts = os.listdir(os.path.join(workdir, 'checkpoints', agent))
    assert str(STEPS) in ckpts, ckpts
  events = os.listdir(os.path.join(workdir, 'tensorboard'))
  assert any(e.startswith('events.out.tfevents') for e in events)


def test_trace_utilization_and_plots_of_a_real_run(run):
  """The run's trace loads as Trace Event JSON (what Perfetto reads), has a track per
  training mesh, rollout instance and store table, and utilization adds up."""
  import matplotlib.image

  from flexmarl.plot import plot_workdir
  workdir, summary = run
  with open(os.path.join(workdir, 'trace.json')) as f:
    events = json.load(f)
  named = {(e['pid'], e.get('tid')): e['args']['name'] for e in events if e['ph'] == 'M'}
  spans = [e for e in events if e['ph'] == 'X']
  for e in spans:
    assert {'name', 'ph', 'ts', 'dur', 'pid', 'tid', 'args'} <= set(e) and e['dur'] >= 0
    assert (e['pid'], e['tid']) in named and (e['pid'], 0) in named
  tracks = set(named.values())
  for agent in ('solver', 'verifier'):
    assert {f'train:{agent}', f'rollout:{agent}/0', f'store:{agent}'} <= tracks
  kinds = {e['cat'] for e in spans}
  assert {'generate', 'micro_batch', 'optimizer_step', 'weight_sync', 'store_write'} <= kinds
  assert {e['args']['step'] for e in spans if e['cat'] == 'generate'} == set(range(1, STEPS + 1))
  groups = summary['utilization']['groups']
  assert {'train:solver', 'rollout:verifier'} <= set(groups)
  for g in groups.values():
    assert abs(g['busy_s'] + g['idle_s'] - g['wall_s']) < 1e-6 and 0 < g['utilization'] <= 1
  team = [l for l in read_metrics(os.path.join(workdir, 'metrics.jsonl')) if l['agent'] == 'team']
  util = [l['util/train:solver'] for l in team if 'util/train:solver' in l]
  assert len(util) >= STEPS - 1 and all(0 <= u <= 1 for u in util)  # from its first update
  for path in plot_workdir(workdir):
    image = matplotlib.image.imread(path)
    assert image.shape[0] > 100 and image.std() > 0.01, path
