#!/usr/bin/env bash
# CI's check of the base install as a fresh clone gets it from PyPI alone: a throwaway venv in
# a temporary folder with the base (launchers/venv.sh's base step) and the test extra, neither
# the vllm nor the real extra. pytest then collects the whole suite (an error fails the check)
# and runs the quick tier together with every test marked by an extra: those skip, and the
# summary lists them, and the files that skip whole, by name with the fix (tests/conftest.py).
#   bash launchers/check_base.sh [PYTEST ARGS]
# It needs PyPI, so it is not part of the suite; docs/testing.md has a run's output and times.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# PyPI alone: no pip config file (a machine's may add indexes, wheel folders or a constraint
# file) and no PIP_* variable but those that say how to reach it.
for var in $(compgen -e | grep '^PIP_' || true); do
  case $var in
    PIP_CERT|PIP_CLIENT_CERT|PIP_PROXY|PIP_DISABLE_PIP_VERSION_CHECK) ;;
    *) unset "$var" ;;
  esac
done
export PIP_CONFIG_FILE=/dev/null

tmp=$(mktemp -d "${TMPDIR:-/tmp}/flexmarl-check-base.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
venv=$tmp/venv
say() { echo "check_base: $*" >&2; }
start=$SECONDS

FLEXMARL_VENV=$venv bash launchers/venv.sh base
"$venv/bin/pip" install -q -r requirements-test.txt  # venv.sh's test step, without the extras
installed=$((SECONDS - start))
say "the base install and the test extra, from PyPI alone: ${installed} s"

t=$SECONDS
if ! "$venv/bin/python" -m pytest --collect-only -q -p no:cacheprovider > "$tmp/collect.log" 2>&1
then
  cat "$tmp/collect.log" >&2
  say "FAILED: the suite does not collect in the base install (above)"
  exit 1
fi
collect=$((SECONDS - t))
say "collection of the whole suite: $(tail -n 1 "$tmp/collect.log"); ${collect} s"

t=$SECONDS
if ! "$venv/bin/python" -m pytest -q -p no:cacheprovider --durations=5 -n 2 --dist loadfile \
       -m 'quick or extra' "$@"; then
  say "FAILED: the quick tier in the base install (above)"
  exit 1
fi
say "OK in $((SECONDS - start)) s: install ${installed} s, collection ${collect} s," \
    "the quick tier with the tests marked by an extra $((SECONDS - t)) s"
