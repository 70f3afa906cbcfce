#!/usr/bin/env bash
# The ablation experiment's bigger variant, prepared for the device machine (16 CPU cores, one
# H200, torch 2.11 installed there, no network). Run from the repository root:
#
#     bash scripts/ablation_gpu.sh    # results under $OUT (or build/ablation_gpu)
#
# Estimated 8-10 min (17 launches of ~30 s; not measured yet: no device was lent when it was
# written), capped at 570 s by `timeout`.
#
# What it runs: scripts/ablation_experiment.py with W = 1 and 4, 4 transformer layers, 60 steps of
# 16 x 128 tokens, three data seeds and --bf16, 4 OMP threads per rank (16 cores / W=4). The
# data-parallel ranks run on the CPU cores with gloo, like the committed run: one GPU cannot host
# W > 1 NCCL ranks (NCCL refuses two ranks on one device), so the H200 would only add a W = 1 run
# and is not used here. The JSON is rewritten after every launch, so a run cut short by the
# time limit still returns its finished launches ("complete": false).
#
# Wheels to carry (the machine reaches no package index). torch stays the machine's 2.11 (never
# install another torch; torchtitan's triton import uses the triton bundled with it). Download
# them here, pure-Python or manylinux wheels for the machine's Python, without dependencies, into
# build/wheels, and name build/wheels in the run tool's `carry`:
#
#     python -m pip download --no-deps -d build/wheels --only-binary=:all: \
#         torchtitan==0.3.0 torchdata==0.11.0 datasets==4.7.0 tokenizers==0.23.3 zstandard \
#         dill multiprocess xxhash huggingface_hub fsspec tqdm
#
# (add --python-version/--platform manylinux2014_x86_64 when this machine's Python differs from
# the device's). pyarrow, numpy, pandas, requests and PyYAML are expected there with torch;
# the check below names any module that is still missing. zephon itself is not installed: the
# working tree is on PYTHONPATH. torchtitan 0.3.0 targets torch 2.14; the CPU launcher
# (tests/support/titan_launcher.py) supplies what torch 2.13 lacks, and the first launch below is
# the check that torch 2.11 is enough (if it fails, its log says which call is missing).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-build/ablation_gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false

missing=$("$PY" - <<'EOF'
import importlib.util
mods = ["torch", "torchtitan", "torchdata", "datasets", "tokenizers", "pyarrow", "numpy", "zstandard", "matplotlib"]
print(" ".join(m for m in mods if importlib.util.find_spec(m) is None))
EOF
)
if [ -n "$missing" ] && [ -d build/wheels ]; then
  echo "installing from build/wheels: $missing"
  "$PY" -m pip install -q --no-index --find-links build/wheels --no-deps build/wheels/*.whl
  missing=$("$PY" -c "import importlib.util as u; print(' '.join(m for m in '$missing'.split() if u.find_spec(m) is None))")
fi
if [ -n "$missing" ]; then
  echo "missing Python modules: $missing (carry their wheels in build/wheels; see the header)" >&2
  # matplotlib only draws the figure: run without it
  [ "$missing" = "matplotlib" ] || exit 2
  NOPLOT=--no-plot
fi
"$PY" -c "import torch, torchtitan; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'cpus', __import__('os').cpu_count())"

timeout 570 "$PY" scripts/ablation_experiment.py \
  --world-sizes 1 4 --layers 4 --steps 60 --val-every 20 --seq-len 128 --global-batch-size 16 \
  --seeds 0 1 2 --bf16 --threads 4 --docs 1500 --heldout 80 \
  --workdir "$OUT/work" --json "$OUT/ablation_gpu.json" --png "$OUT/ablation_gpu.png" ${NOPLOT:-} \
  2>&1 | tee "$OUT/ablation_gpu.log" | grep -v '^\[titan\]' || true
rm -rf "$OUT/work/runs" "$OUT/work/zcache" "$OUT/work/hfcache"  # checkpoints and caches: too big to return
