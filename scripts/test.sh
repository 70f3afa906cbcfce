#!/usr/bin/env bash
# The test suite, in parts, each announced with what it does and how long it took:
#   1 setup    .venv with zephon[dev] (scripts/setup.sh; first time: a few minutes, torch included)
#   2 base     a base install as a user gets it: .venv-base with torch and `pip install .` without
#              extras, then import zephon, zephon.nodes and `zephon demo` (scripts/base_check.sh;
#              first time about a minute, then about 20 s)
#   3 gates    ruff check, ruff format --check, mypy (scripts/typecheck.sh)
#   4 docs     the Sphinx site (docs/ -> docs/_build/html), warnings as errors, links and anchors checked
#   5 quick    pytest -m "not slow": every test but the slow tier, on every core (<= 10 min on 2 cores)
#   6 slow     pytest -m slow -v: real torchrun trainers and processes, each test named as it runs
#              (15+ minutes)
# Usage: bash scripts/test.sh [--quick | --slow] [pytest args...]
#   (no flag: all six parts; --quick: parts 1-5; --slow: parts 1 and 6; extra args go to pytest)
# Nothing is installed outside the repository's folder unless asked: ZEPHON_INSTALL_CHROMIUM=1
# (as root, with apt-get) installs headless Chromium system-wide for tests/tools/test_browser.py,
# which otherwise skips when no chromium is on PATH.
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
if command -v chromium >/dev/null 2>&1; then
  :
elif [ "${ZEPHON_INSTALL_CHROMIUM:-0}" = 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  part chromium "ZEPHON_INSTALL_CHROMIUM=1: installing headless Chromium system-wide with apt-get (tests/tools/test_browser.py)"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "note: could not install chromium; tests/tools/test_browser.py will skip" >&2
  done_part chromium
else
  echo "== test.sh: chromium: not on PATH: tests/tools/test_browser.py will skip" \
    "(install it yourself, or as root run with ZEPHON_INSTALL_CHROMIUM=1 to apt-get it)" >&2
fi
export TOKENIZERS_PARALLELISM=false
pytest=(.venv/bin/python -m pytest -q -p no:cacheprovider --timeout=600 --durations=20)
# the quick tier runs on every core (at most 4: each worker holds torch; ZEPHON_TEST_JOBS=N to
# choose, 0 or 1 for one process), a file's tests on one worker (see tests/conftest.py)
jobs=${ZEPHON_TEST_JOBS:-$(.venv/bin/python -c 'import os; print(min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))')}
parallel=()
[ "$jobs" -gt 1 ] && parallel=(-n "$jobs" --dist loadfile)
if [ "$tier" != slow ]; then
  part base "a base install without extras imports zephon and runs the demo (scripts/base_check.sh)"
  bash scripts/base_check.sh
  done_part base
  part gates "ruff check, ruff format --check, mypy (scripts/typecheck.sh)"
  .venv/bin/ruff check .
  .venv/bin/ruff format --check .
  bash scripts/typecheck.sh
  done_part gates
  part docs "sphinx -W --keep-going -n: the docs site, every page, link, anchor and docstring (docs/_build/html)"
  .venv/bin/python -m sphinx -E -q -W --keep-going -n -b html docs docs/_build/html
  done_part docs
  part quick "pytest -m 'not slow' (the slow tier: bash scripts/test.sh --slow)"
  rc=0
  "${pytest[@]}" "${parallel[@]}" -m "not slow" "$@" || rc=$?
  [ "$rc" = 5 ] && rc=0  # no test selected (e.g. a path with only slow tests)
  done_part quick
  [ "$rc" = 0 ] || exit "$rc"
fi
if [ "$tier" != quick ]; then
  part slow "pytest -m slow: real torchrun trainers, process kills, soak (15+ min; skip with --quick)"
  rc=0
  # -v (not the quick tier's -q): each test is named when it starts, its outcome when it ends
  "${pytest[@]/-q/-v}" -m slow "$@" || rc=$?
  [ "$rc" = 5 ] && rc=0  # no test selected (e.g. a path without slow tests)
  done_part slow
  [ "$rc" = 0 ] || exit "$rc"
fi
echo "== test.sh: all parts passed in $(( $(date +%s) - start_all )) s" >&2
