#!/usr/bin/env bash
# The demo: a bundled recipe over generated data; prints rows and global-batch hashes per world size.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/zephon demo "$@"
