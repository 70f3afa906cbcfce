"""Vision-language SFT in a recipe (issue 32): conversations with images, in every record form
(WebDataset, Parquet, JSON Lines with image paths, LLaVA), mixed with text, text chat and
image-text datasets; byte-identical batches on W = 1, 2, 4 with thread and process workers and
after a resume on another W; each packed conversation whole, its labels only on the assistant's
text, its pixels those of its source bytes; token shares within 0.05 of the declared weights
(all tokens, and trained tokens with ``count = "loss"``).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from zephon import Recipe, RecipeError, WorkerConfig, batch_sha256
from zephon.data import DataError
from zephon.data.chatimages import VL_CHAT_TOKENIZER
from zephon.engine.checkpoint import decode_state, encode_state
from zephon.nodes.images import preprocess_patches
from zephon.nodes.worksource import WorkItem
from zephon.recipe.chat import realized_shares
from zephon.recipe.loader_metrics import LoaderMetrics
from zephon.tools.display import show
from zephon.tools.synth import generate_conversations, make_demo_corpus, make_vision_corpus, make_vl_chat_corpus

STEPS = 8
VISION = {"patch_size": 16, "merge_size": 2, "min_pixels": 1024, "max_pixels": 4096, "max_images_per_batch": 8}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    r = tmp_path_factory.mktemp("vlchat")
    make_vl_chat_corpus(str(r), seed=1, n_wds=48, n_parquet=48, n_jsonl=48)
    make_vision_corpus(str(r), seed=0, n_wds=16, n_parquet=32, n_interleaved=8)
    make_demo_corpus(str(r / "text"), seed=3, scale=0.02)
    os.makedirs(r / "talk")
    with open(r / "talk" / "chat.jsonl", "w") as f:
        f.writelines(json.dumps({"messages": c}) + "\n" for c in generate_conversations(120, seed=2, tools=False))
    return str(r)


def config(**over) -> dict:
    cfg = {
        "seed": 5,
        "lanes": 4,
        "seq_len": 256,
        "global_batch_size": 8,
        "cache_dir": "cache",
        "tokenizer": {"path": VL_CHAT_TOKENIZER},
        "datasets": [
            {"name": "cw", "kind": "chat", "path": "chat_wds/*.tar", "weight": 0.2},
            {"name": "cp", "kind": "chat", "path": "chat_parquet/*.parquet", "image_field": "images", "weight": 0.2},
            {"name": "cj", "kind": "chat", "path": "chat_jsonl/*.jsonl", "image_field": "images", "weight": 0.15},
            {
                "name": "llava",
                "kind": "chat",
                "chat_format": "sharegpt",
                "path": "chat_llava/*.jsonl",
                "image_field": "image",
                "weight": 0.15,
            },
            {"name": "pairs", "kind": "image_text", "path": "pairs/*.parquet", "weight": 0.1},
            {"name": "talk", "kind": "chat", "path": "talk/*.jsonl", "weight": 0.1},
            {"name": "web", "path": "text/web/*.jsonl", "weight": 0.1},
        ],
        "vision": VISION,
        "pack": {"flush_every": 16},
        "shuffle": {"buffer": 4},
    }
    cfg.update(over)
    return cfg


@pytest.fixture(scope="module")
def recipe(root):
    return Recipe.from_dict(config(), root)


def run(recipe, world, steps, workers=WorkerConfig(0), state=None):
    with recipe.global_loader(world, workers=workers) as g:
        if state is not None:
            g.load_state_dict(state)
        out = [batch_sha256(next(g)) for _ in range(steps)]
        return out, decode_state(encode_state(g.state_dict()))


@pytest.fixture(scope="module")
def reference(recipe):
    return run(recipe, 1, STEPS)[0]


@pytest.fixture(scope="module")
def batches(recipe):
    with recipe.global_loader(1, workers=WorkerConfig(0)) as g:
        return [next(g) for _ in range(40)]


# -- elastic ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "world,workers", [(2, WorkerConfig(2, "thread")), (4, WorkerConfig(0)), (4, WorkerConfig(3, "thread"))]
)
def test_identical_across_world_sizes_and_threads(recipe, reference, world, workers):
    assert run(recipe, world, STEPS, workers)[0] == reference


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_identical_with_process_workers(recipe, reference, world):
    assert run(recipe, world, STEPS, WorkerConfig(2, "process"))[0] == reference


@pytest.mark.parametrize("resume_world", [1, 2])
def test_save_on_w4_resume_elsewhere(recipe, reference, resume_world):
    first, state = run(recipe, 4, 3)
    rest, _ = run(recipe, resume_world, STEPS - 3, WorkerConfig(2, "thread"), state=state)
    assert first + rest == reference


# -- what a batch holds -------------------------------------------------------------------------
def _encoded(recipe, entry):
    """The document the recipe's own encoder makes of a provenance entry's record, and the record."""
    p = recipe.prepare()
    d, shard, record = int(entry[0]), int(entry[1]), int(entry[2])
    rec = p.indexes[d].read(shard, [record])[0]
    item = WorkItem(d, shard, record, int(entry[3]), 0)
    return p.pipeline.encoders[d]([item], {(d, shard, record): rec})[0], rec


def test_conversations_whole_labels_on_the_assistant_pixels_from_their_bytes(recipe, batches):
    """Every packed conversation is whole (never split across rows), its labels are its assistant
    tokens (never an image's), and its pixels are those of its own image bytes, preprocessed."""
    names = [d.name for d in recipe.datasets]
    vision, special = recipe.vision, recipe.special_tokens
    checked = images = 0
    for b in batches[:12]:
        first_patch = np.concatenate([[0], np.cumsum(b["grid_thw"].prod(axis=1))])
        img = 0  # the batch's images are in row order, each segment's in its token order
        for r, row in enumerate(b["provenance"]):
            pos = 0
            for entry in row:
                d, t0, t1 = int(entry[0]), int(entry[4]), int(entry[5])
                n = t1 - t0
                blocks = int((b["input"][r, pos : pos + n] == special["vision_start"]).sum())
                if recipe.datasets[d].kind == "chat":
                    doc, rec = _encoded(recipe, entry)
                    assert (t0, t1) == (0, len(doc.tokens)), f"{names[d]}: a conversation was split"
                    shown = b["input"][r, pos : pos + n]  # a row's last token is only a label's target
                    assert shown.tolist() == doc.tokens[: len(shown)].tolist()
                    target = doc.mask[1:] & ~np.isin(doc.tokens[1:], list(special.values()))
                    want = np.where(target, doc.tokens[1:], -100)[: len(shown) - 1 + (pos + n > len(b["input"][r]))]
                    assert b["labels"][r, pos : pos + n - 1].tolist() == want.tolist()
                    assert target.any()
                    if recipe.datasets[d].image_field:
                        assert blocks == len(doc.grid_thw)
                        for j, data in enumerate(rec.segments[1 : 1 + blocks]):
                            mine, grid = preprocess_patches(data, vision)
                            lo = first_patch[img + j]
                            assert np.array_equal(b["pixel_values"][lo : lo + len(mine)], mine)
                            assert b["grid_thw"][img + j].tolist() == grid.tolist()
                        images += blocks
                        checked += 1
                img += blocks
                pos += n
        assert img == len(b["grid_thw"])
    assert checked >= 20 and images >= 20


@pytest.mark.parametrize("count", ["all", "loss"])
def test_token_shares_hold(root, count):
    """A mixed recipe's token shares over 60 steps are within 0.05 of its weights: all tokens, or
    (``count = "loss"``) the tokens trained on, which images never are."""
    cfg = config(mixing={"count": count})
    if count == "loss":  # image-text samples train on their captions only: a small share of their tokens
        cfg["datasets"] = [d for d in cfg["datasets"] if d.get("kind") != "image_text"]
        cfg["datasets"][-1]["weight"] = 0.2
    recipe = Recipe.from_dict(cfg, root)
    with recipe.global_loader(1, workers=WorkerConfig(2, "thread")) as g:
        got = realized_shares((next(g) for _ in range(60)), len(recipe.datasets), count)
    want = np.array([d.weight for d in recipe.datasets]) / sum(d.weight for d in recipe.datasets)
    assert np.abs(got - want).max() <= 0.05, (got.round(3).tolist(), want.round(3).tolist())


def test_trained_share_in_metrics_and_view(recipe, batches):
    m = LoaderMetrics(recipe)
    for b in batches[:5]:
        m.record(b)
    out = m.collect()
    assert 0 < out["zephon/trained_share/cp"] < 0.9 and out["zephon/trained_share/web"] > 0.9
    html = show(batches[0], recipe)._repr_html_()
    assert 'class="zp-untrained"' in html and 'class="zp-trained"' in html and "<img" in html


def test_long_split_is_refused_for_conversations_with_images(root):
    cfg = config()
    cfg["datasets"][1]["long"] = "split"
    with pytest.raises(RecipeError, match="dataset 'cp': long = \"split\" would cut a conversation with images"):
        Recipe.from_dict(cfg, root)


def test_a_template_without_image_parts_stops_the_run(root):
    cfg = config(datasets=[dict(config()["datasets"][1], chat_template="chatml", on_error="skip")])
    with pytest.raises(DataError, match=r"renders 0 image placeholders.*chatml_vl"):
        run(Recipe.from_dict(cfg, root), 1, 2)


def test_data_version_5_keeps_its_mixing(root):
    """``count = "loss"`` leaves image tokens out of an image-text dataset's weight from data
    version 6; version 5 plans them in, as it did."""
    cfg = config(mixing={"count": "loss"})
    v6 = Recipe.from_dict(cfg, root).prepare().plan
    v5 = Recipe.from_dict({**cfg, "data_version": 5}, root).prepare().plan
    pairs = [d.name for d in Recipe.from_dict(cfg, root).datasets].index("pairs")
    assert (v5.datasets[pairs].record_weight(0) > v6.datasets[pairs].record_weight(0)).all()


def test_provenance_names_each_conversation_and_its_images(recipe, batches):
    """``provenance`` traces a packed conversation to its record and each image to its source;
    re-reading a cited image gives back its digest."""
    import hashlib

    from zephon.tools.provenance import provenance

    seen = 0
    for b in batches[:4]:
        for r in range(len(b["input"])):
            for entry in provenance(recipe, b, r):
                if entry["kind"] != "chat":
                    continue
                assert entry["conversation"].lstrip().startswith(("{", "[")) and entry["trained"] > 0
                for im in entry["images"]:
                    data = open(im["path"], "rb").read() if "path" in im else None
                    if data is not None:
                        assert hashlib.sha256(data).hexdigest() == im["sha256"]
                    assert im["index"] is not None and im["grid"] == tuple(b["grid_thw"][im["index"]].tolist())
                    seen += 1
    assert seen >= 5


def test_inspect_tells_each_datasets_trained_share(root, capsys):
    from toml_writer import to_toml

    from zephon.tools.cli import main

    path = os.path.join(root, "vlchat.toml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(to_toml(config()))
    assert main(["inspect", path, "--measure-steps", "3"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("trained tokens"))
    shares = dict(part.rsplit(" ", 1) for part in line.split(": ", 1)[1].split(", "))
    assert 0 < float(shares["cp"]) < 0.9 and float(shares["web"]) > 0.9
