#!/usr/bin/env bash
# The test suite, in parts, each announced with what it does and how long it took:
#   1 setup    .venv with zephon[dev] (scripts/setup.sh; first time: a few minutes, torch included)
#   2 chromium headless Chromium for tests/tools/test_browser.py (apt-get, root only; else that test skips)
#   3 gates    ruff check, ruff format --check, mypy (scripts/typecheck.sh)
#   4 quick    pytest -m "not slow": every test but the slow tier (a few minutes)
#   5 slow     pytest -m slow: real torchrun trainers and processes (15+ minutes)
# Usage: bash scripts/test.sh [--quick | --slow] [pytest args...]
#   (no flag: all five parts; --quick: parts 1-4; --slow: parts 1 and 5; extra args go to pytest)
set -euo pipefail
cd "$(dirname "$0")/.."
tier=all
case "${1:-}" in
  --quick) tier=quick; shift ;;
  --slow) tier=slow; shift ;;
esac
start_all=$(date +%s)
part_start=0
part() {  # part NAME WHAT...: announce a part
  part_start=$(date +%s)
  echo "== test.sh: $1: ${*:2}" >&2
}
done_part() {
  echo "== test.sh: $1 done in $(( $(date +%s) - part_start )) s" >&2
}
part setup "creating .venv (if needed) and installing zephon[dev] with scripts/setup.sh dev"
bash scripts/setup.sh dev
done_part setup
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  part chromium "installing headless Chromium with apt-get for tests/tools/test_browser.py (renders a batch view)"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "note: could not install chromium; tests/tools/test_browser.py will skip" >&2
  done_part chromium
elif ! command -v chromium >/dev/null 2>&1; then
  echo "== test.sh: chromium: not installed and not root: tests/tools/test_browser.py will skip (apt-get install chromium)" >&2
fi
export TOKENIZERS_PARALLELISM=false
pytest=(.venv/bin/python -m pytest -q -p no:cacheprovider --timeout=600)
if [ "$tier" != slow ]; then
  part gates "ruff check, ruff format --check, mypy (scripts/typecheck.sh)"
  .venv/bin/ruff check .
  .venv/bin/ruff format --check .
  bash scripts/typecheck.sh
  done_part gates
  part quick "pytest -m 'not slow' (the slow tier: bash scripts/test.sh --slow)"
  rc=0
  "${pytest[@]}" -m "not slow" "$@" || rc=$?
  [ "$rc" = 5 ] && rc=0  # no test selected (e.g. a path with only slow tests)
  done_part quick
  [ "$rc" = 0 ] || exit "$rc"
fi
if [ "$tier" != quick ]; then
  part slow "pytest -m slow: real torchrun trainers, process kills, soak (15+ min; skip with --quick)"
  rc=0
  "${pytest[@]}" -m slow "$@" || rc=$?
  [ "$rc" = 5 ] && rc=0  # no test selected (e.g. a path without slow tests)
  done_part slow
  [ "$rc" = 0 ] || exit "$rc"
fi
echo "== test.sh: all parts passed in $(( $(date +%s) - start_all )) s" >&2
