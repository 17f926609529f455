#!/usr/bin/env bash
# Set up (or complete) the virtual environment's test tier, then run the tests.
#   bash launchers/test.sh                the full suite (what CI, .ci/run, runs)
#   bash launchers/test.sh quick          the quick tier: tests marked `quick` (pytest -m quick),
#                                         one or more per test file, in about 3 minutes
#   bash launchers/test.sh [quick] ARGS   more pytest arguments: -k NAME, -x, -n 0 (one
#                                         process), or test files
#                                         (bash launchers/test.sh tests/test_grpo.py)
# Without files it runs tests/ (pytest.ini's testpaths); docs/testing.md says more. Every run
# prints the 15 slowest tests. The test tier is the base install, requirements-test.txt and
# the vllm and real extras where this machine can install them (launchers/venv.sh): an extra
# that cannot be installed is named in one line with its fix, and the tests needing it are
# listed as not run at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launchers/venv.sh test
# Huge pages for malloc where the kernel gives them only on request: a vLLM weight sync on
# CPU allocates its GEMM handles afresh, ~3x faster without 4 KiB page faults.
export GLIBC_TUNABLES=${GLIBC_TUNABLES:-glibc.malloc.hugetlb=1}
tier=()
if [ "${1:-}" = quick ]; then
  shift
  tier=(-m quick)
fi
# Two processes (pytest-xdist), a file's tests in one of them (its module fixtures are
# built once); -n 0 in ARGS runs everything in this process.
exec .venv/bin/python -m pytest -q --durations=15 -n 2 --dist loadfile \
  ${tier[@]+"${tier[@]}"} "$@"
