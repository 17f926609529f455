"""Compiled programs kept on disk between runs: JAX's persistent compilation cache.

A rerun, a resume, a Ray worker that restarts, or another experiment with the same
shapes loads each compiled step (train steps, the sampler's generate) from
`config.compile_cache_dir` instead of compiling it again: the GRPO benchmark's warm-up
on a 2-core CPU falls from 5.5 s to 1.3 s (experiments/benchmarks/RESULTS.md); on
accelerators, where a large model's step compiles for minutes, it saves more. An entry
is keyed by the computation, the devices it runs on and the JAX/XLA versions, so a
changed model or a new jaxlib compiles afresh.

The folder holds code that JAX loads and runs: keep it where only you can write. It
grows with every new shape (JAX evicts nothing by default); delete it to start over.
"""

from __future__ import annotations

import os

DEFAULT_DIR = '~/.cache/flexmarl/xla'
# Programs that compiled faster than this are not worth a file (JAX's default: 1 s,
# which would leave out most of a small model's steps).
MIN_COMPILE_S = 0.1


def use(path: str) -> str | None:
  """Keep compiled programs in `path` ('' keeps none) from now on in this process;
  returns the folder in use. A cache JAX was given already (`JAX_COMPILATION_CACHE_DIR`,
  `jax.config`) is kept as it is."""
  import jax
  from jax.experimental.compilation_cache import compilation_cache

  current = jax.config.jax_compilation_cache_dir
  if current or not path:
    return current or None
  # JAX decides at its first compile whether a cache is in use; a process that
  # compiled before (a notebook, a test) decides again with the folder set.
  compilation_cache.reset_cache()
  path = os.path.expanduser(path)
  jax.config.update('jax_compilation_cache_dir', path)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', MIN_COMPILE_S)
  return path
