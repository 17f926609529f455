#!/usr/bin/env bash
# Set up (or complete) the virtual environment's base tier, then run an experiment here.
#   launchers/local.sh [CONFIG] [WORKDIR] [extra flags, e.g. --config.steps=50]
# CONFIG defaults to the default experiment, WORKDIR to runs/<config name>. The base tier is
# requirements.txt and FlexMARL, from PyPI alone (launchers/venv.sh); an experiment that needs
# an extra installs it first (rollout.backend=vllm: `bash launchers/venv.sh vllm`).
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:-experiments/hierarchical_assistant.py}
workdir=${2:-runs/$(basename "${config%%:*}" .py)}
shift $(( $# < 2 ? $# : 2 ))
bash launchers/venv.sh base  # makes or completes .venv (the recipe test.sh extends)
# Eight host devices give every agent its own mesh on a CPU-only machine; on GPU/TPU
# machines the flag only affects the host platform.
export XLA_FLAGS=${XLA_FLAGS:---xla_force_host_platform_device_count=8}
# Huge pages for malloc where the kernel gives them only on request: a vLLM weight sync on
# CPU allocates its GEMM handles afresh, ~3x faster without 4 KiB page faults.
export GLIBC_TUNABLES=${GLIBC_TUNABLES:-glibc.malloc.hugetlb=1}
exec .venv/bin/python -m flexmarl.main --config="$config" --workdir="$workdir" "$@"
