"""The simulator runs the real orchestrator and schedules in simulated time: a case worked
out on paper gives the step time computed by hand, for every schedule."""

import json
import tempfile

import ml_collections
import pytest

from flexmarl.build import build_orchestrator
from flexmarl.core.clock import SimClock
from flexmarl.models.tokenizer import build_char_tokenizer
from flexmarl.sim.run import simulate
from flexmarl.sim.team import sim_factories, sim_team_spec, sim_workflow

# Router `a` then specialist `b`, one query at a time, one instance each; 2 queries fill
# both batches (group 2, global batch 4, micro-batch 2 = one group).
#   a: prompt BOS + 1 char = 2 tokens, answers 10 tokens -> generate 10 x 0.1 = 1.0 s;
#      micro-batch 2 rows x (2 + 10) tokens x 0.05 s = 1.2 s
#   b: prompt 2 + a's 10 chars = 12 tokens, answers 20 -> generate 2.0 s;
#      micro-batch 2 x (12 + 20) x 0.05 = 3.2 s
#   optimizer step 0.5 s each; a query takes 1.0 + 2.0 = 3 s, so the rollout takes 6 s.
# sync:          6 + (1.2 + 1.2 + 0.5) + (3.2 + 3.2 + 0.5)                  = 15.8
# sync_parallel: 6 + max(2.9, 6.9)                                           = 12.9
# flexmarl_no_pipeline: both batches are full at 6, each one micro-batch:
#                a 4 x 12 x 0.05 + 0.5 = 2.9, b 4 x 32 x 0.05 + 0.5 = 6.9 -> 12.9
# flexmarl:      query 0 ends at 3: a [3, 4.2], b [3, 6.2]; query 1 ends at 6:
#                a [6, 7.2] + step [7.2, 7.7]; b [6.2, 9.4] + step [9.4, 9.9] =  9.9
EXPECTED = {'sync': 15.8, 'sync_parallel': 12.9, 'flexmarl': 9.9,
            'flexmarl_no_pipeline': 12.9, 'flexmarl_no_balance': 9.9}


def _setup() -> ml_collections.ConfigDict:
  def agent(response: int, token_s: float) -> dict:
    return dict(rollout_tp=1, train_devices=1, instances=1, min_instances=1, group_size=2,
                prompt_tokens=dict(median=1, sigma=0.0, max=1),
                response_tokens=dict(median=response, sigma=0.0, max=response),
                rates=dict(decode_step_s=0.1, decode_token_s=0.0, prefill_token_s=0.0,
                           train_token_s=token_s, optimizer_s=0.5, sync_s=0.0))
  return ml_collections.ConfigDict(dict(
      seed=0, steps=1, cluster=dict(nodes=2, devices_per_node=4, accelerator='ascend-910c-die',
                                    rollout_nodes=1, train_nodes=1),
      global_batch=4, micro_batch=2, query_parallelism=1, branch_parallelism=1,
      balance_threshold=5, workflow=dict(router='a', specialists=['b'], zipf=1.0),
      agents=dict(a=agent(10, 0.05), b=agent(20, 0.05))))


@pytest.mark.quick
@pytest.mark.parametrize('variant', sorted(EXPECTED))
def test_step_time_is_the_one_computed_by_hand(variant):
  r = simulate(_setup(), variant)
  assert r.step_times == [pytest.approx(EXPECTED[variant])]
  assert r.rollout_times == [pytest.approx(6.0)] and r.queries == 2
  # Every schedule here is a chain of work with no wait on it: the bound is met.
  assert r.bounds == [pytest.approx(EXPECTED[variant])]
  # Training pool busy: a 2.9 s + b 6.9 s of 2 x the step's wall.
  assert r.utilization['train'] == pytest.approx(9.8 / (2 * EXPECTED[variant]))


def test_without_the_pipeline_each_agent_trains_once_its_own_batch_is_full():
  # b's batch is one group (global batch 2), a's two: b is full when query 0 ends at 3,
  # a when query 1 ends at 6.
  # flexmarl_no_pipeline (one micro-batch per update): b [3, 6.2] (2 x 32 x 0.05) +
  #   step [6.2, 6.7]; a [6, 8.4] (4 x 12 x 0.05) + step [8.4, 8.9]          =  8.9
  # sync_parallel (after the whole rollout): a 1.2 + 1.2 + 0.5, b 3.2 + 0.5  = 6 + 3.7 = 9.7
  # flexmarl: a [3, 4.2], [6, 7.2] + [7.2, 7.7]; b [3, 6.2] + [6.2, 6.7]       =  7.7
  setup = _setup()
  setup.agents.b.global_batch = 2
  expected = {'flexmarl_no_pipeline': 8.9, 'sync_parallel': 9.7, 'flexmarl': 7.7}
  for variant, step_s in expected.items():
    r = simulate(setup, variant)
    assert r.step_times == [pytest.approx(step_s)], variant
    assert r.rollout_times == [pytest.approx(6.0)], variant


def test_unknown_schedule_is_refused():
  with pytest.raises(ValueError, match='unknown schedule'):
    simulate(_setup(), 'fastest')


def test_one_shared_core_serializes_every_schedule():
  # All device work on one core: no overlap is left, every schedule takes the whole
  # work of the step, 6 s of rollout + 2.9 s + 6.9 s of training.
  setup = _setup()
  setup.shared_cores = 1
  for variant in ('sync', 'sync_parallel', 'flexmarl'):
    assert simulate(setup, variant).step_times == [pytest.approx(15.8)]


def test_this_machine_setup_simulates(tmp_path):
  from experiments.sim import this_machine
  rates = dict.fromkeys(this_machine.RATE_KEYS, 1e-3)
  (tmp_path / 'rates.json').write_text(json.dumps(dict(rates, contention=0.9)))
  setup = this_machine.get_config(f'json={tmp_path}/rates.json:mix=0.2,0.2,0.6')
  setup.steps = 3
  r = simulate(setup, 'flexmarl')
  # Each step ends once every batch is full or 96 queries were used.
  assert len(r.step_times) == 3 and 0 < r.queries <= 96
  with pytest.raises(ValueError, match='unknown keys'):
    this_machine.get_config('zipf=2')


def test_the_balancer_uses_the_setups_threshold():
  """Bug: the simulated team built with the paper's Δ = 5 whatever the setup says."""
  moves = {}
  for threshold in (2, 5, 1000):
    setup = _setup()
    setup.steps, setup.balance_threshold = 2, threshold
    for agent in ('a', 'b'):
      setup.agents[agent].instances = 2
    moves[threshold] = simulate(setup, 'flexmarl').rebalances
  assert moves[2] > moves[5] > moves[1000] == 0, moves


def test_async_steps_end_with_a_batch_at_the_post_update_version():
  """Bug: `async:k`'s rollout stopping once rows are fresh for the versions *before* this
  step's updates; rows one version too old then go stale, and the next step cannot update.

  Router a (batch 2) and specialists b (batch 4) and c (batch 2) on a skewed mix: b and c
  fill at different queries, so the others are served ahead and carry rows over."""
  setup = _setup()
  setup.steps = 8
  setup.agents.c = setup.agents.b.to_dict()
  setup.workflow.specialists = ['b', 'c']
  for agent, batch in (('a', 2), ('b', 4), ('c', 2)):
    setup.agents[agent].global_batch, setup.agents[agent].micro_batch = batch, 2
  tokenizer = build_char_tokenizer()
  spec = sim_team_spec(setup, 'async:1', False, tokenizer)
  clock = SimClock()
  with tempfile.TemporaryDirectory() as workdir:
    orch = build_orchestrator(spec, sim_workflow(setup), tokenizer, workdir, clock=clock,
                              factories=lambda _: sim_factories(spec, setup, clock, tokenizer))
    try:
      for step in range(1, setup.steps + 1):
        lines = orch.run_step()
        for name, agent in orch.agents.items():
          assert lines[name]['updated'] == int(step > 1), (step, name)
          fresh = orch.schedule.buffers[name].fresh_rows(agent.version)
          assert fresh >= spec.agents[name].global_batch, (step, name, fresh)
    finally:
      orch.close()
