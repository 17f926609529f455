"""Tokenizers: the built-in char one, and HF folders with their own special tokens."""

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from flexmarl.models.tokenizer import build_char_tokenizer, load_tokenizer


@pytest.mark.quick
def test_char_round_trip_and_specials():
  tok = build_char_tokenizer()
  ids = tok.encode('3+4=abc')
  assert ids[0] == tok.bos_id and len(ids) == 8
  assert tok.decode(ids[1:] + [tok.eos_id, ids[1]]) == '3+4=abc'  # stops at EOS


def test_saved_folder_loads_back(tmp_path):
  tok = build_char_tokenizer()
  tok.save(str(tmp_path))
  again = load_tokenizer(str(tmp_path))
  assert again.encode('12+7') == tok.encode('12+7')
  assert (again.eos_id, again.bos_id, again.pad_id) == (tok.eos_id, tok.bos_id, tok.pad_id)


def test_hf_folder_with_qwen_style_specials(tmp_path):
  vocab = {'<|endoftext|>': 0, 'a': 1, 'b': 2, '<unk>': 3}
  hf = Tokenizer(models.WordLevel(vocab, unk_token='<unk>'))
  hf.pre_tokenizer = pre_tokenizers.Split('', 'isolated')
  hf.save(str(tmp_path / 'tokenizer.json'))
  (tmp_path / 'tokenizer_config.json').write_text(json.dumps(
      {'eos_token': {'content': '<|endoftext|>'}, 'bos_token': None, 'pad_token': None}))
  tok = load_tokenizer(str(tmp_path))
  assert tok.bos_id is None and tok.eos_id == tok.pad_id == 0
  assert tok.encode('ab') == [1, 2]


def test_missing_tokenizer_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match='config.tokenizer'):
    load_tokenizer(str(tmp_path / 'nope'))


@pytest.mark.parametrize('add_bos', [True, False])
def test_a_folder_without_post_processor_encodes_as_its_config_says(tmp_path, add_bos):
  """BOS comes from the tokenizer's own call; a folder whose tokenizer.json has no
  post-processor gets BOS exactly when its tokenizer_config.json asks for it."""
  tok = build_char_tokenizer()
  tok.save(str(tmp_path))
  spec = json.loads((tmp_path / 'tokenizer.json').read_text())
  spec['post_processor'] = None
  (tmp_path / 'tokenizer.json').write_text(json.dumps(spec))
  config = json.loads((tmp_path / 'tokenizer_config.json').read_text())
  config['add_bos_token'] = add_bos
  (tmp_path / 'tokenizer_config.json').write_text(json.dumps(config))
  ids = tok.encode('1+2=')
  assert load_tokenizer(str(tmp_path)).encode('1+2=') == (ids if add_bos else ids[1:])
