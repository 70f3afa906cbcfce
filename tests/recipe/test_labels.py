"""Labels inside documents (issue 20): from data version 2 no target crosses a document
boundary (TorchTitan 0.3's behaviour); version 1 keeps the whole row shifted."""

from __future__ import annotations

import numpy as np
import pytest
from text_fixtures import write_corpus, write_recipe
from vl_fixtures import vl_config, write_vl_root

from zephon import Recipe
from zephon.nodes import IGNORE_INDEX, row_spans
from zephon.recipe.spec import VERSIONED, PackSpec, versioned_default

STEPS = 6


@pytest.fixture(scope="module")
def text_recipe(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("labels"))
    write_corpus(root, scale=0.02)
    return Recipe.from_toml(write_recipe(root, buffer=4))


@pytest.fixture(scope="module")
def vl_recipe(tmp_path_factory):
    root = write_vl_root(tmp_path_factory.mktemp("vl_labels"), seed=0, text_scale=0.02)
    return Recipe.from_dict(vl_config(root), root)


def batches(recipe, steps=STEPS):
    with recipe.global_loader(2) as g:
        return [next(g) for _ in range(steps)]


def owners(prov, seq_len):
    """Which segment each of the row's seq_len + 1 tokens belongs to (-1: padding), from the
    provenance's row positions."""
    out = np.full(seq_len + 1, -1)
    for j, (lo, hi) in enumerate(row_spans(prov)):
        out[lo:hi] = j
    return out


def check_versions(recipe):
    assert recipe.spec.pack.labels == "document"  # the newest version's default
    assert recipe.replace(data_version=1).spec.pack.labels == "row"
    # the same recipe with version 1's labels (its other version-2 settings kept)
    rows = recipe.replace(pack=dict(recipe.raw.get("pack", {})) | {"labels": "row"})
    assert rows.spec.pack.labels == "row"
    crossed = 0
    for new, old in zip(batches(recipe), batches(rows)):
        for k in new:  # the same batches, but for the targets that cross a document
            if k != "labels":
                assert batch_equal(new[k], old[k]), k
        seq_len = new["input"].shape[1]
        for r in range(len(new["input"])):
            own = owners(new["provenance"][r], seq_len)
            same = (own[:-1] >= 0) & (own[:-1] == own[1:])
            cross = (own[:-1] >= 0) & (own[1:] >= 0) & (own[:-1] != own[1:])
            np.testing.assert_array_equal(new["labels"][r][same], old["labels"][r][same])
            assert (new["labels"][r][cross] == IGNORE_INDEX).all()  # no target crosses a document
            assert (old["labels"][r][cross] != IGNORE_INDEX).sum() > 0 or not cross.any()
            assert (new["labels"][r][~same] == IGNORE_INDEX).all()
            crossed += int(cross.sum())
    assert crossed > 10


def batch_equal(a, b):
    if isinstance(a, np.ndarray) or hasattr(a, "numpy"):
        return np.array_equal(np.asarray(a), np.asarray(b))
    return a == b


def test_text_labels_stay_inside_documents(text_recipe):
    check_versions(text_recipe)


def test_image_text_labels_stay_inside_samples(vl_recipe):
    check_versions(vl_recipe)


def test_labels_setting_is_versioned_and_kept_when_given(text_recipe):
    assert VERSIONED[("PackSpec", "labels")] == {2: "document"}
    assert versioned_default(PackSpec, "labels", 1) == "row" and versioned_default(PackSpec, "labels", 2) == "document"
    given = text_recipe.replace(pack={**vars(text_recipe.spec.pack), "labels": "row"})
    assert given.spec.pack.labels == "row" and given.fingerprint != text_recipe.fingerprint
    assert "labels" not in text_recipe.replace(data_version=1).data_definition().get("pack", {})
