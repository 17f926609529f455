#!/usr/bin/env bash
# Set up a virtual environment (once) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  .venv/bin/pip install -q -r requirements.txt
  # vLLM (CPU build) + transformers for the HF and vLLM tests; drop the CUDA extras it pulls.
  .venv/bin/pip install -q -r requirements-vllm.txt
  .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec triton
  .venv/bin/pip install -q --no-deps -e .
fi
exec .venv/bin/python -m pytest -q tests "$@"
