"""The record pipeline's contract (zephon.nodes.stages): rules between the read and the encoders,
a dropped record keeping its slot, a user's own stage from Python and from a recipe."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from text_fixtures import write_corpus, write_recipe

from zephon import Recipe, batch_sha256
from zephon.nodes import FilteredDoc, FilterError, RecordPipeline, TokDoc
from zephon.nodes.stages import FilterRule, FilterVerdict, Record, RuleStage, rule_class
from zephon.recipe import RecipeError


@rule_class("even_records")
class EvenRecords(RuleStage):
    """Composed in Python: keep records with an even record number."""

    needs_text = False

    def __call__(self, rec: Record, count_tokens=len) -> FilterVerdict | None:
        return self.drop(rec.record % 2 == 0)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("stages")
    write_corpus(str(root))
    return str(root)


@pytest.fixture(scope="module")
def prepared(corpus):
    return Recipe.from_toml(write_recipe(corpus)).prepare()


def _items(p, n=40):
    src = p.plan.lane(0)
    return [next(src) for _ in range(n)]


def test_a_python_rule_composes_and_a_dropped_record_keeps_its_slot(prepared):
    p = prepared
    enc = p.text_encoder
    rule = FilterRule("even", "even_records", (0,))  # dataset 0 only
    pipe = RecordPipeline(p.indexes, [enc] * len(p.indexes), [rule])
    items = _items(p)
    plain, piped = enc(items), pipe(items)
    assert len(piped) == len(items)
    for it, a, b in zip(items, plain, piped):
        if it.dataset == 0 and it.record % 2:
            assert isinstance(b, FilteredDoc) and b.skipped == "even" and b.item == it
        else:  # kept records are encoded exactly as without the rule
            assert isinstance(b, TokDoc) and not isinstance(b, FilteredDoc)
            assert np.array_equal(a.tokens, b.tokens) and b.item == it
    assert any(isinstance(b, FilteredDoc) for b in piped) and "even:even_records" in repr(pipe)
    again = pickle.loads(pickle.dumps(pipe))  # process workers receive it pickled
    assert [type(d) for d in again(items)] == [type(d) for d in piped]


def test_a_transform_reaches_the_encoder_through_the_pipeline_not_a_side_channel(prepared):
    p = prepared
    rule = FilterRule("caps", "transform", (1,), {}, "user_filters:upper")
    pipe = RecordPipeline(p.indexes, [p.text_encoder] * len(p.indexes), [rule], count_tokens=len)
    items = [it for it in _items(p, 200) if it.dataset == 1 and it.parts <= 1][:4]  # whole documents
    assert len(items) == 4
    texts = [p.indexes[1].read(it.shard, [it.record])[0] for it in items]
    want = [p.tokenizer.encode_batch([t.upper()])[0] for t in texts]
    got = pipe(items)
    assert all(np.array_equal(w, g.tokens) for w, g in zip(want, got))
    assert not np.array_equal(got[0].tokens, p.text_encoder(items[:1])[0].tokens)  # the text did change


def test_a_users_stage_from_a_recipe_and_its_errors(corpus):
    stage = '\n[[filters]]\nname = "first"\nkind = "stage"\nfunction = "user_filters:ShortFirstLine"\nparams = { min = 30 }\n'
    r = Recipe.from_toml(write_recipe(corpus, "stage.toml", extra=stage))
    a = [batch_sha256(b) for b, _ in zip(r.global_loader(world_size=1), range(3))]
    b = [batch_sha256(b) for b, _ in zip(r.global_loader(world_size=2), range(3))]
    assert a == b
    assert r.prepare().pipeline.rules[0].kind == "stage"
    broken = stage.replace("ShortFirstLine", "BrokenStage")
    with pytest.raises(
        RecipeError, match=r"stage 'first' \('user_filters:BrokenStage'\) (raised KeyError|returned a str)"
    ):
        Recipe.from_toml(write_recipe(corpus, "broken.toml", extra=broken)).prepare()


def test_a_stage_that_is_not_a_rule_class_is_refused():
    with pytest.raises(FilterError, match="not a subclass of zephon.nodes.stages.RuleStage"):
        FilterRule("x", "stage", None, {}, "user_filters:upper")


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="unknown filter kind 'nope'"):
        FilterRule("x", "nope")
