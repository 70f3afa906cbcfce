#!/usr/bin/env bash
# The test suite (default + slow integration tests).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
# The browser test renders a batch in headless Chromium; install it where we can (root + apt),
# otherwise that one test skips and says how to install it.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "note: could not install chromium; tests/tools/test_browser.py will skip"
fi
# the gates that keep the tree readable: lint, format, types (scripts/typecheck.sh)
.venv/bin/ruff check .
.venv/bin/ruff format --check .
bash scripts/typecheck.sh
export TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=600 "$@"
