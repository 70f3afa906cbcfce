#!/usr/bin/env bash
# Create .venv (once) and install zephon (editable) with the given extras. torch 2.13.0 goes
# first: a bare "torch" requirement would otherwise pull a multi-GB CUDA build.
# Every step stops the script on failure and names what failed (pip's own output is shown then).
# Installs only into .venv: nothing system-wide.
# Usage: bash scripts/setup.sh [EXTRAS]   e.g. bash scripts/setup.sh dev,   bash scripts/setup.sh hf,titan
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
fail() {
  echo "setup.sh: FAILED: $*" >&2
  exit 1
}
pip_q() {  # pip_q WHAT ARGS...: a quiet pip install into .venv that stops, naming WHAT, on failure
  local what=$1 log
  shift
  log=$(mktemp)
  if ! PYTHONWARNINGS="ignore::UserWarning" python -m pip install -q "$@" >"$log" 2>&1; then
    grep -v "^WARNING: Location" "$log" >&2 || true
    rm -f "$log"
    fail "could not install $what into .venv (pip's output above)"
  fi
  grep -v "^WARNING: Location" "$log" >&2 || true
  rm -f "$log"
}
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv || fail "python3 -m venv .venv (on Debian/Ubuntu: apt-get install python3-venv)"
fi
. .venv/bin/activate
pip_q "an up-to-date pip" --upgrade pip
python -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null \
  || pip_q "torch 2.13.0" "torch==2.13.0"
# this project's distribution is zephon-loader: a "zephon" distribution in .venv is our old name
# (or another project of that name) and would shadow the package
if python -m pip show -q zephon >/dev/null 2>&1; then
  python -m pip uninstall -y -q zephon || fail "could not uninstall the old 'zephon' distribution from .venv"
fi
pip_q "zephon${extras:+[$extras]} (pip install -e .${extras:+[$extras]})" -e ".${extras:+[$extras]}"
python -c "import zephon, zephon.nodes" || fail "the installed zephon does not import (import zephon, zephon.nodes)"
