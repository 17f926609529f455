"""The seam a remote backend plugs into: a team built by `build_team` from fake trainer,
sampler and checkpointer factories runs, checkpoints and resumes through the real
orchestrator, schedules, rollout engine and store, and every part sees what the
interfaces promise (versions, weights, batches)."""

import concurrent.futures
import dataclasses

import numpy as np
import pytest

from flexmarl.build import Factories, build_orchestrator, build_team
from flexmarl.config import build_team_spec
from flexmarl.core.clock import RealClock
from flexmarl.core.interfaces import Weights
from flexmarl.metrics.writer import TEAM
from flexmarl.models.tokenizer import build_char_tokenizer
from flexmarl.placement import plan as placement_lib
from flexmarl.rollout.sampler import SampleBatch
from flexmarl.workflows import build_workflow
from test_team import two_agent_config

TOK = build_char_tokenizer()


class CountingTrainer:
  """A trainer whose one parameter counts its optimizer steps (a step may be skipped:
  `step=False`, as for a solved batch without signal)."""

  batch_multiple = 1

  def __init__(self, name: str):
    self.name = name
    self.params = {'w': np.zeros((), np.float32)}
    self.rows: list[int] = []  # rows per optimizer step
    self.updates_seen: list[int] = []  # the `update` each micro-batch was accumulated at
    self._rows = self._tokens = 0

  def accumulate(self, batch, update: int = 0):
    self._rows += int(batch.rows)
    self._tokens += int(batch.tokens)
    self.updates_seen.append(update)
    return {}

  def dispatch_apply(self, step: bool = True):
    self.params = {'w': self.params['w'] + step}
    self.rows.append(self._rows)
    tokens, self._rows, self._tokens = self._tokens, 0, 0
    return lambda: {'loss': 0.0, 'trained_tokens': tokens}

  def train_state(self) -> dict:
    return {'params': dict(self.params)}

  def load_train_state(self, state: dict) -> None:
    self.params = dict(state['params'])


class DigitSampler:
  """Answers every prompt with '1' and EOS; keeps the weights it was given."""

  def __init__(self, weights: Weights):
    self.weights, self.version = weights, weights.version

  def submit(self, prompts, keys, params, limits=None):
    one = TOK.encode('1')[-1]
    tokens = np.array([[one, TOK.eos_id]] * len(prompts), np.int32)
    done = concurrent.futures.Future()
    done.set_result(SampleBatch(tokens, np.full(tokens.shape, -0.5, np.float32),
                                np.full(len(prompts), 2)))
    return done

  def update_weights(self, state, version):
    self.weights, self.version = Weights(state, version), version

  def close(self):
    pass


class MemoryCheckpointer:
  """Checkpoints kept in a dict (shared by the runs of one test, like a directory)."""

  def __init__(self, saved: dict, name: str):
    self.saved, self.directory = saved, f'memory:{name}'
    self.saved.setdefault(name, {})
    self.mine = self.saved[name]

  def steps(self):
    return sorted(self.mine)

  def save(self, step, train_state, meta):
    self.mine[step] = ({'params': dict(train_state['params'])}, dict(meta))

  def restore(self, step, like):
    return self.mine[step]

  def wait(self):
    pass


def _build(config, workdir, saved):
  workflow = build_workflow(config.workflow)
  spec = build_team_spec(config, TOK.vocab_size, range(8), workflow.agent_names())
  trainers, samplers = {}, []

  def trainer(name, a, mesh):
    trainers[name] = CountingTrainer(name)
    return trainers[name]

  def sampler(name, a, trainer):
    def make(devices, weights):
      samplers.append((name, DigitSampler(weights)))
      return samplers[-1][1]
    return make

  factories = Factories(trainer, sampler, lambda name: MemoryCheckpointer(saved, name))
  orch = build_orchestrator(spec, workflow, TOK, workdir, clock=RealClock(),
                            factories=lambda recorder: factories)
  return orch, spec, trainers, samplers


@pytest.mark.quick
def test_a_team_of_fake_parts_trains_publishes_and_resumes(tmp_path):
  config = two_agent_config(steps=2)
  config.checkpoint_every = 1
  saved = {}
  orch, spec, trainers, samplers = _build(config, str(tmp_path), saved)
  lines = []
  for _ in range(2):
    lines.append(orch.run_step())
    orch.save()
  orch.close()
  verifier = spec.agents['verifier']
  # The verifier fills its batch every step: two updates of exactly one global batch,
  # accumulated at versions 0 then 1, and its instances serve the second one's weights.
  assert [l['verifier']['updated'] for l in lines] == [1, 1]
  assert trainers['verifier'].rows == [verifier.global_batch] * 2
  micro = verifier.global_batch // verifier.micro_batch
  assert trainers['verifier'].updates_seen == [0] * micro + [1] * micro
  assert orch.agents['verifier'].version == 2
  for name, s in samplers:
    assert s.version == orch.agents[name].version
    assert float(s.weights.params['w']) == float(trainers[name].params['w'])
  # Step 1 runs to max_step_queries (6; the solver's 48 rows do not fill 64); step 2 ends
  # once both batches are full: the verifier's 64 rows after 4 queries.
  assert [l[TEAM]['queries'] for l in lines] == [6, 4]
  # The solver (48 rows a step, batch 64) carries its first step's rows over, untrained:
  # the first checkpoint names them; it trains at the second step.
  _, meta = saved['solver'][1]
  assert meta['version'] == 0 and sum(len(r['sample_ids']) for r in meta['buffer']) == 48
  _, meta = saved['solver'][2]
  assert meta['version'] == orch.agents['solver'].version == 1 and meta['buffer'] == []

  # A new process resumes from the checkpoints: versions and weights come back.
  config.steps = 3
  again, _, trainers2, samplers2 = _build(config, str(tmp_path), saved)
  assert again.restore(lambda *_: None) == 2
  assert {n: a.version for n, a in again.agents.items()} == \
      {n: a.version for n, a in orch.agents.items()}
  for name, s in samplers2:
    assert s.version == again.agents[name].version
    assert float(s.weights.params['w']) == float(trainers2[name].params['w'])
  again.run_step()
  again.close()
  assert trainers2['verifier'].updates_seen[0] == 2


def test_factories_without_a_training_pool_refuse_a_pooled_placement(tmp_path):
  """A backend that brings no training pool cannot run agents that take turns on one:
  the team is refused before any part is made."""
  config = two_agent_config(steps=1)
  workflow = build_workflow(config.workflow)
  spec = build_team_spec(config, TOK.vocab_size, range(8), workflow.agent_names())
  pooled = dataclasses.replace(spec.placement, pool=(placement_lib.MeshPlacement((0,), (1, 1)),))
  made = []
  factories = Factories(lambda *args: made.append(args), None, None)
  with pytest.raises(ValueError, match='training pool.*no training_pool factory'):
    build_team(spec, pooled, factories, {n: TOK.pad_id for n in spec.agents}, RealClock())
  assert not made


def test_every_part_is_closed_even_when_one_fails_or_the_restore_does(tmp_path):
  """`close` runs every part's close (the store's, the `on_close` hooks that stop Ray's
  workers) although an agent's raised; a run whose restore fails still closes them."""
  config = two_agent_config(steps=2)
  for run in ('a', 'b'):
    (tmp_path / run).mkdir()
  orch, _, _, _ = _build(config, str(tmp_path / 'a'), {})
  closed = []
  journal_close = orch.journal.close
  orch.journal.close = lambda: (journal_close(), closed.append('journal'))
  orch.on_close.append(lambda: closed.append('hook'))

  def broken():
    raise OSError('disk full')
  orch.agents['solver'].close = broken
  with pytest.raises(OSError, match='disk full'):
    orch.close()
  assert closed == ['journal', 'hook']

  orch, _, _, _ = _build(config, str(tmp_path / 'b'), {})
  orch.on_close.append(lambda: closed.append('after a failed restore'))

  def no_restore(log):
    raise RuntimeError('checkpoint unreadable')
  orch.restore = no_restore
  with pytest.raises(RuntimeError, match='unreadable'):
    orch.run(lambda *_: None)
  assert closed == ['journal', 'hook', 'after a failed restore']
