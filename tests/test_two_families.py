"""A team of two model families, each agent LoRA adapters on its own checkpoint with the
tokenizer that checkpoint carries: a Llama-layout solver and a Qwen2-layout verifier
(q/k/v biases, tied embeddings) whose character tokenizers give every character other ids
and have different sizes. Trained, checkpointed, resumed, evaluated on held-out problems
and exported, each agent through its own tokenizer."""

import json
import os

import ml_collections
import numpy as np
import pytest
from flax import nnx

from flexmarl.config import tokenizer_paths
from flexmarl.metrics.writer import read_metrics
from flexmarl.models import hf
from flexmarl.models.tokenizer import BOS, DEFAULT_CHARS, build_char_tokenizer, load_tokenizer
from flexmarl.models.transformer import PRESETS, Decoder, ModelConfig
from flexmarl.run import train
from flexmarl.store.experience_store import ExperienceStore
from flexmarl.workflows.base import Query
from flexmarl.workflows.solver_verifier import SolverVerifier
from test_team import two_agent_config

LLAMA_CHARS = DEFAULT_CHARS
QWEN_CHARS = ''.join(reversed(DEFAULT_CHARS)) + 'αβγδ'  # other ids, a larger vocabulary


class HeldOutSolverVerifier(SolverVerifier):
  """The solver/verifier workflow with a fixed held-out set (the training stream's
  problems are drawn at random; these four are the same on every call)."""

  def eval_queries(self):
    return [Query(f'eval{i}', f'{a}+{b}', str(a + b), 'add')
            for i, (a, b) in enumerate([(0, 1), (1, 1), (2, 0), (1, 2)])]


def _checkpoint(folder: str, chars: str, qwen2: bool, seed: int) -> str:
  """A tiny random model of one family, saved as an HF folder with its own tokenizer."""
  tokenizer = build_char_tokenizer(chars)
  cfg = ModelConfig(vocab_size=tokenizer.vocab_size, qkv_bias=qwen2, tie_embeddings=qwen2,
                    **dict(PRESETS['tiny'], heads=2, kv_heads=1, head_dim=32))
  params = nnx.to_pure_dict(nnx.state(Decoder(cfg, nnx.Rngs(params=seed))))
  return hf.save_hf(cfg, params, folder, tokenizer=tokenizer)


def _config(tmp_path, steps: int) -> ml_collections.ConfigDict:
  c = two_agent_config(steps)
  c.checkpoint_every, c.eval_every = 2, 2
  c.workflow = dict(name='solver_verifier', solver='solver', verifier='verifier', family='add',
                    task_args={'max_operand': 2})
  for name, chars, qwen2 in (('solver', LLAMA_CHARS, False), ('verifier', QWEN_CHARS, True)):
    folder = str(tmp_path / f'{name}_base')
    if not os.path.isdir(folder):
      _checkpoint(folder, chars, qwen2, seed=len(name))
    c.agents[name].model.checkpoint = folder
    c.agents[name].model.lora = dict(rank=4, alpha=8.0)
  return c


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  tmp_path = tmp_path_factory.mktemp('families')
  workdir = str(tmp_path / 'run')
  workflow = HeldOutSolverVerifier(task_args={'max_operand': 2})
  train(_config(tmp_path, steps=2), workdir, workflow=workflow, log=lambda *_: None)
  train(_config(tmp_path, steps=4), workdir, workflow=workflow, log=lambda *_: None)
  return tmp_path, workdir


@pytest.mark.quick
def test_each_agent_takes_the_tokenizer_its_checkpoint_carries(tmp_path):
  c = _config(tmp_path, steps=1)
  assert tokenizer_paths(c) == {'solver': c.agents.solver.model.checkpoint,
                                'verifier': c.agents.verifier.model.checkpoint}
  c.agents.verifier.tokenizer = 'char'  # an agent's own tokenizer field still wins
  assert tokenizer_paths(c)['verifier'] == 'char'


def test_two_families_train_resume_evaluate_and_store_their_own_ids(run):
  tmp_path, workdir = run
  tokenizers = {'solver': load_tokenizer(str(tmp_path / 'solver_base')),
                'verifier': load_tokenizer(str(tmp_path / 'verifier_base'))}
  assert tokenizers['solver'].vocab_size != tokenizers['verifier'].vocab_size
  lines = read_metrics(os.path.join(workdir, 'metrics.jsonl'))
  trained = sorted((l['step'], l['agent']) for l in lines
                   if l.get('updated') and l['agent'] != 'team')
  # The verifier trains every step, the solver (half the rows) every other: each step once
  # across the stop at step 2.
  assert trained == [(1, 'verifier'), (2, 'solver'), (2, 'verifier'), (3, 'verifier'),
                     (4, 'solver'), (4, 'verifier')]
  assert all(np.isfinite(l['loss']) for l in lines if 'loss' in l)
  evals = sorted((l['step'], l['agent']) for l in lines if 'eval_accuracy' in l)
  assert evals == [(s, a) for s in (0, 2, 4) for a in ('solver', 'team', 'verifier')]
  store = ExperienceStore.open(os.path.join(workdir, 'store'), agents=['solver', 'verifier'])
  try:
    for agent, own in tokenizers.items():
      other = tokenizers['verifier' if agent == 'solver' else 'solver']
      rows = store.read(agent)
      assert rows
      for row in rows:  # the agent's prompts in its own ids, not the other family's
        prompt = own.decode(row.prompt_ids).replace(BOS, '')
        assert list(row.prompt_ids) == own.encode(prompt)
        assert list(row.prompt_ids) != other.encode(prompt)
        assert max(row.prompt_ids) < own.vocab_size
  finally:
    store.close()
  for agent, own in tokenizers.items():  # each agent's own tokenizer saved with the run
    saved = load_tokenizer(os.path.join(workdir, 'tokenizers', agent))
    assert saved.encode('1+2=') == own.encode('1+2=')


@pytest.mark.parametrize('agent,model_type', [('solver', 'llama'), ('verifier', 'qwen2')])
def test_each_family_exports_with_its_own_tokenizer(run, agent, model_type):
  from flexmarl.export import export
  tmp_path, workdir = run
  out = str(tmp_path / f'{agent}_hf')
  export(workdir, agent, out)
  with open(os.path.join(out, 'config.json'), encoding='utf-8') as f:
    assert json.load(f)['model_type'] == model_type
  own = load_tokenizer(str(tmp_path / f'{agent}_base'))
  exported = load_tokenizer(out)
  assert exported.vocab_size == own.vocab_size and exported.encode('2+1=') == own.encode('2+1=')
  cfg = hf.model_config_from_hf(out)
  assert (cfg.qkv_bias, cfg.tie_embeddings, cfg.vocab_size) == (
      model_type == 'qwen2', model_type == 'qwen2', own.vocab_size)
