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
# # 04 · Elastic determinism: the same batches on any world size, worker count, and resume
#
# A training job rarely ends on the hardware it started on: nodes fail and you continue on fewer,
# capacity frees up and you scale out, you switch from threads to processes to feed a faster
# model. With a conventional loader each of those changes what the model sees from that step on
# — different documents, different order, sometimes repeated or skipped data — so loss curves
# stop being comparable and bugs stop being reproducible.
#
# zephon's contract: **global batch *t* is the same bytes** for every world size W that divides
# the lane count, for any number and kind of loader workers, and after a resume from a
# checkpoint written at any other W. This notebook checks it with hashes, then shows what a
# conventional rank-sharded loader does instead.

# %%
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

import zephon
from zephon import Recipe, WorkerConfig, batch_sha256
from zephon.engine.checkpoint import decode_state, encode_state
from zephon.engine.lanes import divisors
from zephon.tools.demo import write_demo_recipe

root = tempfile.mkdtemp(prefix="zephon-elastic-")
demo = write_demo_recipe(root, scale=0.3)
# the demo recipe with a smaller shuffle window (part of the data) and smaller worker chunks
# (a performance setting only), so that the first batch comes quickly
path = os.path.join(root, "elastic.toml")
with open(path, "w") as f:
    f.write(open(demo).read().replace("buffer = 32", "buffer = 8")
            .replace('backend = "thread"\n', 'backend = "thread"\nchunk_size = 8\n'))
recipe = Recipe.from_toml(path)
print(recipe)
print("valid world sizes:", divisors(recipe.lanes))

# %% [markdown]
# A small helper to show runs side by side: one row per run, one column per step, the first
# characters of each global batch's SHA-256 (`zephon.batch_sha256`: every field's name, dtype,
# shape and bytes). Equal hashes are the same colour.

# %%
class HashTable:
    def __init__(self, runs: dict, start: int = 0):
        self.runs, self.start = runs, start

    def _colour(self, h: str) -> str:
        return f"hsl({int(h[:6], 16) % 360}, 70%, 85%)"

    def __repr__(self) -> str:
        n = max(len(v) for v in self.runs.values())
        head = f"{'':30s}" + " ".join(f"step {self.start + t:<4d}" for t in range(n))
        return "\n".join([head] + [f"{k:30s}" + " ".join(h[:9] for h in v) for k, v in self.runs.items()])

    def _repr_html_(self) -> str:
        n = max(len(v) for v in self.runs.values())
        cells = "".join(f"<th>step {self.start + t}</th>" for t in range(n))
        rows = [f"<tr><th style='text-align:left'>run</th>{cells}</tr>"]
        for k, v in self.runs.items():
            tds = "".join(f"<td style='background:{self._colour(h)};font-family:monospace'>{h[:9]}</td>" for h in v)
            rows.append(f"<tr><td style='text-align:left'>{k}</td>{tds}</tr>")
        return "<table>" + "".join(rows) + "</table>"


def hashes(world_size: int, workers: WorkerConfig, steps: int = 6) -> list:
    with recipe.global_loader(world_size, workers=workers) as g:
        return [batch_sha256(next(g)) for _ in range(steps)]

# %% [markdown]
# ## Across world sizes and workers
#
# Each run below builds the loader from scratch. The world size changes which rank owns which
# lanes; the workers change who tokenizes. Neither changes a lane's output, so neither changes
# a global batch.
#
# The process-backed runs start worker processes from *this notebook's kernel* with the
# `forkserver` start method; that works because the function the workers run (fetch +
# tokenize) is importable from `zephon`.

# %%
t0 = time.time()
runs = {}
for W in (1, 2, 4, 8):
    runs[f"W={W}, inline"] = hashes(W, WorkerConfig(0))
runs["W=2, 2 worker threads"] = hashes(2, WorkerConfig(2, "thread"))
runs["W=8, 2 worker threads"] = hashes(8, WorkerConfig(2, "thread"))
runs["W=2, 2 worker processes"] = hashes(2, WorkerConfig(2, "process"))
print(f"{len(runs)} runs in {time.time() - t0:.1f} s; all identical:", len({tuple(v) for v in runs.values()}) == 1)
HashTable(runs)

# %% [markdown]
# A world size that does not divide the lane count is refused up front, with the valid choices —
# this is the one real constraint: **the lane count is fixed for the life of a run**, so pick it
# as a multiple of every DP size you may use (64 or 256 are common choices; lanes are cheap).

# %%
try:
    recipe.global_loader(world_size=3)
except ValueError as e:
    print(e)

# %% [markdown]
# ## Save on 4 ranks, resume on 2 and on 8
#
# `state_dict()` of a loader (or of one rank's router) is **lane-keyed**: one small JSON entry per
# lane plus entries that are identical on every rank (seed, lane count, recipe fingerprint,
# step, token estimates). In a real job each rank saves its own lanes; any W' can load the
# union, because each rank only picks the lanes it now owns.
#
# For torch.distributed.checkpoint (DCP), `zephon.engine.checkpoint.encode_state` turns the state into one bytes
# entry per lane; `decode_state` validates and parses them back.

# %%
SAVE_AT = 3
with recipe.global_loader(world_size=4) as g:
    for _ in range(SAVE_AT):
        next(g)
    state = g.state_dict()

encoded = encode_state(state)
print("entries:", list(encoded)[:3], "...", f"({len(encoded)} in all)")
print("bytes per lane:", sorted({len(v) for k, v in encoded.items() if k.startswith("lane_")}),
      "| shared entry:", len(encoded["zephon"]), "bytes | total:", sum(len(v) for v in encoded.values()), "bytes")

# %% [markdown]
# A lane's entry says which lane it is (`lane`), at which step it was saved (`step`), and carries
# a SHA-256 `digest` of its content bound to the run, so an edited, corrupt or swapped entry is
# refused on restore. Its `state` is the lane's whole pipeline, outermost node first: the batcher,
# the shuffle window, the packer, the skip counter, the mapper and the work source. Each
# accumulator stores its upstream's state at its last flush point (`anchor`), its counters there
# (`extra`) and how many outputs it has delivered since (`since`). Positions and counters only,
# never buffered tokens: a restore replays at most one flush interval (notebook 02).

# %%
def outline(state: dict, depth: int = 0) -> None:
    """One line per node of a lane state: its type and its own fields (nested node states below it)."""
    nested = {k: v for k, v in state.items() if isinstance(v, dict) and "type" in v}
    own = {k: v for k, v in state.items() if k not in nested and k not in ("type", "version")}
    print("  " * depth + f"{state['type']}: {json.dumps(own)}")
    for child in nested.values():
        outline(child, depth + 1)


lane_bytes = encoded["lane_00005"]
entry = json.loads(lane_bytes)
print(f"lane 5 at step {SAVE_AT}: {len(lane_bytes)} bytes of JSON; lane {entry['lane']}, step {entry['step']}, "
      f"digest {entry['digest'][:16]}...\n")
outline(entry["state"])

# %% [markdown]
# Now restore the decoded state on 2 ranks and on 8 ranks and compare the next steps with the
# uninterrupted run:

# %%
restored = decode_state(encoded)
resumed = {"uninterrupted (W=1)": runs["W=1, inline"][SAVE_AT:]}
for W in (2, 8):
    with recipe.global_loader(world_size=W, workers=WorkerConfig(2, "thread")) as g:
        g.load_state_dict(restored)
        resumed[f"saved at W=4, resumed at W={W}"] = [batch_sha256(next(g)) for _ in range(len(runs["W=1, inline"]) - SAVE_AT)]
print("resume matches:", len({tuple(v) for v in resumed.values()}) == 1)
HashTable(resumed, start=SAVE_AT)

# %% [markdown]
# A checkpoint is also checked against the recipe: loading it into a pipeline with another
# seed, lane count or data fails with a message naming what changed, instead of quietly
# feeding different data.

# %%
other = recipe.replace(seed=recipe.seed + 1)
with other.global_loader(world_size=2) as g:
    try:
        g.load_state_dict(restored)
    except zephon.StateError as e:
        print("StateError:", e)

# %% [markdown]
# ## The contrast: a conventional rank-sharded loader
#
# The usual recipe: each rank takes its shard of the documents with a `DistributedSampler`,
# tokenizes them and packs its own stream into rows; the global batch is the concatenation of
# the ranks' local batches. Same documents, same tokenizer, same global batch shape (8 rows of
# 256 tokens) — only W changes:

# %%
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

prepared = recipe.prepare()
web = prepared.indexes[0]  # the web dataset's index
texts = [t for s in range(len(web.shards)) for t in web.read(s, list(range(web.shards[s].num_records)))]
docs = prepared.tokenizer.encode_batch(texts)


class Documents(Dataset):
    def __len__(self):
        return len(docs)

    def __getitem__(self, i):
        return torch.as_tensor(docs[i])


def naive_hashes(world_size: int, steps: int = 6, rows: int = 8, seq_len: int = 256) -> list:
    per_rank = rows // world_size
    streams, buffers = [], []
    for rank in range(world_size):
        sampler = DistributedSampler(Documents(), num_replicas=world_size, rank=rank, shuffle=True, seed=0)
        streams.append(iter(DataLoader(Documents(), batch_size=None, sampler=sampler)))
        buffers.append([])
    out = []
    for _ in range(steps):
        local = []
        for rank in range(world_size):  # each rank packs its own documents into its rows
            need = per_rank * seq_len
            while len(buffers[rank]) < need:
                buffers[rank].extend(next(streams[rank]).tolist())
            local.append(np.asarray(buffers[rank][:need], dtype=np.int64).reshape(per_rank, seq_len))
            buffers[rank] = buffers[rank][need:]
        out.append(batch_sha256({"input": np.concatenate(local)}))
    return out


naive = {f"naive, W={W}": naive_hashes(W) for W in (1, 2, 4, 8)}
print("naive runs identical:", len({tuple(v) for v in naive.values()}) == 1)
HashTable(naive)

# %% [markdown]
# Every world size gives a different stream: the sampler deals documents to ranks round-robin,
# so *which* documents share a row, and in which order rows appear, depends on W. Resuming such
# a loader on another W has no right answer — the sampler's position at W=4 has no equivalent at
# W=2 — so jobs either restart the epoch (repeating data) or skip ahead (dropping data).
#
# zephon avoids this by making the unit of data ownership the **lane**, not the rank: lanes are
# fixed for the run, each lane's stream depends only on (recipe, seed, lane), and a rank is just
# a contiguous block of lanes.
#
# ## From a shell: `zephon hashes`
#
# The same check without Python: `zephon hashes RECIPE` prints `step <t> <sha256>` per global
# batch, can save the lane-keyed state after a step, and resume from it on another world size.
# CI jobs can diff these lines across W. (In a notebook you can also write
# `!zephon hashes ...`; here we call it through `sys.executable -m zephon` so it uses this
# kernel's environment.)

# %%
ckpt = os.path.join(root, "ckpt")


def zephon_cli(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "zephon", *args], capture_output=True, text=True, check=True)
    return out.stdout


print(zephon_cli("hashes", path, "--world-size", "4", "--steps", "3", "--save-at", "3", "--checkpoint", ckpt))
print(zephon_cli("hashes", path, "--world-size", "8", "--steps", "3", "--resume", ckpt))
print("same as this notebook:", runs["W=1, inline"])

# %% [markdown]
# The CLI's six hashes are the notebook's: a different process, W=4 then a resume at W=8, two
# worker threads (the recipe's `[workers]`) — the same bytes.
#
# **What is (and is not) guaranteed**
#
# * Identical for every W dividing `lanes`, any worker count/backend, and across resumes — as long
#   as the recipe (its fingerprint: data files, tokenizer, seed, weights, schedule, packing) is
#   unchanged. A changed recipe is refused on resume, not silently accepted.
# * The lane count and `pack.flush_every` are part of the data: changing them changes the batches.
# * Only the *global* batch is invariant; a rank's local batch is its slice of it, so which rank
#   sees which rows does depend on W (that is what data parallelism means).
