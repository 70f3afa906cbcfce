#!/usr/bin/env bash
# The scale-out measurements on a bigger CPU machine (16 cores), in one go, a few minutes:
#   1. benchmarks/scale.py       text tokens/s and vision images/s at 1..16 workers (zephon, Grain)
#   2. benchmarks/read_once.py   loader CPU of a TP = 4 group: every peer reading vs read-once
#   3. benchmarks/many_ranks.py  a thousand ranks simulated (every rank of W = 1,024 with --full)
#
# Here (a machine with the package registry), carry what the target may lack:
#   bash benchmarks/scale16.sh download      # wheels for CPython 3.11 x86_64 into benchmarks/.wheels/
# There (nothing reachable; torch already installed; run from the repository root):
#   bash benchmarks/scale16.sh run [BUDGET_S]   # default budget 480 s for scale.py
# Results: benchmarks/results/scale_<cores>core.{md,json,png}, read_once_<cores>core.*,
# many_ranks_<cores>core.*; copy them back and commit them.
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=benchmarks/.wheels
case "${1:-run}" in
download)
  mkdir -p "$wheels"
  pip download -d "$wheels" --no-deps --only-binary=:all: --implementation cp \
    --python-version 3.11 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    torchdata==0.11.0 grain==0.2.18 array-record cloudpickle etils portpicker importlib_resources \
    zipp absl-py protobuf tokenizers psutil fsspec zstandard tqdm pillow numpy pyarrow \
    torchtitan==0.3.0
  ls "$wheels"
  ;;
run)
  budget="${2:-480}"
  cores=$(python -c 'import os; print(len(os.sched_getaffinity(0)))')
  site=/tmp/zephon-site
  if [ -d "$wheels" ]; then
    python -m pip install -q --no-index --no-deps --target "$site" "$wheels"/*.whl
    export PYTHONPATH="$site:$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
  else
    export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
  fi
  [ -e zephon/nodes ] || ln -s ../nodes zephon/nodes   # what an editable install does
  export TOKENIZERS_PARALLELISM=false
  python benchmarks/scale.py --budget-s "$budget"
  python benchmarks/read_once.py --tag "read_once_${cores}core"
  python benchmarks/many_ranks.py --full --tag "many_ranks_${cores}core"
  ls -l benchmarks/results/ | grep -E "scale_${cores}core|read_once_${cores}core|many_ranks_${cores}core"
  ;;
*)
  echo "usage: bash benchmarks/scale16.sh download | run [BUDGET_S]" >&2
  exit 2
  ;;
esac
