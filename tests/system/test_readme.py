"""The README's and the docs' Python examples run as written; every TOML block of the docs is a valid
recipe (or fragment); every shell block parses; the README is a first page (<= 200 lines) whose links
and anchors resolve."""

import pathlib
import re
import shutil
import subprocess
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
DOCS = [
    README,
    *sorted(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts),
    *sorted(ROOT.glob("*/README.md")),
]


def fenced(lang):
    """``(path, index, source)`` of every ```lang block of the docs, each source once (a block the
    README shows and a page repeats runs once)."""
    out, seen = [], set()
    for path in DOCS:
        for i, src in enumerate(re.findall(rf"```{lang}\n(.*?)```", path.read_text(), flags=re.S)):
            if src not in seen:
                seen.add(src)
                out.append(pytest.param(path, src, id=f"{path.relative_to(ROOT)}#{i + 1}"))
    return out


@pytest.mark.parametrize("path,src", [p for p in fenced("python") if p.values[0] != README])
def test_docs_python_examples_run(path, src, tmp_path, monkeypatch):
    """Every Python block of the docs pages runs as written (the README's run above)."""
    monkeypatch.chdir(tmp_path)
    src = src.replace("/tmp/zephon-demo", str(tmp_path / "demo"))
    exec(compile(src, str(path), "exec"), {"__name__": "docs"})


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("path,src", fenced("bash"))
def test_shell_blocks_parse(path, src):
    """Every shell block of the README and the docs is valid bash (``bash -n``)."""
    out = subprocess.run(["bash", "-n"], input=src, capture_output=True, text=True)
    assert out.returncode == 0, f"{path}: {out.stderr}"


def slug(heading):
    """A heading's anchor as GitHub and MyST (``myst_heading_anchors``) make it."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path):
    body = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(h) for h in re.findall(r"(?m)^#{1,6} (.+)$", body)}


def test_readme_is_a_first_page():
    """What, whom, how it compares, the two commands (exactly), a quickstart, TorchTitan, a picture, links."""
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    head = text.split("## The two commands")[0]
    assert "| | zephon | Grain | torchdata.nodes | Mosaic Streaming | Energon | TorchTitan 0.3 loader |" in head
    assert "bash scripts/demo.sh     # " in text and "bash scripts/test.sh     # " in text
    assert "pip install zephon" not in text and 'pip install "zephon' not in text
    assert "with_zephon" in text and "![" in text and "docs/reference/recipe.md" in text


@pytest.mark.parametrize("path", [README, *sorted(ROOT.glob("*/README.md"))], ids=lambda p: str(p.relative_to(ROOT)))
def test_readme_links_resolve(path):
    """Every relative link of a README names a file that exists, and its #anchor a heading there."""
    links = re.findall(r"\]\(([^)\s]+)\)", re.sub(r"```.*?```", "", path.read_text(), flags=re.S))
    assert links or path != README
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue
        target, _, anchor = link.partition("#")
        file = (path.parent / target).resolve() if target else path
        assert file.exists(), f"{path.name}: link {link!r}: no {file}"
        if anchor:
            assert anchor in anchors(file), (
                f"{path.name}: link {link!r}: no heading with anchor {anchor!r} in {file.name}"
            )


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

    raw = tomllib.loads(src)
    if "seed" not in raw:  # a fragment: completed with BASE and a dataset of its own
        own = [{"name": "base_text", "path": "base/*.jsonl", "weight": 1.0}]
        given = {d.get("name") for d in raw.get("datasets", [])}
        named = sorted({n for f in raw.get("filters", []) for n in f.get("datasets", [])} - given)
        own += [{"name": n, "path": f"{n}/*.jsonl", "weight": 1.0} for n in named]  # datasets a [[filters]] names
        raw = {**BASE, **raw, "datasets": own + raw.get("datasets", [])}
    raw["tokenizer"] = {**raw.get("tokenizer", {}), "path": BUNDLED_TOKENIZER}
    parse_recipe(raw, str(tmp_path))  # raises RecipeError naming the key when a block is invalid
