#!/usr/bin/env bash
# The base install, checked as a new user gets it: a venv of its own (.venv-base, gitignored) with
# torch 2.13.0 and `pip install .` WITHOUT extras, then `import zephon, zephon.nodes` and
# `zephon demo`, run outside the source tree so that the installed package is what is tested.
# The venv is reused while pyproject.toml is unchanged (then only zephon itself is reinstalled);
# a changed pyproject.toml recreates it, so a dependency dropped from the base is noticed.
# Usage: bash scripts/base_check.sh   (ZEPHON_BASE_VENV=path to put the venv elsewhere)
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
venv="${ZEPHON_BASE_VENV:-$repo/.venv-base}"
stamp="$(sha256sum pyproject.toml | cut -c1-16)"
fail() {
  echo "base_check.sh: FAILED: $*" >&2
  exit 1
}
pip_q() {  # pip_q WHAT ARGS...: a quiet pip install that stops, naming WHAT, on failure
  local what=$1 log
  shift
  log=$(mktemp)
  if ! "$venv/bin/python" -m pip install -q "$@" >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    fail "pip could not install $what into $venv (pip's output above)"
  fi
  rm -f "$log"
}
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.zephon-base-stamp" 2>/dev/null)" != "$stamp" ]; then
  echo "base_check.sh: creating $venv (torch 2.13.0, then zephon without extras)" >&2
  rm -rf "$venv"
  python3 -m venv "$venv" || fail "python3 -m venv $venv"
  pip_q "torch==2.13.0" "torch==2.13.0"
  pip_q "zephon (pip install . without extras)" "$repo"
  echo "$stamp" >"$venv/.zephon-base-stamp"
else
  echo "base_check.sh: reusing $venv (pyproject.toml unchanged); reinstalling zephon itself" >&2
  pip_q "zephon (pip install --no-deps --force-reinstall .)" --no-deps --force-reinstall "$repo"
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"  # outside the source tree: `import zephon` must find the installed package
"$venv/bin/python" -c "
import sys, zephon, zephon.nodes
where = zephon.__file__
assert where.startswith(sys.prefix), f'zephon imported from {where}, not from the base venv {sys.prefix}'
print(f'base_check.sh: import zephon {zephon.__version__}, zephon.nodes: ok ({where})')
" || fail "import zephon, zephon.nodes in the base install"
"$venv/bin/zephon" demo --root "$work/demo" >"$work/demo.log" 2>&1 || {
  cat "$work/demo.log" >&2
  fail "zephon demo in the base install (its output above)"
}
tail -n 3 "$work/demo.log" >&2
echo "base_check.sh: base install ok: import zephon, zephon.nodes and zephon demo" >&2
