"""The README's Python examples run as written; every TOML block of the docs is a valid recipe (or fragment)."""

import pathlib
import re
import sys

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_python_examples_run(tmp_path, monkeypatch):
    code = blocks()
    assert len(code) >= 2
    monkeypatch.chdir(tmp_path)
    for src in code:
        src = src.replace("/tmp/zephon-demo", str(tmp_path / "demo"))
        exec(compile(src, str(README), "exec"), {"__name__": "readme"})


# -- every TOML block of the documentation parses and validates -------------------------------
ROOT = README.parent
DOCS = [README, *sorted((ROOT / "docs").rglob("*.md")), *sorted(ROOT.glob("*/README.md"))]
#: what a fragment (a block without the top-level keys, e.g. a [[datasets]] and its [vision]) is
#: completed with before validation
BASE = {"seed": 1, "lanes": 16, "seq_len": 512, "global_batch_size": 32, "datasets": []}


def toml_blocks():
    out = []
    for path in DOCS:
        for i, src in enumerate(re.findall(r"```toml\n(.*?)```", path.read_text(), flags=re.S)):
            out.append(pytest.param(src, id=f"{path.relative_to(ROOT)}#{i + 1}"))
    return out


def test_the_docs_have_toml_blocks():
    assert len(toml_blocks()) >= 2


@pytest.mark.parametrize("src", toml_blocks())
def test_toml_block_parses_and_validates(src, tmp_path):
    from zephon.data import BUNDLED_TOKENIZER
    from zephon.recipe import parse_recipe
    from zephon.recipe.filters import parse_filters
    from zephon.recipe.fork import parse_fork
    from zephon.recipe.recipe import OWN_SECTIONS

    raw = tomllib.loads(src)
    if "seed" not in raw:  # a fragment: completed with BASE and a dataset of its own
        own = [{"name": "base_text", "path": "base/*.jsonl", "weight": 1.0}]
        given = {d.get("name") for d in raw.get("datasets", [])}
        named = sorted({n for f in raw.get("filters", []) for n in f.get("datasets", [])} - given)
        own += [{"name": n, "path": f"{n}/*.jsonl", "weight": 1.0} for n in named]  # datasets a [[filters]] names
        raw = {**BASE, **raw, "datasets": own + raw.get("datasets", [])}
    raw["tokenizer"] = {**raw.get("tokenizer", {}), "path": BUNDLED_TOKENIZER}
    core = {k: v for k, v in raw.items() if k not in OWN_SECTIONS}  # [[filters]], [fork]: read by Recipe
    spec = parse_recipe(core, str(tmp_path))  # raises RecipeError naming the key when a block is invalid
    parse_filters(raw.get("filters"), spec)
    parse_fork(raw.get("fork"), str(tmp_path))
