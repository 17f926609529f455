"""A model named by its Hugging Face Hub id (`ORG/NAME`) is read from the hub's own cache,
as `huggingface_hub` lays it out; offline, a model not cached is one clear error."""

import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from flexmarl.config import AgentSpec, ConfigError, agent_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMIT = '0123456789abcdef0123456789abcdef01234567'


def _hub_cache(tmp_path) -> tuple[str, str]:
  """(HF_HUB_CACHE, the local folder it was made from): the tiny HF model as hub model
  `flexmarl-test/tiny`, in the layout the hub's client writes (blobs aside: files)."""
  from experiments import make_tiny_hf
  folder = make_tiny_hf.make(str(tmp_path / 'tiny_hf'))
  cache = tmp_path / 'hub'
  repo = cache / 'models--flexmarl-test--tiny'
  shutil.copytree(folder, repo / 'snapshots' / COMMIT)
  (repo / 'refs').mkdir()
  (repo / 'refs' / 'main').write_text(COMMIT)
  return str(cache), folder


@pytest.mark.quick
def test_a_hub_id_resolves_from_the_hub_cache_offline(tmp_path, monkeypatch):
  cache, folder = _hub_cache(tmp_path)
  monkeypatch.setenv('HF_HUB_CACHE', cache)
  monkeypatch.setenv('HF_HUB_OFFLINE', '1')
  # huggingface_hub reads its settings when imported: a fresh process, as a user runs it.
  script = ('from flexmarl.models import source, hf; from flexmarl.models.tokenizer import load_tokenizer\n'
            'print(source.kind("flexmarl-test/tiny"), source.local("flexmarl-test/tiny"))\n'
            'print(hf.model_config_from_hf("flexmarl-test/tiny").hidden)\n'
            'print(load_tokenizer("flexmarl-test/tiny").vocab_size)\n'
            'try:\n  source.local("flexmarl-test/absent")\n'
            'except Exception as e:\n  print(type(e).__name__, e)\n')
  out = subprocess.run([sys.executable, '-c', script], cwd=str(tmp_path), capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
  assert out.returncode == 0, out.stderr[-2000:]
  kind, hidden, vocab, error = out.stdout.strip().splitlines()
  assert kind.split() == ['hub', os.path.join(cache, 'models--flexmarl-test--tiny', 'snapshots',
                                              COMMIT)]
  from flexmarl.models import hf
  from flexmarl.models.tokenizer import load_tokenizer
  assert int(hidden) == hf.model_config_from_hf(folder).hidden
  assert int(vocab) == load_tokenizer(folder).vocab_size
  assert error.startswith("CheckpointFileError model.checkpoint='flexmarl-test/absent': the "
                          "Hugging Face Hub model 'flexmarl-test/absent' is not in the cache")
  assert 'HF_HUB_OFFLINE is set' in error and 'hf download flexmarl-test/absent' in error


def test_an_agent_named_by_a_hub_id_starts_from_its_weights(tmp_path, monkeypatch):
  cache, folder = _hub_cache(tmp_path)
  from huggingface_hub import constants
  monkeypatch.setattr(constants, 'HF_HUB_CACHE', cache)
  monkeypatch.setattr(constants, 'HF_HUB_OFFLINE', True)
  from flexmarl.models import hf, sharding, source, transformer
  source.local.cache_clear()
  named = lambda checkpoint: agent_config(model=dict(checkpoint=checkpoint))
  spec = AgentSpec.from_config('a', named('flexmarl-test/tiny'), 0)
  assert spec.model == AgentSpec.from_config('a', named(folder), 0).model
  mesh = sharding.make_mesh(jax.devices()[:1], (1, 1))
  load = lambda where: jax.device_get(hf.load_params(where, spec.model, sharding.param_shardings(
      transformer.abstract_model(spec.model)[1], mesh)))
  jax.tree.map(np.testing.assert_array_equal, load('flexmarl-test/tiny'), load(folder))
  with pytest.raises(ConfigError, match=r"model.checkpoint='flexmarl-test/absent'.*not in the "
                     'cache'):
    AgentSpec.from_config('a', named('flexmarl-test/absent'), 0)
