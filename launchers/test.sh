#!/usr/bin/env bash
# Set up (or complete) the virtual environment, then run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
source launchers/venv.sh
# Huge pages for malloc where the kernel gives them only on request: a vLLM weight sync on
# CPU allocates its GEMM handles afresh, ~3x faster without 4 KiB page faults.
export GLIBC_TUNABLES=${GLIBC_TUNABLES:-glibc.malloc.hugetlb=1}
exec .venv/bin/python -m pytest -q tests "$@"
