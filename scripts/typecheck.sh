#!/usr/bin/env bash
# Type-check the library as the installed package sees it: nodes/ is zephon.nodes (pyproject's
# package-dir), so mypy reads a staging folder of links where zephon/nodes points at nodes/.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir "$stage/zephon"
for entry in zephon/*; do [ "$(basename "$entry")" = nodes ] || ln -s "$root/$entry" "$stage/zephon/$(basename "$entry")"; done  # a worktree may link zephon/nodes itself
ln -s "$root/nodes" "$stage/zephon/nodes"
cd "$stage"
"$root/.venv/bin/python" -m mypy --config-file "$root/pyproject.toml" -p zephon 2>&1 \
  | sed -e "s#^zephon/nodes/#nodes/#" -e "s#^zephon/#zephon/#"
exit "${PIPESTATUS[0]}"
