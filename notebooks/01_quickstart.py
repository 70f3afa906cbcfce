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
# # 01 · Quickstart: a recipe, global batches, and what is inside them
#
# zephon is a data loader whose **global batch at step *t* is the same bytes** whatever the
# number of data-parallel ranks (W), loader workers, or resumes. This notebook takes the
# shortest path to a batch you can *see*:
#
# 1. generate the bundled demo corpus (three datasets: web JSONL, code Parquet, books text) and its recipe;
# 2. iterate global batches and look at their fields;
# 3. display a batch (decoded text, document boundaries, padding) and trace a row back to its source bytes;
# 4. look under the hood: the pipeline of one *lane*, and what one rank iterates in a real job.
#
# Everything runs offline and writes only into a temporary folder.

# %%
import tempfile

import numpy as np

import zephon
from zephon import Recipe, WorkerConfig, batch_sha256
from zephon.tools.demo import write_demo_recipe
from zephon.tools.display import explain, provenance, show

root = tempfile.mkdtemp(prefix="zephon-quickstart-")
path = write_demo_recipe(root, scale=0.3)  # generates the data (idempotent) and writes demo.toml
print(path)

# %% [markdown]
# ## The recipe
#
# A recipe is a *pure description* of the data: seed, lane count, sequence length, global batch
# size, tokenizer, datasets with token-share weights, packing, shuffling. It is validated when it
# is read — an unknown key or an impossible combination fails here, with the key and the fix in
# the message, not twenty minutes into a job.
#
# Two numbers matter for determinism:
#
# * **`lanes`** — the data is split into a fixed number of independent streams. A run can use any
#   world size that divides it (here 1, 2, 4, 8, 16). It is fixed for the life of a run, so choose
#   it as a multiple of every DP size you may ever use.
# * **`[workers]`** — only a performance setting; it is *not* part of the data, so changing it never
#   changes a batch.

# %%
print(open(path).read())

# %%
recipe = Recipe.from_toml(path)
recipe

# %% [markdown]
# `explain` prints the plan before anything runs: per dataset its size, the measured tokens per
# byte, the target and expected token share, the node graph of a lane, and for a world size the
# lanes each rank owns. (`zephon inspect demo.toml --world-size 4` prints the same from a shell.)

# %%
explain(recipe, world_size=4)

# %% [markdown]
# ## Global batches
#
# `recipe.global_loader(world_size=W)` runs all W ranks in this process and concatenates their
# local batches in rank order — the *global* batch a training step sees. It is what you use in a
# notebook or a test; in a real job each rank iterates only its own `recipe.router(...)` (below).
#
# It is a context manager: leaving the `with` block stops the worker threads/processes.

# %%
with recipe.global_loader(world_size=2, workers=WorkerConfig(2, "thread")) as g:
    batches = [next(g) for _ in range(3)]

batch = batches[0]
for name, value in batch.items():
    if isinstance(value, np.ndarray):
        print(f"{name:13s} {str(value.dtype):6s} {value.shape}")
    else:
        print(f"{name:13s} {type(value).__name__} of {len(value)} rows")

# %% [markdown]
# The fields of a packed text batch (`global_batch_size` rows of `seq_len` tokens):
#
# | field | meaning |
# |---|---|
# | `input` | token ids fed to the model |
# | `labels` | next-token targets (`input` shifted by one), `-100` where no loss is taken (padding) |
# | `positions` | position within the segment — restarts at 0 at every document segment (also when a document continues from the previous row), for RoPE and document masks |
# | `document_ids` | segment index per token within the row, `-1` on padding |
# | `dataset` | index of the dataset each token came from (`recipe.datasets[i].name`) |
# | `provenance` | per row, per segment: `(dataset, shard, record, epoch, tok_start, tok_end)` |
#
# Several documents share a row (packing), so `positions` and `document_ids` are what lets the
# model avoid attending across document boundaries:

# %%
row = 1
seg_starts = np.nonzero(batch["positions"][row] == 0)[0]
print("documents in row", row, "start at token positions", seg_starts.tolist())
print("document_ids of row", row, "as (segment id, tokens):",
      [(int(v), int(n)) for v, n in zip(*np.unique(batch["document_ids"][row], return_counts=True))])
print("provenance of row", row, ":", batch["provenance"][row])
print("padding tokens in the batch:", int((batch["document_ids"] < 0).sum()), "of", batch["document_ids"].size)

# %% [markdown]
# Every batch has a fingerprint: `batch_sha256` hashes each field's name, dtype, shape and bytes.
# These hashes are what the determinism guarantees are stated (and tested) in.

# %%
for t, b in enumerate(batches):
    print(f"step {t}: {batch_sha256(b)}")

# %% [markdown]
# ## Seeing a batch
#
# Printing token ids tells you nothing. `show(batch, recipe)` decodes each row: in Jupyter you get
# HTML with one colour per dataset, a red `‖` at each document boundary, padding counted and the
# number of masked labels; hover a segment for its shard, record and token range. In a terminal
# the same object prints as text.

# %%
view = show(batch, recipe, max_rows=4, max_chars=300)
view

# %%
print(repr(view)[:1200])

# %% [markdown]
# ### Where did this row come from?
#
# When a sample looks wrong (mojibake, a boilerplate page, a leaked test set), you want the file
# and bytes it came from. `view.provenance(row)` gives, for every segment of the row, the dataset,
# the file, a human locator (line or row number), the record's byte range in the file and the
# exact text those tokens cover.

# %%
for seg in view.provenance(row):
    print(f"{seg['dataset']:6s} {seg['file'].replace(root, '<root>')}  {seg['locator']:>10s}  "
          f"tokens {seg['tokens']}  bytes of text {seg['bytes']}  file bytes {seg['file_bytes']}")
    print("        text:", repr(seg["text"][:100]), "...")

# %% [markdown]
# The provenance is exact: re-read the record from the file, tokenize it and slice the cited token
# range, and you get the row's tokens back. Here for the row's first segment that is a whole
# document (a part of a long document carries two more fields, `part` and `parts`: it was cut from
# the text with `zephon.nodes.part_span` and tokenized on its own):

# %%
p = recipe.prepare()  # tokenizer, indexes and token estimates (computed once per Recipe)
i = next(i for i, seg in enumerate(batch["provenance"][row]) if len(seg) == 6)
first = provenance(recipe, batch, row)[i]  # the function behind view.provenance(row)
d, shard, record, epoch, t0, t1 = batch["provenance"][row][i]
record_text = p.indexes[d].read(shard, [record])[0]
tokens = p.tokenizer.encode_batch([record_text])[0]  # BOS/EOS included, as in training
start = first["row_positions"][0]
print("segment reproduced from the source file:",
      np.array_equal(np.asarray(tokens[t0:t1]), batch["input"][row][start:start + (t1 - t0)]))

# %% [markdown]
# ## Under the hood: lanes and nodes
#
# A global batch is made of `lanes` independent pipelines. Each lane is a chain of
# [torchdata.nodes](https://pytorch.org/data/) nodes that you can build, iterate and print
# yourself:
#
# * `LaneWorkSource` decides *which* records the lane reads (the token-weighted mixture);
# * `OrderedMapper` fetches and tokenizes them on a worker pool, **returning results in input order**;
# * `Pack`, `WindowShuffle`, `Batch` are *accumulators*: single-threaded, stateful, checkpointed by
#   "flush and replay" (notebook 02 writes one).
#
# `recipe.build_lane(ctx)` builds one lane; the `LaneContext` says which lane of how many.

# %%
lane = recipe.build_lane(zephon.engine.LaneContext(seed=recipe.seed, lane=0, lanes=recipe.lanes))
print(lane.describe())

# %%
micro = next(lane)  # lane 0's micro-batch at step 0: rows_per_lane rows
print({k: getattr(v, "shape", len(v)) for k, v in micro.items()})
print("lane 0's rows are the first rows of global batch 0:", np.array_equal(micro["input"], batch["input"][: recipe.rows_per_lane]))
print("a lane's whole checkpoint is", len(str(lane.state_dict())), "characters of JSON")
lane.close()

# %% [markdown]
# ## One rank of a real job
#
# In training, rank `r` of `W` iterates `recipe.router(world_size=W, rank=r)`: a torchdata node
# that owns the contiguous lanes `[r·L/W, (r+1)·L/W)` and yields their step-*t* micro-batches
# concatenated. Its rows are exactly rank `r`'s slice of the global batch — no sampler, no
# `set_epoch`, no coordination between ranks.

# %%
W, rank = 4, 1
with recipe.router(world_size=W, rank=rank, workers=WorkerConfig(0)) as router:  # 0 = inline, no pool
    print(router)
    local = next(router)
    rows = recipe.global_batch_size // W
    print("local batch", local["input"].shape,
          "== rows", rank * rows, "to", (rank + 1) * rows, "of the global batch:",
          np.array_equal(local["input"], batch["input"][rank * rows:(rank + 1) * rows]))
    print("state keys of this rank:", [k for k in router.state_dict() if k.startswith("lane_")])

# %% [markdown]
# Note that batch 0 above was produced with `world_size=2` and 2 worker threads, and this rank runs
# with `world_size=4` and no workers at all — yet its rows match. That is the whole point; notebook 04
# shows it across world sizes, worker backends and resumes.
#
# **Next:** 02 — writing your own node; 03 — mixtures and curricula; 04 — elastic determinism.
