#!/usr/bin/env bash
# Set up (or complete) the virtual environment, then run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
source launchers/venv.sh
exec .venv/bin/python -m pytest -q tests "$@"
