"""The vision-language pipeline: image-text + interleaved + text data in one recipe.

Global batches (pixel tensors included) are byte-identical across world sizes, worker counts and
backends, and across resumes on another world size; decoding is bit-identical between thread and
process workers; every new node passes the restore-at-every-step check; bad images follow the
dataset's on_error policy.
"""

from __future__ import annotations

import hashlib
import io
import json
import multiprocessing
import os
import pickle
import shutil

import numpy as np
import pytest
from vl_fixtures import VISION_TOKENS, make_vl_tokenizer, vl_config, write_vl_root  # noqa: F401

from zephon import Recipe, RecipeError, WorkerConfig, batch_sha256
from zephon.data.datasets import DataError, index_multimodal
from zephon.engine import LaneContext
from zephon.engine.checkpoint import decode_state, encode_state
from zephon.engine.mapper import OrderedMapper
from zephon.engine.testing import check_node
from zephon.nodes import MMPack, SkipCounter
from zephon.nodes.images import VisionConfig, decode_image, patchify, preprocess_image, smart_resize
from zephon.nodes.vision import mrope_positions
from zephon.nodes.worksource import LaneWorkSource
from zephon.tools.demo import TOKENIZER_DIR
from zephon.tools.synth import generate_image_text, write_wds


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return write_vl_root(tmp_path_factory.mktemp("vl"), seed=0, text_scale=0.02)


@pytest.fixture(scope="module")
def recipe(root):
    return Recipe.from_dict(vl_config(root), root)


STEPS = 8


def run(recipe, world, steps, workers=WorkerConfig(0), state=None):
    with recipe.global_loader(world, workers=workers) as g:
        if state is not None:
            g.load_state_dict(state)
        out = [batch_sha256(next(g)) for _ in range(steps)]
        return out, decode_state(encode_state(g.state_dict()))


@pytest.fixture(scope="module")
def reference(recipe):
    return run(recipe, 1, STEPS)[0]


# -- elastic identity ------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize(
    "workers",
    [WorkerConfig(0), WorkerConfig(2, "thread"), WorkerConfig(4, "thread")],
    ids=["inline", "thread2", "thread4"],
)
def test_identical_across_world_sizes_and_threads(recipe, reference, world, workers):
    assert run(recipe, world, STEPS, workers)[0] == reference  # (world 1 inline: between runs)


# process pools are per rank (W x count processes on 2 cores), so not the whole cross product:
# every world size and both worker counts are covered
@pytest.mark.parametrize("world,count", [(1, 4), (2, 2), (4, 2)])
def test_identical_with_process_workers(recipe, reference, world, count):
    assert run(recipe, world, STEPS, WorkerConfig(count, "process"))[0] == reference


@pytest.mark.parametrize("shm_mb", [None, 0], ids=["shm_on", "shm_off"])
def test_identical_with_process_workers_shm_on_and_off(recipe, reference, shm_mb):
    # pixel patches, token ids and per-row arrays through the workers' shared-memory arenas (or
    # pickled, with shm_mb = 0): the same bytes
    with recipe.global_loader(2, workers=WorkerConfig(2, "process", shm_mb=shm_mb)) as g:
        got = [batch_sha256(next(g)) for _ in range(STEPS)]
        pools = [m for r in g.routers for m in r.pools.metrics()]
    assert got == reference
    if shm_mb is None:
        assert pools and all(m["shm"] == "on" and m["shm_results"] > 0 for m in pools)
    else:
        assert pools and all(m["shm"] == "off (shm_mb = 0)" for m in pools)


def _toml(cfg: dict) -> str:
    """vl_config's dict as TOML (tables, arrays of tables, scalars, lists)."""

    def value(v):
        return json.dumps(v) if not isinstance(v, bool) else str(v).lower()

    lines = [f"{k} = {value(v)}" for k, v in cfg.items() if not isinstance(v, (dict, list)) or k == "weights"]
    for k, v in cfg.items():
        if isinstance(v, dict):
            lines += [f"[{k}]"] + [f"{kk} = {value(vv)}" for kk, vv in v.items()]
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            for item in v:
                lines += [f"[[{k}]]"] + [f"{kk} = {value(vv)}" for kk, vv in item.items()]
    return "\n".join(lines) + "\n"


def test_cli_worker_flags_reach_the_vision_pool(root, monkeypatch, capsys):
    """`zephon hashes --workers 0` on a recipe whose [vision] asks for 2 process workers starts
    no worker process (the flags reach every pool, not only the default one)."""
    from zephon.engine import WorkerPool
    from zephon.tools.cli import main

    cfg = vl_config(root)
    cfg["vision"] = dict(cfg["vision"], workers=2, backend="process")
    path = os.path.join(root, "vision_process.toml")
    with open(path, "w") as f:
        f.write(_toml(cfg))
    started = []
    real = WorkerPool._start_processes
    monkeypatch.setattr(WorkerPool, "_start_processes", lambda self: started.append(self) or real(self))
    assert main(["hashes", path, "--steps", "2", "--workers", "0"]) == 0
    assert started == [] and multiprocessing.active_children() == []
    inline = [l for l in capsys.readouterr().out.splitlines() if l.startswith("step ")]
    assert main(["hashes", path, "--steps", "2"]) == 0  # without the flag: the recipe's 2 processes
    assert [p.config.count for p in started] == [2]
    assert [l for l in capsys.readouterr().out.splitlines() if l.startswith("step ")] == inline


@pytest.mark.parametrize("resume_world", [1, 2])
def test_save_at_w4_resume_elsewhere(recipe, reference, resume_world):
    first, state = run(recipe, 4, 3)
    rest, _ = run(recipe, resume_world, STEPS - 3, WorkerConfig(2, "thread"), state=state)
    assert first + rest == reference


def test_chained_resumes(recipe, reference):
    a, st = run(recipe, 4, 2)
    b, st = run(recipe, 1, 3, state=st)
    c, _ = run(recipe, 2, STEPS - 5, WorkerConfig(4, "thread"), state=st)
    assert a + b + c == reference


def test_text_only_lane_state_is_small(recipe):
    _, state = run(recipe, 4, 3)
    for k, v in state.items():
        if k.startswith("lane_"):
            assert len(encode_state({k: v})[k]) < 2048


# -- the batch format ---------------------------------------------------------------------------
def test_batch_format(recipe):
    p = recipe.prepare()
    sp = p.special
    v = recipe.vision
    m2 = v.merge_size**2
    seen_datasets = set()
    with recipe.global_loader(2) as g:
        for _ in range(STEPS):
            b = next(g)
            B, S = b["input"].shape
            assert (recipe.global_batch_size, recipe.seq_len) == (B, S)
            assert b["labels"].shape == (B, S) and b["positions"].shape == (B, S)
            assert b["mrope_positions"].shape == (B, S, 3)
            assert b["pixel_values"].dtype == np.float32 and b["pixel_values"].shape[1] == v.patch_dim == 1536
            n_img = len(b["grid_thw"])
            assert b["images_per_row"].sum() == n_img
            assert b["pixel_values"].shape[0] == int(b["grid_thw"].prod(axis=1).sum())
            # per lane micro-batch: at most max_images_per_batch images
            per_lane = b["images_per_row"].reshape(recipe.lanes, -1).sum(axis=1)
            assert (per_lane <= v.max_images_per_batch).all()
            # placeholder runs, in row-major order, match the images' merged token counts
            runs = []
            for r in range(B):
                row = b["input"][r]
                is_img = row == sp["image"]
                starts = np.flatnonzero(is_img & ~np.r_[False, is_img[:-1]])
                ends = np.flatnonzero(is_img & ~np.r_[is_img[1:], False])
                assert len(starts) == b["images_per_row"][r]
                for s0, e0 in zip(starts, ends):
                    assert row[s0 - 1] == sp["vision_start"] and row[e0 + 1] == sp["vision_end"]
                    runs.append(e0 - s0 + 1)
            assert runs == [int(t * h * w) // m2 for t, h, w in b["grid_thw"]]
            # labels: shifted inputs, -100 on vision tokens and padding
            special = np.array(list(sp.values()))
            nxt = np.concatenate([b["input"][:, 1:], np.zeros((B, 1), np.int64)], axis=1)
            masked = b["labels"] == -100
            assert not np.isin(b["labels"], special).any()
            assert (masked | (b["labels"] == nxt) | (np.arange(S) == S - 1)).all()
            assert masked[np.isin(nxt, special)].all()
            seen_datasets.update(np.unique(b["dataset"]).tolist())
    assert {0, 1, 2, 3} <= seen_datasets  # wds, pairs, interleaved and text all delivered


def test_mrope_positions():
    # text, image (2x2 merged grid), text, as TorchTitan's collator lays them out
    tokens = np.array([5, 6, 1, 9, 9, 9, 9, 2, 7, 8])
    pos = mrope_positions(tokens, 9, np.array([[1, 4, 4]]), 2)
    assert pos[:3].tolist() == [[0, 0, 0], [1, 1, 1], [2, 2, 2]]
    assert pos[3:7].tolist() == [[3, 3, 3], [3, 3, 4], [3, 4, 3], [3, 4, 4]]
    assert pos[7:].tolist() == [[5, 5, 5], [6, 6, 6], [7, 7, 7]]


# -- image operators --------------------------------------------------------------------------------
def test_smart_resize_budget():
    for h, w in [(24, 96), (96, 24), (33, 47), (200, 300), (3000, 4000), (1, 1)]:
        rh, rw = smart_resize(h, w, 16, 2, 1024, 4096)
        assert rh % 32 == 0 and rw % 32 == 0 and 1024 <= rh * rw <= 4096
    # extreme aspect ratios keep one merged patch on the short side (as TorchTitan does)
    assert smart_resize(1000, 10, 16, 2, 1024, 4096) == (640, 32)
    assert smart_resize(64, 64, 14, 2, 56 * 56, 28 * 28 * 1280) == (56, 56)


def test_patchify_block_order():
    H, W, ps, m, ts = 64, 96, 16, 2, 2
    img = np.arange(H * W * 3, dtype=np.float32).reshape(H, W, 3)
    patches, grid = patchify(img, ps, ts, m)
    assert grid.tolist() == [1, 4, 6] and patches.shape == (24, 3 * ts * ps * ps)
    # the reference: TorchTitan's einops pattern "(t pt) (bh m ph) (bw n pw) c -> (t bh bw m n) (c pt ph pw)"
    einops = pytest.importorskip("einops")
    ref = einops.rearrange(
        np.repeat(img[None], ts, 0),
        "(t pt) (bh m ph) (bw n pw) c -> (t bh bw m n) (c pt ph pw)",
        pt=ts,
        ph=ps,
        pw=ps,
        m=m,
        n=m,
    )
    assert np.array_equal(patches, ref)


def _orientation_jpeg(orientation: int) -> bytes:
    from PIL import Image

    im = Image.new("RGB", (40, 20), (255, 0, 0))
    im.paste((0, 0, 255), (0, 0, 10, 20))  # blue band on the left
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    im.save(buf, format="JPEG", quality=95, exif=exif.tobytes())
    return buf.getvalue()


def test_decode_applies_exif_and_converts_to_rgb():
    im = decode_image(_orientation_jpeg(6))  # rotate 90 degrees clockwise on display
    assert im.size == (20, 40) and im.mode == "RGB"
    top = np.asarray(im)[2, 10]
    assert top[2] > 200 and top[0] < 60  # the left band is now on top
    from PIL import Image

    for mode in ("L", "RGBA", "P", "CMYK"):
        buf = io.BytesIO()
        Image.new(mode, (33, 35)).save(buf, format="PNG" if mode != "CMYK" else "JPEG")
        assert decode_image(buf.getvalue()).mode == "RGB"


def test_decoding_is_bit_identical_across_threads_processes_and_runs(recipe):
    """The mapper stage alone (fetch, decode, resize, normalise, patchify, tokens) over one lane's
    items: inline, thread and process workers give the same bytes, twice."""
    p = recipe.prepare()

    def digest(workers):
        src = LaneWorkSource(p.plan, 1)
        node = OrderedMapper(src, batch_fn=p.pipeline, workers=workers, chunk_size=4)
        h = hashlib.sha256()
        n_img = 0
        try:
            for _ in range(40):
                d = next(node)
                h.update(d.tokens.tobytes())
                if d.pixel_values is not None:
                    h.update(d.pixel_values.tobytes())
                    h.update(d.grid_thw.tobytes())
                    n_img += d.num_images
        finally:
            node.close()
        return h.hexdigest(), n_img

    ref = digest(WorkerConfig(0))
    assert ref[1] > 10
    for w in [WorkerConfig(0), WorkerConfig(3, "thread"), WorkerConfig(2, "process")]:
        assert digest(w) == ref
    # and each image alone, in a process pool vs here
    import concurrent.futures as cf
    import multiprocessing as mp

    imgs = [s["image"] for s in generate_image_text(12, 0)]
    cfg = VisionConfig(min_pixels=1024, max_pixels=4096)
    here = [preprocess_image(b, cfg).tobytes() for b in imgs]
    with cf.ProcessPoolExecutor(2, mp_context=mp.get_context("forkserver")) as ex:
        there = [a.tobytes() for a in ex.map(preprocess_image, imgs, [cfg] * len(imgs))]
    assert here == there


# -- node checks ------------------------------------------------------------------------------------
def _mm_source(recipe, lane, workers=WorkerConfig(0)):
    p = recipe.prepare()
    node = LaneWorkSource(p.plan, lane)
    node = OrderedMapper(node, batch_fn=p.pipeline, workers=workers, chunk_size=4)
    return SkipCounter(node, dataset_names=[s.name for s in recipe.datasets], lanes=recipe.lanes)


def test_check_node_mapper_fetch_vision(recipe):
    check_node(
        lambda: OrderedMapper(
            LaneWorkSource(recipe.prepare().plan, 0), batch_fn=recipe.prepare().pipeline, chunk_size=4
        ),
        max_steps=24,
        every=3,
        compare_steps=6,
    )


def test_check_node_mmpack(recipe):
    v = recipe.vision
    sp = recipe.prepare().special

    def make():
        return MMPack(
            _mm_source(recipe, 2),
            seq_len=recipe.seq_len,
            rows=2,
            patch_dim=v.patch_dim,
            max_images_per_batch=4,
            max_images_per_row=3,
            flush_every=5,
            pad_id=2,
            ignore_ids=list(sp.values()),
        )

    res = check_node(make, max_steps=14)
    assert res.steps == 14 and res.max_state_bytes < 1024


def test_check_node_whole_lane(recipe):
    res = check_node(
        lambda: recipe.build_lane(LaneContext(seed=recipe.seed, lane=3, lanes=recipe.lanes)), max_steps=8, every=2
    )
    assert res.steps == 8 and res.max_state_bytes < 1500


def test_check_node_lane_with_process_workers(recipe):
    check_node(
        lambda: MMPack(
            _mm_source(recipe, 1, WorkerConfig(2, "process")),
            seq_len=recipe.seq_len,
            rows=2,
            patch_dim=recipe.vision.patch_dim,
            max_images_per_batch=6,
            flush_every=7,
        ),
        max_steps=6,
        every=3,
    )


# -- bad images and the error policy ---------------------------------------------------------
def _bad_samples():
    from PIL import Image

    good = generate_image_text(40, 9)
    jpeg = next(s for s in good if s["ext"] == "jpg")
    big = io.BytesIO()
    Image.new("1", (20000, 20000)).save(big, format="PNG")  # 400 Mpx: a decompression bomb
    wide = io.BytesIO()
    Image.new("RGB", (300, 200), (1, 2, 3)).save(wide, format="PNG")  # above max_image_pixels below
    bad = {
        "truncated": {"image": jpeg["image"][: len(jpeg["image"]) // 2], "ext": "jpg"},
        "garbage": {"image": b"this is not an image at all", "ext": "png"},
        "empty": {"image": b"", "ext": "webp"},
        "bomb": {"image": big.getvalue(), "ext": "png"},
        "absurd": {"image": wide.getvalue(), "ext": "png"},
        "noimage": {"image": None},
    }
    samples = list(good)
    for i, (key, s) in enumerate(bad.items()):
        samples.insert(3 + 6 * i, {"key": f"bad-{key}", "caption": f"caption of {key}", **s})
    return samples, len(bad)


@pytest.fixture(scope="module")
def bad_root(root, tmp_path_factory):
    r = tmp_path_factory.mktemp("bad")
    samples, n_bad = _bad_samples()
    write_wds(str(r / "bad" / "b-0000.tar"), samples[: len(samples) // 2])
    write_wds(str(r / "bad" / "b-0001.tar"), samples[len(samples) // 2 :], caption="json")
    shutil.copytree(os.path.join(root, "tok"), str(r / "tok"))
    shutil.copytree(os.path.join(root, "text"), str(r / "text"))
    return str(r), n_bad


def bad_recipe(root, on_error, **kw):
    cfg = vl_config(root)
    cfg["datasets"] = [
        {
            "name": "bad",
            "kind": "image_text",
            "path": "bad/*.tar",
            "weight": 0.6,
            "on_error": on_error,
            "policy": "stop",
            **kw,
        },
        {"name": "web", "path": "text/web/*.jsonl", "weight": 0.4, "policy": "stop"},
    ]
    cfg["vision"] = dict(cfg["vision"], max_image_pixels=50_000)
    cfg["global_batch_size"] = 4
    return Recipe.from_dict(cfg, root)


def test_bad_images_raise_with_file_key_and_fix(bad_root):
    root, _ = bad_root
    r = bad_recipe(root, "raise")
    with pytest.raises(DataError) as ei, r.global_loader(1) as g:  # the reader's own DataError, from the worker
        for _ in g:
            pass
    msg = str(ei.value)
    assert "lane " in ei.value.__notes__[-1] and "Traceback" not in msg  # a message; the traceback is kept aside
    assert "DataError" in ei.value.worker_traceback
    assert "dataset 'bad'" in msg and ".tar'" in msg and "key 'bad-" in msg and 'on_error = "skip"' in msg


@pytest.mark.parametrize(
    "key,reason",
    [
        ("truncated", "truncated"),
        ("garbage", "cannot identify"),
        ("empty", "empty"),
        ("bomb", "decompression"),
        ("absurd", "max_image_pixels"),
        ("noimage", "caption but no image"),
    ],
)
def test_each_bad_kind_has_a_reason(bad_root, key, reason):
    root, _ = bad_root
    r = bad_recipe(root, "raise")
    p = r.prepare()
    ix = p.indexes[0]
    for s in range(len(ix.shards)):
        keys = [str(k) for k in ix._arrays[s]["keys"]]
        if f"bad-{key}" in keys:
            from zephon.nodes.worksource import WorkItem

            item = WorkItem(0, s, keys.index(f"bad-{key}"), 0, 0)
            with pytest.raises(DataError, match=reason) as ei:
                p.pipeline([item])
            assert f"key 'bad-{key}'" in str(ei.value)
            return
    raise AssertionError(f"bad-{key} not found")


def test_skips_are_counted_and_the_same_on_every_world_size(bad_root):
    root, n_bad = bad_root
    r = bad_recipe(root, "skip")

    def skipped(state):
        total = [0, 0]
        for k, v in state.items():
            if k.startswith("lane_"):
                node = v["state"]
                while node.get("type") != "skip_counter":
                    node = node.get("anchor") or node.get("upstream")
                total[0] += node["skipped"][0]
                total[1] += node["seen"][0]
        return total

    def epoch(world, workers=WorkerConfig(0)):
        with r.global_loader(world, workers=workers) as g:
            first = [batch_sha256(next(g)) for _ in range(12)]
            mid = skipped(decode_state(encode_state(g.state_dict())))
            rest = [batch_sha256(b) for b in g]
        return first + rest, mid

    ref = epoch(1)
    assert ref[1][1] > 0
    assert epoch(4, WorkerConfig(2, "process")) == ref
    assert epoch(2, WorkerConfig(2, "thread")) == ref
    # one epoch ("stop"): every bad record is skipped exactly once, the reasons counted per file
    total, seen, reasons = 0, 0, set()
    for lane in range(r.lanes):
        node = r.build_lane(LaneContext(seed=r.seed, lane=lane, lanes=r.lanes))
        for _ in node:
            pass
        counter = node
        while not isinstance(counter, SkipCounter):
            counter = counter.source
        c = counter.counts()
        total += c["skipped"]["bad"]
        seen += c["seen"]["bad"]
        reasons.update(row["reason"] for row in c["by_file"])
        node.close()
    assert total == n_bad and seen == 40 + n_bad
    assert len(reasons) >= 4


def test_index_and_cache(root):
    a = index_multimodal("wds", os.path.join(root, "wds/*.tar"), cache_dir=os.path.join(root, "cache2"))
    b = index_multimodal("wds", os.path.join(root, "wds/*.tar"), cache_dir=os.path.join(root, "cache2"))
    assert a.num_records == b.num_records == 96 and a.fingerprint == b.fingerprint
    assert np.array_equal(a.image_sizes(1)[1], b.image_sizes(1)[1])
    recs = a.read(1, [0, 5])
    assert isinstance(recs[0].segments[0], bytes) and isinstance(recs[0].segments[1], str)


@pytest.mark.parametrize("kind,path", [("wds", "wds/*.tar"), ("parquet", "pairs/*.parquet")])
def test_index_pickles_as_a_small_handle(root, tmp_path, kind, path):
    # process workers get the index with every task: its arrays reload from the cache folder
    cache = str(tmp_path / "cache")
    ix = index_multimodal(kind, os.path.join(root, path), cache_dir=cache)
    blob = pickle.dumps(ix)
    assert len(blob) < 6000 and ix.__getstate__()["_arrays"] == {}  # no member table in it
    for copy in (pickle.loads(blob), pickle.loads(pickle.dumps(ix))):
        for s in range(len(ix.shards)):
            assert [r.segments for r in copy.read(s, [0, 3])] == [r.segments for r in ix.read(s, [0, 3])]
            assert copy.record_bytes(s).tolist() == ix.record_bytes(s).tolist()
            assert copy.sources(s, 2) == ix.sources(s, 2) and copy.locate(s, 1) == ix.locate(s, 1)
    shutil.rmtree(cache)  # the cache gone behind our back: an unpickled copy re-indexes the shard
    assert pickle.loads(blob).record_bytes(0).tolist() == ix.record_bytes(0).tolist()
    # without a cache folder the arrays travel with the index
    nocache = index_multimodal(kind, os.path.join(root, path), cache_dir=None)
    assert pickle.loads(pickle.dumps(nocache)).read(0, [1])[0].segments == ix.read(0, [1])[0].segments


# -- recipe validation ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "vision,match",
    [
        ({"patch_sise": 16}, "unknown key 'patch_sise' in \\[vision\\]. Did you mean 'patch_size'"),
        ({"mean": [0.5, 0.5]}, "mean must be a list of 3"),
        ({"std": [0.5, 0, 0.5]}, "std must be 3 finite numbers > 0"),
        ({"min_pixels": 8192, "max_pixels": 4096}, "min_pixels = 8192 is above max_pixels"),
        ({"max_pixels": 100}, "max_pixels = 100 is below one merged patch"),
        ({"max_images_per_batch": 0}, "max_images_per_batch must be >= 1"),
        ({"patch_size": "16"}, "patch_size must be an integer"),
    ],
)
def test_vision_recipe_errors(root, vision, match):
    with pytest.raises(RecipeError, match=match):
        Recipe.from_dict(vl_config(root, vision=vision), root)


def test_dataset_kind_errors(root):
    cfg = vl_config(root)
    cfg["datasets"][0]["kind"] = "video"
    with pytest.raises(RecipeError, match="kind = 'video' is not valid"):
        Recipe.from_dict(cfg, root)
    cfg = vl_config(root)
    cfg["datasets"][3]["image_field"] = "img"
    with pytest.raises(RecipeError, match="image_field only applies to datasets with images"):
        Recipe.from_dict(cfg, root)
    cfg = vl_config(root, tokenizer={"path": TOKENIZER_DIR})  # no vision tokens in it
    with pytest.raises(RecipeError, match="image_token = '<\\|image_pad\\|>' is not a token"):
        Recipe.from_dict(cfg, root).prepare()
