"""Two agents train together end to end; the workdir holds what users rely on."""

import json
import os

import numpy as np
import ml_collections
import pytest

from flexmarl.config import agent_config, rollout_config
from flexmarl.run import train
from flexmarl.metrics.writer import read_metrics

REQUIRED = {'step', 'agent', 'reward_mean', 'reward_std', 'accuracy', 'policy_version',
            'tokens', 'step_time_s'}


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
  summary = train(two_agent_config(steps=60), workdir, log=lambda *_: None)
  return workdir, summary


def test_rewards_rise_for_both_agents(run):
  workdir, _ = run
  lines = read_metrics(os.path.join(workdir, 'metrics.jsonl'))
  for agent in ('solver', 'verifier'):
    r = [l['reward_mean'] for l in lines if l['agent'] == agent and l['updated']]
    assert np.mean(r[-8:]) > np.mean(r[:8]) + 0.2, (agent, r)


def test_workdir_contract(run):
  workdir, summary = run
  lines = read_metrics(os.path.join(workdir, 'metrics.jsonl'))
  assert {l['agent'] for l in lines} == {'solver', 'verifier', 'team'}
  for l in lines:
    assert REQUIRED <= set(l), set(l)
  steps = sorted({l['step'] for l in lines})
  assert steps == list(range(1, 61))
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
  for agent in ('solver', 'verifier'):
    ckpts = os.listdir(os.path.join(workdir, 'checkpoints', agent))
    assert '60' in ckpts, ckpts
  events = os.listdir(os.path.join(workdir, 'tensorboard'))
  assert any(e.startswith('events.out.tfevents') for e in events)
