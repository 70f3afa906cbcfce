#!/usr/bin/env bash
# The test suite (default + slow integration tests).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
export TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=600 "$@"
