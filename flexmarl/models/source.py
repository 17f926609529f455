"""Where a model comes from: the name a user gives, resolved in one place.

A checkpoint (`agents.NAME.model.checkpoint`, `config.tokenizer`) is one of:
- GGUF: a `.gguf` file, or `package:NAME` for the one GGUF file an installed package
  ships, or that packages NAME-part1..N ship split, joined once into a cache folder
  (models/gguf_parts.py); models/gguf.py reads it, dequantizing on the way;
- FOLDER: a Hugging Face model folder (config.json, *.safetensors, tokenizer files), such
  as `python -m flexmarl.export` writes;
- HUB: a Hugging Face Hub id, `ORG/NAME`, where no such local path exists: fetched once
  by `huggingface_hub` into its usual cache (`HF_HOME`, `HF_HUB_CACHE`), whose files are
  then read as a FOLDER. `HF_HUB_OFFLINE=1` reads the cache only, as does a machine
  that cannot reach the hub and has the model cached.
`kind` says which; `local` gives the file or folder to read; `identity` what makes two
agents' checkpoints the same base.
"""

from __future__ import annotations

import functools
import os
import re

from flexmarl.core.errors import CheckpointFileError
from flexmarl.models import gguf

GGUF, FOLDER, HUB = 'gguf', 'folder', 'hub'
_HUB_ID = re.compile(r'[A-Za-z0-9][\w.-]*/[\w.-]+')
# What a model's folder needs from the hub: its config, weights and tokenizer.
_HUB_FILES = ['*.json', '*.safetensors', 'tokenizer.model', '*.txt', '*.jinja']


def kind(checkpoint: str) -> str:
  """GGUF, FOLDER or HUB (see the module's docstring)."""
  if checkpoint.startswith(gguf.PACKAGE_PREFIX) or checkpoint.endswith('.gguf'):
    return GGUF
  if not os.path.exists(checkpoint) and _HUB_ID.fullmatch(checkpoint):
    return HUB
  return FOLDER


@functools.lru_cache(maxsize=16)
def local(checkpoint: str) -> str:
  """The local file (GGUF) or folder that holds `checkpoint`; a hub id is fetched first."""
  found = kind(checkpoint)
  if found == GGUF:
    return gguf.resolve(checkpoint)
  if found == HUB:
    return _from_hub(checkpoint)
  return checkpoint


def identity(checkpoint: str) -> str:
  """What names the same weights however they were written: a package or a hub id as
  given, a file or folder by its real path."""
  if kind(checkpoint) == HUB or checkpoint.startswith(gguf.PACKAGE_PREFIX):
    return checkpoint
  return os.path.realpath(checkpoint)


def carries_tokenizer(checkpoint: str) -> bool:
  """Whether the checkpoint holds its own tokenizer: a GGUF file always does (and is
  refused when it cannot be read), a folder when it has tokenizer.json."""
  if kind(checkpoint) == GGUF:
    return True
  folder = local(checkpoint)
  return os.path.isfile(os.path.join(folder, 'tokenizer.json'))


def _from_hub(repo_id: str) -> str:
  """The cached snapshot folder of hub model `repo_id`, fetched where it is missing."""
  from huggingface_hub import constants, snapshot_download
  from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError,
                                      RepositoryNotFoundError)
  try:
    return snapshot_download(repo_id, allow_patterns=_HUB_FILES)
  except LocalEntryNotFoundError:
    offline = ' (HF_HUB_OFFLINE is set)' if constants.HF_HUB_OFFLINE else ''
    raise CheckpointFileError(
        repo_id, f'the Hugging Face Hub model {repo_id!r} is not in the cache '
        f'{constants.HF_HUB_CACHE} and the hub cannot be reached{offline}. Fix: fetch it '
        f'where the hub can be reached (`hf download {repo_id}`, the same HF_HOME), or give '
        'the path of a local model folder.') from None
  except (RepositoryNotFoundError, GatedRepoError) as e:
    raise CheckpointFileError(
        repo_id, f'the Hugging Face Hub has no model {repo_id!r} this machine may read '
        f'({type(e).__name__}). Fix: check the id (ORG/NAME), log in for a gated model '
        '(`hf auth login`), or give a local folder; a local folder of that name does not '
        'exist.') from None
