#!/usr/bin/env bash
# Create .venv (once) and install zephon with the given extras. torch 2.13.0 goes first: a bare
# "torch" requirement would otherwise pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
python -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null \
  || python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
PYTHONWARNINGS="ignore::UserWarning" python -m pip install -q -e ".${extras:+[$extras]}" 2>&1 | grep -v "^WARNING: Location" || true
python -c "import zephon, zephon.nodes" 
