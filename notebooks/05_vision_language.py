# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: -all
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05 · Vision-language batches: images, text and their tokens, deterministically
#
# A vision-language model trains on rows that mix text tokens with **image placeholder tokens**,
# plus the images' pixels as patches. zephon builds those batches with the same guarantees as
# text: global batch *t* is the same bytes (pixels included) on any world size, with any
# workers, and after a resume elsewhere. This notebook:
#
# 1. generates a small corpus: image-caption pairs (WebDataset `.tar` and Parquet), OBELICS-style
#    interleaved documents (several images per document) and plain text, mixed in one recipe;
# 2. shows a batch — thumbnails beside their placeholder tokens — and its fields and shapes, and
#    traces a sample back to the bytes of its caption and image;
# 3. checks the hashes across world sizes, thread and process workers and a resume;
# 4. hands a batch to TorchTitan in its multimodal format;
# 5. shows what happens with a corrupt image (the dataset's error policy).
#
# Everything is generated offline (images drawn with Pillow) under a temporary folder.

# %%
import os
import shutil
import tempfile
import time

import matplotlib.pyplot as plt
import numpy as np
from tokenizers import AddedToken, Tokenizer

import zephon
from zephon import Recipe, WorkerConfig, batch_sha256
from zephon.engine.checkpoint import decode_state, encode_state
from zephon.tools.demo import TOKENIZER_DIR
from zephon.tools.display import explain, show, unpatchify
from zephon.nodes.images import patchify
from zephon.tools.synth import generate_image_text, make_demo_corpus, make_vision_corpus, write_wds

root = tempfile.mkdtemp(prefix="zephon-vl-")
t0 = time.time()
paths = make_vision_corpus(root, seed=0, n_wds=48, n_parquet=32, n_interleaved=16)
make_demo_corpus(os.path.join(root, "text"), seed=3, scale=0.02)
print(f"corpus generated in {time.time() - t0:.1f} s:")
for name, glob in paths.items():
    print(f"  {name:12s} {glob.replace(root, '<root>')}")

# %% [markdown]
# ## A tokenizer with image placeholder tokens
#
# The model's tokenizer must have the Qwen-VL placeholder tokens: `<|vision_start|>`,
# `<|image_pad|>` (one per merged 2x2 group of 16-pixel patches), `<|vision_end|>` (and
# `<|video_pad|>`). Here: the bundled 4096-token BPE with those four added as special tokens.
# The recipe's `[vision]` section names them (these are the defaults).

# %%
tok_dir = os.path.join(root, "tok")
os.makedirs(tok_dir)
tok = Tokenizer.from_file(os.path.join(TOKENIZER_DIR, "tokenizer.json"))
tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                        for t in ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]])
tok.save(os.path.join(tok_dir, "tokenizer.json"))
shutil.copy(os.path.join(TOKENIZER_DIR, "tokenizer_config.json"), tok_dir)
print("vision token ids:", {t: tok.token_to_id(t) for t in ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]})

# %% [markdown]
# ## The recipe
#
# Datasets have a `kind`: `image_text` (one image and a caption per sample: `.tar` shards with
# `key.jpg` + `key.txt`/`key.json`, or Parquet with an image-bytes column), `interleaved` (lists of
# texts and images, as in OBELICS) or `text` (the default). The `[vision]` section holds the image
# settings — all part of the data definition:
#
# * `patch_size`, `merge_size` (and `temporal_patch_size`): the patch layout of the vision encoder;
# * `min_pixels` / `max_pixels`: every image is resized (aspect kept) to a pixel budget whose sides are
#   multiples of `patch_size * merge_size` — tiny here so the notebook is fast;
# * `mean` / `std`: the normalisation;
# * `max_images_per_batch`: the image budget of one lane micro-batch (next to the token budget).

# %%
recipe_toml = """
seed = 5
lanes = 4
seq_len = 128
global_batch_size = 8
cache_dir = "cache"

[tokenizer]
path = "tok"

[[datasets]]
name = "wds"
kind = "image_text"
path = "wds/*.tar"
weight = 0.35

[[datasets]]
name = "pairs"
kind = "image_text"
path = "pairs/*.parquet"
weight = 0.2

[[datasets]]
name = "obelics"
kind = "interleaved"
path = "interleaved/*.parquet"
weight = 0.25

[[datasets]]
name = "web"
path = "text/web/*.jsonl"
weight = 0.2

[vision]
patch_size = 16
merge_size = 2
min_pixels = 1024
max_pixels = 4096
mean = [0.48145466, 0.4578275, 0.40821073]
std = [0.26862954, 0.26130258, 0.27577711]
max_images_per_batch = 6

[pack]
flush_every = 16

[shuffle]
buffer = 4
"""
path = os.path.join(root, "vl.toml")
with open(path, "w") as f:
    f.write(recipe_toml)
recipe = Recipe.from_toml(path)
recipe

# %% [markdown]
# The plan is computed from metadata only: image sizes are read from the image *headers* while
# indexing, so the expected token share of each dataset counts its exact placeholder tokens.

# %%
print(explain(recipe, world_size=2).text.split("\n\nnode graph")[0])

# %% [markdown]
# ## A batch
#
# Same call as for text. A multimodal global batch has the usual per-token fields and three
# image fields: `pixel_values` (every image's patches, in token order), `grid_thw` (per image:
# frames, patch rows, patch columns) and `images_per_row`.

# %%
with recipe.global_loader(world_size=2, workers=WorkerConfig(2, "thread")) as g:
    batches = [next(g) for _ in range(3)]
batch = batches[0]
for name, value in batch.items():
    if isinstance(value, np.ndarray):
        print(f"{name:16s} {str(value.dtype):8s} {value.shape}")
    else:
        print(f"{name:16s} {type(value).__name__} of {len(value)} rows")
print("images per row:", batch["images_per_row"].tolist(), "| grid_thw of the first 3:", batch["grid_thw"][:3].tolist())

# %% [markdown]
# | field | meaning |
# |---|---|
# | `input`, `labels`, `positions`, `document_ids`, `dataset` | as for text; `labels` is `-100` wherever the *next* token is a vision token, and on padding |
# | `mrope_positions` | 3-D (time, height, width) rotary positions: an image's placeholders get their merged-grid coordinates |
# | `pixel_values` | `[total_patches, 3 * 2 * 16 * 16]` float32, normalised, TorchTitan's "block" patch order |
# | `grid_thw` | `[images, 3]`: `(1, H / 16, W / 16)` per image, in token order |
# | `images_per_row` | how many of those images belong to each row |
# | `provenance` | per row, per sample: `(dataset, shard, record, epoch, tok_start, tok_end)`, as for text |
#
# ## Seeing it
#
# `show(batch, recipe)` puts each image back where its tokens are: the run
# `<|vision_start|><|image_pad|>…<|vision_end|>` becomes a thumbnail — rebuilt from
# `pixel_values` by inverting the patch layout and the normalisation — and an
# `[image N: HxW, K tokens]` label (N indexes `grid_thw`). The hatched frame marks tokens whose
# labels are `-100`; a red `‖` marks each document boundary, padding is counted at the end.

# %%
view = show(batch, recipe, max_rows=6, max_chars=400)
view

# %% [markdown]
# The plain-text form (a terminal, a log) shows the labels only; `zephon inspect vl.toml --show 4`
# prints the same rows from a shell.

# %%
print(repr(view)[:1500])

# %% [markdown]
# The pixels are exactly what the vision encoder receives. `view.image(n)` un-patchifies image
# *n* and undoes the normalisation; patchifying it again gives the batch's `pixel_values` back.

# %%
v = recipe.vision
n_show = min(6, len(batch["grid_thw"]))
fig, axes = plt.subplots(1, n_show, figsize=(2 * n_show, 2.2))
for n, ax in enumerate(np.atleast_1d(axes)):
    ax.imshow(view.image(n), interpolation="nearest")
    t, gh, gw = batch["grid_thw"][n]
    ax.set_title(f"image {n}\n{gh * v.patch_size}x{gw * v.patch_size}", fontsize=9)
    ax.axis("off")
plt.show()

sizes = batch["grid_thw"].prod(axis=1)
starts = np.concatenate([[0], np.cumsum(sizes)])
ok = all(
    np.array_equal(patchify(unpatchify(batch["pixel_values"][starts[n]:starts[n + 1]], batch["grid_thw"][n],
                                       v.patch_size, v.temporal_patch_size, v.merge_size),
                            v.patch_size, v.temporal_patch_size, v.merge_size)[0],
                   batch["pixel_values"][starts[n]:starts[n + 1]])
    for n in range(len(sizes)))
print("un-patchify -> patchify round trip exact for all", len(sizes), "images:", ok)

# %% [markdown]
# ## Where a sample came from
#
# `view.provenance(row)` traces every sample of a row back to its source: dataset, file, the tar
# key (or Parquet row), and for each caption and image the tar member and its byte range in the
# `.tar` file (or the Parquet column, row and list entry), the tokens they became in the row and,
# for images, their index in `grid_thw`. Re-reading the cited bytes gives back the batch: the
# caption re-tokenizes to the row's tokens, the image preprocesses to the batch's pixels.

# %%
import hashlib

from zephon.nodes.images import preprocess_image

row = next(r for r in range(len(batch["input"])) for s in view.provenance(r) if s["file"].endswith(".tar"))
sample = next(s for s in view.provenance(row) if s["file"].endswith(".tar"))
print(f"row {row}: {sample['dataset']} · {sample['file'].replace(root, '<root>')} · {sample['locator']} · "
      f"tokens {sample['tokens']} at row positions {sample['row_positions']}")
for part in sorted(sample["texts"] + sample["images"], key=lambda x: x["segment"]):
    kind = f"image {part['index']}" if "sha256" in part else "caption"
    print(f"  {kind:8s} member {part['member']:16s} bytes {part['file_bytes']} -> row positions {part['row_positions']}")

image = sample["images"][0]
with open(sample["file"], "rb") as f:  # the cited bytes, read from the tar file itself
    f.seek(image["file_bytes"][0])
    data = f.read(image["file_bytes"][1] - image["file_bytes"][0])
n = image["index"]
again, _ = patchify(preprocess_image(data, v), v.patch_size, v.temporal_patch_size, v.merge_size)
print("image bytes match:", hashlib.sha256(data).hexdigest() == image["sha256"],
      "| pixels match the batch:", np.array_equal(again, batch["pixel_values"][starts[n]:starts[n + 1]]))

# %% [markdown]
# ## The same bytes on any world size, with any workers
#
# Decoding JPEG/PNG/WebP, resizing and normalising is the expensive part, so it runs on the
# ordered-parallel mapper (threads: Pillow releases the GIL; or processes). Every step is
# deterministic integer or IEEE float32 arithmetic, so the hashes — pixels included — do not move.

# %%
def hashes(world_size, workers, steps=4, state=None):
    with recipe.global_loader(world_size, workers=workers) as g:
        if state is not None:
            g.load_state_dict(state)
        return [batch_sha256(next(g)) for _ in range(steps)], g.state_dict()


t0 = time.time()
runs = {}
for W in (1, 2, 4):
    runs[f"W={W}, inline"] = hashes(W, WorkerConfig(0))[0]
runs["W=2, 2 worker threads"] = hashes(2, WorkerConfig(2, "thread"))[0]
runs["W=4, 2 worker processes"] = hashes(4, WorkerConfig(2, "process"))[0]
# save on 4 ranks after 2 steps, resume on 1 rank
first, state = hashes(4, WorkerConfig(0), steps=2)
state = decode_state(encode_state(state))  # what a checkpoint stores
rest, _ = hashes(1, WorkerConfig(2, "thread"), steps=2, state=state)
runs["W=4 -> save at step 2 -> W=1"] = first + rest
for k, hs in runs.items():
    print(f"{k:32s}", " ".join(h[:10] for h in hs))
print(f"\n{len(runs)} runs in {time.time() - t0:.1f} s; all identical:", len({tuple(h) for h in runs.values()}) == 1)

# %% [markdown]
# ## In TorchTitan's multimodal format
#
# TorchTitan 0.3.0's vision-language models (Qwen3.5) take what its `MultiModalCollator` yields:
# `pixel_values` padded per image to `[images, max_patches, patch_dim]`, `grid_thw`, the
# special-token ids and MRoPE positions. `zephon.integrations.torchtitan.ZephonDataLoader` yields exactly that on
# each DP rank (`--dataloader.recipe vl.toml`); `titan_mm_batch` converts rows of any zephon
# batch.

# %%
try:
    from zephon.integrations.torchtitan import ZephonDataLoader, titan_mm_batch
except ImportError as e:  # torchtitan is optional
    print("TorchTitan is not installed:", e)
else:
    p = recipe.prepare()
    special = {f"{k}_id": i for k, i in p.special.items()} | {"pad_id": p.tokenizer.pad_id or 0}
    inputs, labels = titan_mm_batch(batch, 0, 2, special_tokens=special, merge_size=v.merge_size)
    for k, val in inputs.items():
        print(f"{k:20s}", tuple(val.shape) if hasattr(val, "shape") else val)
    print(f"{'labels':20s}", tuple(labels.shape), "| -100 on", int((labels == -100).sum()), "positions")
    # what rank 1 of 2 hands the trainer: its rows of the same global batch
    loader = ZephonDataLoader.Config(recipe=path).build(dp_world_size=2, dp_rank=1, seq_len=128, local_batch_size=4)
    try:
        rank_inputs, rank_labels = next(loader)
    finally:
        loader.close()
    same = titan_mm_batch(batch, 4, 8, special_tokens=loader.special_tokens, merge_size=v.merge_size)[0]
    print("rank 1's first microbatch == rows 4..8 of the global batch:",
          all((a is None and b is None) or bool((a == b).all()) for a, b in
              ((rank_inputs[k], same[k]) for k in ("input", "positions", "mrope_positions", "pixel_values", "grid_thw"))))

# %% [markdown]
# ## A corrupt image
#
# Real image corpora have truncated files, non-images and decompression bombs. Each dataset's
# `on_error` decides: `"raise"` (the default) stops with the dataset, file and sample key, and
# the fix; `"skip"` drops the sample, counts it per file with the reason, and — because the skip
# is a function of the sample alone — the batches stay identical on every world size.

# %%
samples = generate_image_text(24, seed=9)
jpeg = next(s for s in samples if s.get("ext") == "jpg")
samples.insert(5, {"key": "broken-0001", "caption": "a cat, allegedly", "ext": "jpg",
                   "image": jpeg["image"][: len(jpeg["image"]) // 3]})  # truncated JPEG
write_wds(os.path.join(root, "bad", "bad-0000.tar"), samples)


def bad_recipe(on_error):
    text = recipe_toml.split("[[datasets]]")[0] + f"""
[[datasets]]
name = "scraped"
kind = "image_text"
path = "bad/*.tar"
weight = 0.7
on_error = "{on_error}"
policy = "stop"

[[datasets]]
name = "web"
path = "text/web/*.jsonl"
weight = 0.3
policy = "stop"
""" + "[vision]" + recipe_toml.split("[vision]")[1]
    p = os.path.join(root, f"bad_{on_error}.toml")
    with open(p, "w") as f:
        f.write(text)
    return Recipe.from_toml(p)


try:
    with bad_recipe("raise").global_loader(1) as g:
        for _ in g:
            pass
except Exception as e:  # the worker's error, re-raised in the loader with its lane and traceback
    lines = str(e).replace(root, "<root>").splitlines()
    print(type(e).__name__ + ":", lines[0])
    print(next((line for line in lines if "DataError:" in line), lines[-1]))

# %%
skip = bad_recipe("skip")


def epoch(W, workers):
    with skip.global_loader(W, workers=workers) as g:
        return [batch_sha256(b) for b in g]


a, b = epoch(1, WorkerConfig(0)), epoch(4, WorkerConfig(2, "thread"))
print(f"one epoch: {len(a)} batches; identical on W=1 inline and W=4 with 2 threads:", a == b)
counts = {"skipped": 0, "seen": 0}
reasons = []
for lane in range(skip.lanes):
    node = skip.build_lane(zephon.engine.LaneContext(seed=skip.seed, lane=lane, lanes=skip.lanes))
    for _ in node:
        pass
    counter = node
    while not isinstance(counter, zephon.nodes.SkipCounter):
        counter = counter.source
    c = counter.counts()
    counts["skipped"] += c["skipped"]["scraped"]
    counts["seen"] += c["seen"]["scraped"]
    reasons += [(row["file"].replace(root, "<root>"), row["reason"]) for row in c["by_file"]]
    node.close()
print("scraped samples seen:", counts["seen"], "| skipped:", counts["skipped"])
for file, reason in reasons:
    print(f"  {file}: {reason}")

# %% [markdown]
# **See also:** `tests/recipe/test_vision.py` (hashes across W ∈ {1, 2, 4}, workers ∈ {0, 2, 4}, threads and
# processes, resumes; every node's restore-at-every-step check) and `tests/integrations/test_vision_titan.py`
# (TorchTitan's resize, patch layout and MRoPE positions, the Qwen3.5 debug model's forward pass
# on zephon batches, and a `CheckpointManager` round trip across world sizes).
