"""The real TrainingEngine runs the simulated training pool: more agents than meshes,
bound by `allocate`, released to host memory and, past the host budget, to storage by
`evict_lru`, every swap a state's bytes over a link; the step times worked out on paper,
for every schedule.

The engine treats the simulated copies as it does the real ones: a bind blocks its caller
until the state is on the mesh; a release (on a copy thread in a real run) does not: its
copy starts once the work on the mesh is done and occupies the mesh's link, while the
next agent computes there; a prefetch overlaps the resident's compute. (With the
trainers' `overlapped_swaps`, as the paper's engine, binds do not block either.)"""

import asyncio
import tempfile

import ml_collections
import pytest

from flexmarl.build import build_orchestrator
from flexmarl.core.clock import SimClock
from flexmarl.core.errors import ConfigError
from flexmarl.metrics.writer import TEAM
from flexmarl.models.tokenizer import build_char_tokenizer
from flexmarl.sim.devices import DeviceGroup
from flexmarl.sim.team import sim_factories, sim_team_spec
from flexmarl.sim.trainer import Link, SimMesh, SimTrainer
from flexmarl.sim.workflow import FILLER, RouterWorkflow
from flexmarl.train.engine import TrainingEngine
from flexmarl.train.pool_meshes import PoolMesh, inline
from flexmarl.train.state import InStorage, OnHost, OnMesh
from flexmarl.workflows.base import Episode, Query

AGENTS = ('a', 'b', 'c')
# Every agent answers every query at once, 10 tokens at 0.1 s a decode step: a query
# takes Q; one at a time, 2 queries fill every batch (group 2, global batch 4, micro-batch
# 2 = one group). A micro-batch is 2 rows x (2 prompt + 10 response tokens) = 24 tokens.
Q = 10 * 0.1
A, B, C = 24 * 0.05, 24 * 0.1, 24 * 0.05  # a micro-batch of each agent
OPT = 0.5  # an optimizer step
S = 1e9 / 1e9  # a swap: a 1 GB state over a mesh's host link of 1 GB/s (one device)
W = 1e9 / 0.5e9  # a state written to storage at 0.5 GB/s

EXPECTED = {
    # The rollout begins at 0 and every agent expects to train: a's state is prefetched
    # onto pool0 and b's onto pool1 [0, S], behind the rollout (2Q); c's waits (no mesh
    # is left without a state on its way). a binds pool0 at 2Q (its copy is there) and
    # trains 2A + OPT; once a is bound, c's state is prefetched onto pool0 (a's
    # mesh: pool1 is b's). b takes its copy on pool1 and trains 2B + OPT; c takes pool0
    # (its copy there since 2Q + S) and trains 2C + OPT, while a's copy out runs behind:
    # no swap in the way (before the rollout's start prefetched: three; before the
    # copies out ran off the caller's thread: six).
    # Step 2: c and b still on the meshes; a's state, in pool0's host memory, is
    # prefetched onto pool0 during the rollout. a takes pool0 and c, which trains later
    # in the step, stays on it; b trains in place; c binds pool0 again with nothing to
    # copy (a's copy out goes behind): again no swap in the way.
    'sync': [2 * Q + (2 * A + OPT) + (2 * B + OPT) + (2 * C + OPT),
             2 * Q + (2 * A + OPT) + (2 * B + OPT) + (2 * C + OPT)],
    # As under sync, a and b take their prefetched copies at 2Q: a trains 2A + OPT on
    # pool0, b 2B + OPT on pool1, and c's state is prefetched onto pool0 meanwhile. c's
    # step is urgent: a's copy out waits for a's work and does not hold up c, whose
    # state is there already: c's work follows a's, 2C + OPT. c ends last.
    'sync_parallel': [max(2 * Q + (2 * B + OPT),
                          2 * Q + (2 * A + OPT) + (2 * C + OPT))],
    # a's and b's states are prefetched at 0, behind query 0. Query 0 ends at Q: a
    # binds pool0 and b pool1 without waiting, their micro-batches start (A, B), and
    # c's state is prefetched onto pool0; c's micro-batch waits (no mesh without a
    # state, and a micro-batch is not worth a swap). No bind held up the rollout:
    # query 1 ends at 2Q. a's second micro-batch follows its first, then its step; b's
    # end before c's. c's step is urgent: a's copy out waits for a's work and overlaps
    # c's; c's state is on pool0 already: c's two micro-batches and step follow a's
    # work at once.
    'flexmarl': [Q + (2 * A + OPT) + (2 * C + OPT)],
}
SWAPS = {'sync': dict(a=2, b=1, c=1), 'sync_parallel': dict(a=2, b=1, c=1),
         'flexmarl': dict(a=2, b=1, c=1)}  # in the first step
MESHES = {'sync': 'pool0', 'sync_parallel': 'pool0', 'flexmarl': 'pool0'}  # a's


class EveryAgentAnswers:
  """Each query is answered by every agent at once (one instance each)."""

  def agent_names(self):
    return list(AGENTS)

  def make_query(self, rng, query_id):
    return Query(query_id, FILLER)

  async def run(self, query, agents):
    episode = Episode()
    for completions in await asyncio.gather(*(agents[n].generate(query.prompt)
                                              for n in AGENTS)):
      RouterWorkflow._score(episode, completions)
    return episode


def _setup(steps: int = 1, host_budget: int = 0) -> ml_collections.ConfigDict:
  def agent(train_token_s: float) -> dict:
    return dict(rollout_tp=1, train_devices=1, instances=1, min_instances=1, group_size=2,
                state_bytes=int(1e9), prompt_tokens=dict(median=1, sigma=0.0, max=1),
                response_tokens=dict(median=10, sigma=0.0, max=10),
                rates=dict(decode_step_s=0.1, decode_token_s=0.0, prefill_token_s=0.0,
                           train_token_s=train_token_s, optimizer_s=OPT, sync_s=0.0))
  return ml_collections.ConfigDict(dict(
      seed=0, steps=steps, cluster=dict(nodes=2, devices_per_node=4,
                                        accelerator='ascend-910c-die', rollout_nodes=1,
                                        train_nodes=1),
      training_meshes=2, host_budget_bytes=host_budget,
      links=dict(host_bytes_per_s_per_device=1e9, storage_bytes_per_s=0.5e9),
      global_batch=4, micro_batch=2, query_parallelism=1, branch_parallelism=1,
      balance_threshold=5, workflow=dict(router='a', specialists=['b', 'c'], zipf=1.0),
      agents=dict(a=agent(0.05), b=agent(0.1), c=agent(0.05))))


def _run(setup, schedule):
  """The metrics lines of each step, and the team."""
  tokenizer = build_char_tokenizer()
  spec = sim_team_spec(setup, schedule, False, tokenizer)
  clock = SimClock()
  with tempfile.TemporaryDirectory() as workdir:
    orch = build_orchestrator(spec, EveryAgentAnswers(), tokenizer, workdir, clock=clock,
                              factories=lambda _: sim_factories(spec, setup, clock, tokenizer))
    try:
      lines = [orch.run_step() for _ in range(setup.steps)]
    finally:
      orch.close()
  return lines, orch.agents


@pytest.mark.quick
@pytest.mark.parametrize('schedule', sorted(EXPECTED))
def test_three_agents_on_two_meshes_step_times_by_hand(schedule):
  expected = EXPECTED[schedule]
  lines, _ = _run(_setup(steps=len(expected)), schedule)
  assert [l[TEAM]['step_time_s'] for l in lines] == pytest.approx(expected, abs=1e-9)
  assert {n: lines[0][n]['swaps'] for n in AGENTS} == SWAPS[schedule]
  assert all(lines[0][n]['swap_bytes'] == SWAPS[schedule][n] * 1e9 for n in AGENTS)
  assert all(lines[0][n]['swap_s'] == pytest.approx(SWAPS[schedule][n] * S) for n in AGENTS)
  assert lines[0]['a']['meshes'] == MESHES[schedule]


def test_host_budget_sends_the_least_recently_used_state_to_storage():
  # sync, as above, with host memory for one state: when c takes pool0, a (going out)
  # and c (waiting, kept) are on the host; a, the least recently used, is written to
  # storage (W) after its copy out (S), on links, while c trains: the step ends with c's
  # step, as without a budget (the write ends S + W - (2C + OPT) = 0.1 s after it, in
  # the next rollout, which does not need it).
  lines, agents = _run(_setup(host_budget=int(1.5e9)), 'sync')
  assert lines[0][TEAM]['step_time_s'] == pytest.approx(EXPECTED['sync'][0], abs=1e-9)
  assert isinstance(agents['a'].trainer.state.location, InStorage)
  assert lines[0]['a']['swaps'] == 3
  assert lines[0]['a']['swap_s'] == pytest.approx(2 * S + W)
  [evicted] = [s for s in agents['a'].training_engine.log if s['target'] == 'storage']
  assert evicted['agent'] == 'a' and evicted['source'] == 'host'


def test_host_budget_without_storage_is_refused():
  setup = _setup(host_budget=int(1.5e9))
  setup.links.storage_bytes_per_s = 0.0
  with pytest.raises(ConfigError, match='links.storage_bytes_per_s=0.0'):
    _run(setup, 'sync')


def _pool(clock, meshes, storage_bytes_per_s=0.0, overlapped_swaps=False):
  """Trainers a, b, c of 1 GB states on `meshes` one-device meshes (links of 1 GB/s)."""
  sim = {f'pool{i}': SimMesh(DeviceGroup(clock, f'train/pool{i}'),
                             Link(DeviceGroup(clock, f'link/pool{i}'), 1e9))
         for i in range(meshes)}
  storage = (Link(DeviceGroup(clock, 'link/storage'), storage_bytes_per_s)
             if storage_bytes_per_s else None)
  trainers = {n: SimTrainer(n, clock, 0.0, 0.0, group=None, state_bytes=int(1e9),
                            storage=storage, overlapped_swaps=overlapped_swaps)
              for n in AGENTS}
  return trainers, [PoolMesh(name, (i,), (1, 1)) for i, name in enumerate(sim)], sim


def test_waiting_agent_is_prefetched_while_the_resident_computes():
  # Work of 2 s for a, b and c at once, two meshes. a in on pool0 [0, 1], b in on pool1
  # [1, 2] (binds wait for their copies); c, unserved, is prefetched onto pool0 [2, 3];
  # a and b work [2, 4]. c takes pool0 at 2: a's copy out waits for a's work [4, 5] and
  # not the caller; c's bind waits for its prefetch (2 -> 3), and c works right after a
  # [4, 6] (with the copy out blocking the caller: c works [5, 7]).
  clock = SimClock()
  trainers, meshes, sim = _pool(clock, 2)
  engine = TrainingEngine(trainers, meshes, clock=clock,
                          make_mesh=lambda mesh, layout: sim[mesh.name], make_executor=inline)
  ends = {}
  for n in AGENTS:
    engine.submit(n, lambda n=n: ends.setdefault(n, trainers[n].group.run('work', 2.0)))
  engine.run()
  assert ends == dict(a=4.0, b=4.0, c=6.0)
  assert clock.now() == 3.0
  assert sim['pool0'].host.group.busy_until == 5.0  # a's copy out
  stats = engine.step_stats('c')
  assert stats['swaps'] == 1 and stats['swap_s'] == 1.0 and stats['swap_wait_s'] == 1.0
  assert engine.step_stats('a')['swap_wait_s'] == 1.0  # its bind; its copy out: none
  assert isinstance(trainers['a'].state.location, OnHost)
  assert trainers['c'].state.location == OnMesh(sim['pool0'], {})


def test_overlapped_swaps_return_at_once_and_hold_back_only_the_mesh():
  # As above, with swaps that do not block the caller (the paper's engine): nothing
  # advances the clock. a in on pool0 [0, 1], b in on pool1 [0, 1] (links of their own);
  # c is prefetched onto pool0 after a's copy [1, 2]; a and b work [1, 3]. c takes
  # pool0: a's copy out waits for a's work [3, 4], c's state is there already and c
  # works right after a [3, 5] (two states fit on a mesh).
  clock = SimClock()
  trainers, meshes, sim = _pool(clock, 2, overlapped_swaps=True)
  engine = TrainingEngine(trainers, meshes, clock=clock,
                          make_mesh=lambda mesh, layout: sim[mesh.name], make_executor=inline)
  ends = {}
  for n in AGENTS:
    engine.submit(n, lambda n=n: ends.setdefault(n, trainers[n]._run('work', 2.0)))
  engine.run()
  assert ends == dict(a=3.0, b=3.0, c=5.0)
  assert clock.now() == 0.0
  assert sim['pool0'].host.group.busy_until == 4.0  # a's copy out
  assert isinstance(trainers['a'].state.location, OnHost)


def test_pool_sends_least_recently_used_states_to_storage():
  # One mesh, a, b, c, a in turn, each piece of work 1 s; host memory holds one state,
  # the host link moves 1 GB/s, storage 0.5 GB/s. Every state starts on the host.
  # Copies out and to storage do not block the caller; a state's next copy waits for
  # its last one; binds block.
  # a: in [0, 1] (the caller waits: 1), works [1, 2].
  # b: a out after a's work [2, 3]; a (on its way), b (kept: it waits) and c on the host
  #    exceed the budget: c, then a go to storage [1, 3], [3, 5] (a's after its copy
  #    out); b in after a's copy out on the mesh's link [3, 4] (caller at 4), works [4, 5].
  # c: b out [5, 6]; c in from storage [6, 8] (caller at 8), works [8, 9].
  # a: c out [9, 10]; b (older than c) to storage [8, 10]; a in from storage after c's
  #    copy out [10, 12] (caller at 12), works [12, 13].
  clock = SimClock()
  trainers, meshes, sim = _pool(clock, 1, storage_bytes_per_s=0.5e9)
  engine = TrainingEngine(trainers, meshes, host_budget=int(1.5e9), storage_dir='swap',
                          clock=clock, make_mesh=lambda mesh, layout: sim[mesh.name], make_executor=inline)
  ends = []
  for name in 'abca':
    engine.submit(name, lambda name=name: ends.append(trainers[name].group.run('work', 1.0)))
    engine.run()
  assert ends == [2.0, 5.0, 9.0, 13.0]
  assert clock.now() == 12.0
  where = {n: type(t.state.location) for n, t in trainers.items()}
  assert where == dict(a=OnMesh, b=InStorage, c=OnHost)
  assert trainers['b'].state.location == InStorage('swap/b')
  stats = engine.step_stats('a')
  assert stats['swaps'] == 4 and stats['swap_s'] == pytest.approx(1 + 1 + 2 + 2)
  assert stats['meshes'] == 'pool0'


def test_expected_agents_are_prefetched_and_stay_on_the_mesh_they_come_back_to():
  # One mesh; a, b, c will train (`expect`); work of 1 s each: a's first piece, b's
  # (urgent: its last), a's second (urgent), c's (urgent). A swap takes 1 s.
  # expect, at 0: a's state is prefetched onto the idle mesh [0, 1]; b and c wait
  #   (one prefetch per mesh).
  # At 2, a binds without waiting (its copy is there) and works [2, 3]; b's state is
  #   prefetched at once [2, 3].
  # b takes the mesh: a, still expected, stays on it (nothing is copied out; the mesh
  #   holds two states, as during a prefetch), so c cannot be prefetched there. b's bind
  #   waits for its copy (clock 3); b works [3, 4].
  # a binds again with nothing to copy; b, done for now, is copied out after its work
  #   [4, 5]; a works [4, 5]; c's state is prefetched behind b's copy out [5, 6].
  # c takes the mesh: a, done for now, is copied out after the link's copies [6, 7];
  #   c's bind waits for its copy (clock 6); c works [6, 7].
  clock = SimClock()
  trainers, meshes, sim = _pool(clock, 1)
  engine = TrainingEngine(trainers, meshes, clock=clock,
                          make_mesh=lambda mesh, layout: sim[mesh.name], make_executor=inline)
  for n in AGENTS:
    engine.expect(n)
  assert sim['pool0'].host.group.busy_until == 1.0  # a's prefetch, alone
  clock.advance_to(2.0)
  ends = []

  def work(name, urgent):
    engine.submit(name, lambda: ends.append(trainers[name].group.run('work', 1.0)))
    engine.run((name,) if urgent else ())
  work('a', urgent=False)
  assert clock.now() == 2.0 and sim['pool0'].host.group.busy_until == 3.0  # b's prefetch
  work('b', urgent=True)
  assert trainers['a'].state.location == OnMesh(sim['pool0'], {})  # left on the mesh
  assert sim['pool0'].host.group.busy_until == 3.0  # and nothing else on its way
  work('a', urgent=True)
  work('c', urgent=True)
  assert ends == [3.0, 4.0, 5.0, 7.0]
  assert clock.now() == 6.0
  assert sim['pool0'].host.group.busy_until == 7.0  # a's copy out
  assert trainers['c'].state.location == OnMesh(sim['pool0'], {})
  a, b, c = (engine.step_stats(n) for n in AGENTS)
  assert (a['swaps'], a['swap_wait_s']) == (2, 0.0)  # one bind (prefetched), one copy out
  assert (b['swaps'], b['swap_wait_s']) == (2, 1.0)
  assert (c['swaps'], c['swap_wait_s']) == (1, 3.0)


def test_one_state_per_mesh_waits_for_the_copy_out_and_prefetches_onto_empty_meshes_only():
  # As above with `states_per_mesh=1`: the mesh never holds two states.
  # expect, at 0: a's state is prefetched onto the empty mesh [0, 1].
  # At 2, a binds (its copy is there) and works [2, 3]; nothing else is prefetched.
  # b takes the mesh: a, though expected, is copied out after its work [3, 4] and b's
  #   bind waits for that copy, then for its own [4, 5] (clock 5); b works [5, 6].
  # a comes back: b's copy out [6, 7], a's copy in [7, 8] (clock 8); a works [8, 9].
  clock = SimClock()
  trainers, meshes, sim = _pool(clock, 1)
  engine = TrainingEngine(trainers, meshes, clock=clock, states_per_mesh=1,
                          make_mesh=lambda mesh, layout: sim[mesh.name], make_executor=inline)
  for n in AGENTS:
    engine.expect(n)
  clock.advance_to(2.0)
  ends = []
  for name, urgent in (('a', False), ('b', True), ('a', True)):
    engine.submit(name, lambda name=name: ends.append(trainers[name].group.run('work', 1.0)))
    engine.run((name,) if urgent else ())
    if name == 'a' and not urgent:
      assert sim['pool0'].host.group.busy_until == 1.0  # b was not prefetched
  assert ends == [3.0, 6.0, 9.0]
  assert clock.now() == 8.0
  assert isinstance(trainers['b'].state.location, OnHost)
  assert engine.step_stats('a')['swaps'] == 3  # in, out, in: never left on the mesh
