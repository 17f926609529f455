"""Freed memory goes back to the system: glibc's malloc told to serve every block of
MMAP_THRESHOLD bytes or more from its own mapping (returned whole when freed).

By default glibc raises that threshold as large blocks are freed (up to 32 MiB), after
which the batches, arrays and store reads a run allocates and frees every step come
from the heap, and the heap fragments: measured on the default experiment, the bytes in
use stayed at ≈570 MB while the heap's free space grew 66 → 116 MB (steps 750 → 3000),
resident memory with it. With a fixed threshold the run's resident memory stays flat
(experiments/benchmarks/RESULTS.md, "Memory of a long run"): +4.0% over 5000 steps at
64 KiB, 256 KiB and 1 MiB alike. 1 MiB maps the fewest blocks through the kernel; its
cost in step time was within this machine's noise. Elsewhere (macOS, musl)
this does nothing; a threshold set through the environment (`MALLOC_MMAP_THRESHOLD_`,
`GLIBC_TUNABLES`) is left alone.
"""

from __future__ import annotations

import ctypes
import os

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
MMAP_THRESHOLD = 1 << 20


def return_freed_memory() -> bool:
  """Fix glibc's mmap threshold at MMAP_THRESHOLD for this process; True if it did."""
  if 'MALLOC_MMAP_THRESHOLD_' in os.environ or 'mmap_threshold' in os.environ.get(
      'GLIBC_TUNABLES', ''):
    return False
  try:
    mallopt = ctypes.CDLL(None).mallopt
  except (OSError, AttributeError):  # not glibc
    return False
  return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
