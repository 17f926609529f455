"""Freed memory goes back to the system (flexmarl.runtime.malloc): with glibc's threshold fixed,
a block the size of a step's batch is mapped on its own even after larger blocks were
freed, where glibc's default would serve it from the heap (which fragments)."""

import ctypes
import subprocess
import sys

import pytest

PROBE = """
import ctypes, sys
sys.path.insert(0, {root!r})
from flexmarl.runtime import malloc
class Info(ctypes.Structure):
  _fields_ = [(n, ctypes.c_size_t) for n in ('arena', 'ordblks', 'smblks', 'hblks', 'hblkhd',
              'usmblks', 'fsmblks', 'uordblks', 'fordblks', 'keepcost')]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype, libc.malloc.restype = Info, ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
if {fix}:
  assert malloc.return_freed_memory()
libc.free(libc.malloc(8 << 20))  # glibc's default now raises its threshold to 8 MiB
before = libc.mallinfo2().hblkhd
block = libc.malloc(2 << 20)
print(libc.mallinfo2().hblkhd - before)
"""


def _mapped_bytes_of_a_2mib_block(fix: bool) -> int:
  import flexmarl
  root = __import__('os').path.dirname(__import__('os').path.dirname(flexmarl.__file__))
  out = subprocess.run([sys.executable, '-c', PROBE.format(root=root, fix=fix)], check=True,
                       capture_output=True, text=True, env={'PATH': '/usr/bin:/bin'})
  return int(out.stdout.split()[-1])


@pytest.mark.quick
def test_a_freed_batch_sized_block_is_mapped_on_its_own():
  try:
    ctypes.CDLL(None).mallinfo2
  except AttributeError:
    pytest.skip('not glibc >= 2.33')
  assert _mapped_bytes_of_a_2mib_block(fix=False) == 0  # glibc's default: from the heap
  assert _mapped_bytes_of_a_2mib_block(fix=True) >= 2 << 20


def test_a_threshold_from_the_environment_is_left_alone(monkeypatch):
  from flexmarl.runtime import malloc
  monkeypatch.setenv('MALLOC_MMAP_THRESHOLD_', '131072')
  assert not malloc.return_freed_memory()
