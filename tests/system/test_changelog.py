"""CHANGELOG.md keeps up with the data versions: every declared data version has its entry.

A data version changes the batches of existing recipes; a user resuming a checkpoint or comparing
runs must be able to read what it changed. ``zephon.recipe.DATA_VERSION`` is the newest version and
``zephon.recipe.spec.VERSIONED`` the settings whose default each version changed: each version needs
a ``### Data version N`` entry, and the entry names every setting of its version.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from zephon.recipe import DATA_VERSION
from zephon.recipe.spec import VERSIONED

CHANGELOG = Path(__file__).resolve().parents[2] / "CHANGELOG.md"
HEADING = re.compile(r"^(#+) +Data version (\d+)\b.*$", re.M)


def entries(text: str) -> dict[int, str]:
    """Each ``Data version N`` heading's section (up to the next heading of its level or above)."""
    out: dict[int, str] = {}
    for m in HEADING.finditer(text):
        level = len(m.group(1))
        rest = text[m.end() :]
        stop = re.search(rf"^#{{1,{level}}} ", rest, re.M)
        out[int(m.group(2))] = rest[: stop.start()] if stop else rest
    return out


def missing_entries(text: str, data_version: int, versioned: Mapping[tuple[str, str], Mapping[int, Any]]) -> list[str]:
    """What CHANGELOG ``text`` lacks for data versions 1..``data_version`` (empty: nothing)."""
    found = entries(text)
    problems = [f"no '### Data version {v}' entry" for v in range(1, data_version + 1) if v not in found]
    problems += [
        f"'Data version {v}' is not declared (DATA_VERSION = {data_version})" for v in found if v > data_version
    ]
    for (section, name), by_version in sorted(versioned.items()):
        for v in by_version:
            if v in found and not re.search(rf"`[^`]*\b{re.escape(name)}\b[^`]*`", found[v]):
                problems.append(f"'Data version {v}' does not name `{name}` ({section}), a setting it changed")
    if "## [Unreleased]" not in text:
        problems.append("no '## [Unreleased]' section")
    return problems


def test_every_data_version_has_its_changelog_entry():
    problems = missing_entries(CHANGELOG.read_text(encoding="utf-8"), DATA_VERSION, VERSIONED)
    assert not problems, (
        "CHANGELOG.md is behind the data versions (zephon/recipe/spec.py DATA_VERSION, VERSIONED): add under "
        "'## [Unreleased]' a '### Data version N' entry saying what it changes in the batches:\n  "
        + "\n  ".join(problems)
    )


def test_the_check_fails_on_a_missing_or_incomplete_entry():
    text = (
        "# Changelog\n## [Unreleased]\n### Data version 2\n- `[pack] labels` inside documents\n"
        "## [0.1.0]\n### Data version 1\n- the first\n"
    )
    versioned = {("PackSpec", "labels"): {2: "document"}, ("ShuffleSpec", "block"): {3: 16}}
    assert missing_entries(text, 2, versioned) == []
    assert missing_entries(text, 3, versioned) == ["no '### Data version 3' entry"]
    text3 = text.replace("## [0.1.0]", "### Data version 3\n- blocks\n## [0.1.0]")
    assert missing_entries(text3, 3, versioned) == [
        "'Data version 3' does not name `block` (ShuffleSpec), a setting it changed"
    ]
    assert missing_entries(text3, 2, versioned)[0] == "'Data version 3' is not declared (DATA_VERSION = 2)"
