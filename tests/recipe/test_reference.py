"""The recipe reference is generated from the schema: every key has a doc, and the committed page is current."""

import pathlib

from zephon.recipe.reference import REGENERATE, SECTIONS, missing_docs, reference

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "reference" / "recipe.md"


def test_every_key_has_a_doc():
    assert missing_docs() == [], f"recipe keys without a doc (add doc= to their key()): {missing_docs()}"


def test_the_committed_reference_is_current():
    assert PAGE.read_text(encoding="utf-8") == reference(), f"docs/reference/recipe.md is stale; run: {REGENERATE}"


def test_the_reference_has_every_key_the_old_readme_missed():
    page = reference()
    for needle in ("| `bos_token` |", "| `eos_token` |", "| `start_method` |", "## `[[filters]]`", "## `[fork]`"):
        assert needle in page, needle
    assert len(SECTIONS) == 11  # [[batch_schedule]] (#36)


def test_a_key_without_a_doc_is_reported(monkeypatch):
    import dataclasses

    from zephon.recipe import reference as ref
    from zephon.recipe.keys import key

    @dataclasses.dataclass(frozen=True)
    class Bare:
        x: int = key(1, doc="")

    monkeypatch.setattr(ref, "SECTIONS", (*ref.SECTIONS, ("[bare]", Bare, "a section")))
    assert ref.missing_docs() == ["[bare] x"]
    assert ref.main([]) == 1
