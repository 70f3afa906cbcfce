"""Tests mirror the package: engine/, data/, nodes/, recipe/, tools/, integrations/, and system/ for
properties of the whole project (elastic runs through every layer, the layer rules, docs, notebooks).
Helpers shared across folders live in support/ and are importable by name.

Shared by the whole run (use these rather than building your own; the quick tier must stay
within 10 minutes on 2 cores, ``bash scripts/test.sh --quick`` prints the slowest tests):

- ``text_corpus`` (session): a read-only folder with the three-format text corpus of
  ``text_fixtures.write_corpus`` (scale 0.05) and its ``recipe.toml``; a test that writes into
  its folder (a bad record, an extra recipe, a changed shard) copies it first
  (``shutil.copytree(text_corpus, tmp_path / "c")``) or builds its own.
- ``vl_tokenizer`` (session): the bundled BPE plus Qwen-VL's vision special tokens
  (``vl_fixtures.make_vl_tokenizer``), read-only.
- ``warm_process.run_zephon(*args, timeout=...)`` (tests/support/, or the ``zephon_process``
  fixture): ``python -m zephon ARGS`` in a fresh process forked from a warm interpreter that has
  imported torch and zephon once: a real process (own pid, exit status, stdout, stderr, cwd, env)
  without the 2-4 s of imports that a plain ``subprocess.run([sys.executable, ...])`` pays.

Every test process gets its own ``$ZEPHON_CACHE_DIR`` (so a recipe without ``cache_dir`` never
reads the user's ``~/.cache/zephon`` and parallel workers never share one). scripts/test.sh runs
the quick tier in parallel with pytest-xdist, ``-n N --dist loadfile``: a file's tests run on one
worker, one after another (module fixtures are built once per file, a file may use a fixed folder
as tests/system/test_golden.py does); tests of different files run at the same time, so a test
never relies on a fixed port, a fixed path shared with another file, or the machine being idle.
(``--dist loadgroup`` does not group with pytest 9.2: xdist 3.8 rewrites ``item._nodeid``.)
"""

from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))


@pytest.hookimpl(trylast=True)  # after the tmp_path plugin has set up the run's base folder
def pytest_configure(config: pytest.Config) -> None:
    # one index cache per test process (per xdist worker): never the user's, never another run's
    base = config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    os.environ["ZEPHON_CACHE_DIR"] = str(base / "zephon-cache")


@pytest.fixture(scope="session")
def text_corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    from text_fixtures import write_corpus, write_recipe

    root = str(tmp_path_factory.mktemp("text_corpus"))
    write_corpus(root)
    write_recipe(root)
    return root


@pytest.fixture(scope="session")
def vl_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    from vl_fixtures import make_vl_tokenizer

    return make_vl_tokenizer(str(tmp_path_factory.mktemp("vl_tok") / "tok"))


@pytest.fixture(scope="session")
def zephon_process():
    """``run(args, timeout=..., cwd=..., env=..., module="zephon")``: ``python -m zephon ARGS`` in a
    fresh process forked from a warm interpreter (tests/support/warm_process.py)."""
    from warm_process import WarmInterpreter

    warm = WarmInterpreter()
    yield warm.run
    warm.close()
