"""The command line and the library, as a user runs them (subprocesses)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import FAST_COMPILE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu',
           XLA_FLAGS=f'--xla_force_host_platform_device_count=8 {FAST_COMPILE}')

# A user's workflow in their own module, and an experiment file that names it.
FLOWS = '''
from flexmarl import tasks
from flexmarl.workflows.base import Episode, Query


class Successor:
  """One agent names the letter after the one it is shown."""

  def __init__(self, agent, alphabet):
    self.agent, self.alphabet = agent, alphabet

  def agent_names(self):
    return [self.agent]

  def make_query(self, rng, query_id):
    t = tasks.successor(rng, alphabet=self.alphabet)
    return Query(query_id, t.prompt, t.answer)

  async def run(self, query, agents):
    episode = Episode()
    for c in await agents[self.agent].generate(query.prompt):
      episode.score(c, float(c.text == query.answer), correct=c.text == query.answer)
    return episode
'''

EXPERIMENT = '''
import ml_collections
from flexmarl.config import agent_config


def get_config():
  c = ml_collections.ConfigDict()
  c.seed, c.steps, c.schedule, c.tokenizer = 0, 2, 'sync', 'char'
  c.max_prompt_len, c.checkpoint_every = 4, 2
  c.workflow = dict(name='my_flows:Successor', agent='namer', alphabet=4)
  c.rollout = dict(query_concurrency=2, max_step_queries=2, devices='shared')
  c.agents = dict(namer=agent_config('tiny', group_size=4, global_batch=8, micro_batch=8,
                                     sampling=dict(temperature=1.0, top_p=1.0,
                                                   max_new_tokens=2)))
  return c
'''


def _run(args, cwd, timeout=240):
  return subprocess.run([sys.executable, *args], cwd=cwd, env=ENV, capture_output=True,
                        text=True, timeout=timeout)


def test_user_workflow_trains_from_the_command_line(tmp_path):
  (tmp_path / 'my_flows.py').write_text(FLOWS)
  (tmp_path / 'exp.py').write_text(EXPERIMENT)
  out = _run(['-m', 'flexmarl.main', '--config=exp.py', '--workdir=run'], cwd=tmp_path)
  assert out.returncode == 0, out.stderr[-3000:]
  assert 'I1' not in out.stderr, 'library INFO lines must stay out of the output'
  lines = [json.loads(l) for l in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()]
  assert {l['step'] for l in lines} == {1, 2}
  assert sum(l['updated'] for l in lines if l['agent'] == 'namer') == 2
  owner = json.loads((tmp_path / 'run' / 'run.json').read_text())
  assert owner == {'workflow': 'my_flows:Successor', 'experiment': 'exp.py'}


@pytest.mark.quick
def test_a_missing_workflow_module_names_the_path_searched(tmp_path):
  (tmp_path / 'exp.py').write_text(EXPERIMENT)
  out = _run(['-m', 'flexmarl.main', '--config=exp.py', '--workdir=run'], cwd=tmp_path)
  assert out.returncode != 0
  assert "cannot import module 'my_flows'" in out.stderr and 'sys.path' in out.stderr
  assert 'Traceback' not in out.stderr
  assert str(tmp_path) in out.stderr  # the folder searched
  assert not (tmp_path / 'run').exists()


SCRIPT = '''
"""A user's own absl entry point that uses FlexMARL as a library."""
from absl import app, flags
from ml_collections import config_flags

from flexmarl import run  # must not define flags of its own

_CONFIG = config_flags.DEFINE_config_file('config', None, 'My experiment.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'My workdir.')
_TRAIN = flags.DEFINE_bool('train', True, 'Train, or only print the schedules.')


def main(argv):
  c = _CONFIG.value
  if not _TRAIN.value:
    agent = next(iter(c.agents.values()))
    print('schedules', c.steps, agent.optimizer.decay_steps, agent.grpo.entropy_decay_steps)
    return
  run.train(c, _WORKDIR.value, log=lambda *_: None)
  print('trained')


app.run(main)
'''


def test_a_script_with_its_own_flags_uses_the_library(tmp_path):
  (tmp_path / 'my_flows.py').write_text(FLOWS)
  (tmp_path / 'exp.py').write_text(EXPERIMENT)
  (tmp_path / 'script.py').write_text(SCRIPT)
  out = _run(['script.py', '--config=exp.py', f'--workdir={tmp_path}/run',
              '--config.steps=1'], cwd=tmp_path)
  assert out.returncode == 0 and 'trained' in out.stdout, out.stderr[-3000:]
  assert 'I1' not in out.stderr  # quiet logging in library use too
  # `--config.steps` reaches the config; the experiments tie no schedule to it.
  out = _run(['script.py', f'--config={ROOT}/experiments/hierarchical_assistant.py',
              '--config.steps=300', '--notrain'], cwd=tmp_path)
  assert 'schedules 300 0 0' in out.stdout, out.stderr[-3000:]


@pytest.mark.parametrize('config,needles', [
    ('missing.py', ['--config=missing.py: cannot load it', 'No such file', 'Fix:']),
    ('raises.py', ['--config=raises.py: the experiment file raised KeyError', 'Fix:']),
    ('exp.py --config.steps=1.5', ['--config.steps=1.5', "field's type"]),
    ('exp.py --config.nonsense=1', ['nonsense', 'Fix:']),
])
def test_bad_config_files_and_flags_say_the_fix(tmp_path, config, needles):
  (tmp_path / 'exp.py').write_text(EXPERIMENT)
  (tmp_path / 'raises.py').write_text('def get_config():\n  return {}["lr"]\n')
  out = _run(['-m', 'flexmarl.main', f'--config={config.split()[0]}', '--workdir=run',
              *config.split()[1:]], cwd=tmp_path, timeout=60)
  assert out.returncode != 0
  for needle in needles:
    assert needle in out.stderr, out.stderr[-2000:]
  assert 'Traceback' not in out.stderr
  assert not (tmp_path / 'run').exists()


def test_export_prints_no_orbax_info_lines(tmp_path):
  """`python -m flexmarl.export` prints what it wrote, not Orbax's INFO lines about every
  restore step; `--verbosity=0` brings them back."""
  import jax
  import ml_collections

  from flexmarl import config as config_lib
  from flexmarl.models import sharding
  from flexmarl.models.tokenizer import build_char_tokenizer
  from flexmarl.train.checkpoint import AgentCheckpointer
  from flexmarl.train.trainer import AgentTrainer
  tok = build_char_tokenizer()
  config = ml_collections.ConfigDict(dict(seed=0, agents=dict(solver=config_lib.agent_config('tiny'))))
  (tmp_path / 'config.json').write_text(config.to_json_best_effort())
  tok.save(str(tmp_path / 'tokenizer'))
  spec = config_lib.agent_spec(config, 'solver', tok.vocab_size)
  trainer = AgentTrainer('solver', spec.model, spec.optimizer, spec.grpo,
                         sharding.make_mesh(jax.devices()[:1], (1, 1)), seed=0)
  checkpointer = AgentCheckpointer(str(tmp_path), 'solver')
  checkpointer.save(3, trainer.train_state(), {'step': 3})
  checkpointer.wait()
  checkpointer.close()
  out = _run(['-m', 'flexmarl.export', str(tmp_path), 'solver', str(tmp_path / 'hf')], ROOT)
  assert out.returncode == 0, out.stderr[-3000:]
  assert f'wrote {tmp_path / "hf"}' in out.stdout
  assert 'I1' not in out.stderr and 'checkpoint' not in out.stderr, out.stderr[-2000:]
  out = _run(['-m', 'flexmarl.export', str(tmp_path), 'solver', str(tmp_path / 'hf2'),
              '--verbosity=0'], ROOT)
  assert out.returncode == 0 and 'Restoring checkpoint' in out.stderr
