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
# # 03 · Mixtures and curricula
#
# Most pretraining runs mix several sources — web, code, books — in chosen proportions, and
# change the proportions during training (more code late, a high-quality "anneal" phase at the
# end). This notebook shows how to say that in a zephon recipe and how to *check* that the
# loader does what you asked before you spend a GPU-week on it:
#
# * token-weighted mixing and the token estimates it relies on;
# * plots of realised vs target token shares, packing efficiency and document lengths;
# * a curriculum (`schedule`) that changes the weights at a step;
# * mixing by samples vs by tokens — and why the difference matters;
# * per-node throughput from the pipeline's own counters.
#
# Everything is small (8 lanes, 16 rows of 256 tokens per step) so it runs in seconds.

# %%
import tempfile

import matplotlib.pyplot as plt
import numpy as np

# %matplotlib inline

from zephon import Recipe, WorkerConfig
from zephon.tools import plots
from zephon.tools.demo import TOKENIZER_DIR, write_demo_recipe

root = tempfile.mkdtemp(prefix="zephon-mixtures-")
demo_toml = write_demo_recipe(root, scale=0.3)  # the demo corpus: web/*.jsonl, code/*.parquet, books/*.txt

# %% [markdown]
# ## A recipe in Python
#
# `Recipe.from_dict(config, base_dir)` takes the same structure as a TOML recipe; relative paths
# are resolved against `base_dir`. It is validated immediately: try misspelling `weight`, or
# setting `global_batch_size = 20` with 8 lanes, and the error names the key and the fix.

# %%
config = {
    "seed": 0,
    "lanes": 8,
    "seq_len": 256,
    "global_batch_size": 16,  # 2 packed rows per lane per step
    "cache_dir": "cache",     # dataset indexes are cached here
    "tokenizer": {"path": TOKENIZER_DIR},  # the small BPE tokenizer bundled with zephon
    "datasets": [
        {"name": "web", "path": "web/*.jsonl", "format": "jsonl", "text_field": "text", "weight": 0.6},
        {"name": "code", "path": "code/*.parquet", "format": "parquet", "weight": 0.25},
        {"name": "books", "path": "books/*.txt", "format": "text", "text_mode": "line", "weight": 0.15},
    ],
    "pack": {"algorithm": "greedy", "flush_every": 64},
    "shuffle": {"buffer": 4},
    "workers": {"count": 0},  # inline: the fastest choice for a tiny notebook run
}
recipe = Recipe.from_dict(config, root)
recipe

# %%
try:
    Recipe.from_dict({**config, "datasets": [{**config["datasets"][0], "wieght": 0.6}]}, root)
except Exception as e:
    print(type(e).__name__, ":", e)

# %% [markdown]
# ## Token-weighted mixing and its estimates
#
# The weights are **shares of tokens**, not of documents: `web = 0.6` means 60 % of the training
# tokens come from web. Documents have very different lengths per source, so the loader must
# know how many tokens a record will produce *before* tokenizing it — it decides which record a
# lane reads next from the record's byte size and a measured **tokens per byte** per dataset.
#
# `recipe.prepare()` indexes the datasets and measures those estimates by tokenizing a seeded
# sample of records (`mixing.estimate_samples`, 256 by default). The estimates are saved in every
# checkpoint and reused on resume, so a resumed run never re-derives them differently.

# %%
prepared = recipe.prepare()
for name, est in prepared.estimates.items():
    print(f"{name:6s} {est.tokens_per_byte:.4f} tokens/byte + {est.tokens_per_record:.0f} per record (BOS/EOS), "
          f"measured on {est.sampled} records")

# %% [markdown]
# ## Realised vs target token shares
#
# `plots.plot_token_shares(recipe, steps)` runs the loader for `steps` global batches, counts the
# tokens of each dataset (from the per-token `dataset` field) and plots the cumulative realised
# share against the target (dashed). With 16 rows of 256 tokens per step the first steps are
# noisy — a book chapter alone can fill several rows — and the shares converge as steps go by.

# %%
plots.plot_token_shares(recipe, steps=40)

# %% [markdown]
# If the lines do not converge to the dashed targets, the estimates are off (e.g. a dataset
# whose records mix languages) or a dataset ran out (`policy = "stop"`). Fix it here, not after
# the run.
#
# ## Packing efficiency and document lengths
#
# Rows are packed from whole documents and parts of documents. `greedy` packing splits
# documents at row boundaries and wastes nothing; `best_fit` and `first_fit` keep documents
# whole (when they fit in a row) at the cost of some padding. The histogram is over rows:

# %%
plots.plot_packing_efficiency(recipe, steps=10)

# %%
plots.plot_packing_efficiency(recipe.replace(pack={"algorithm": "best_fit", "flush_every": 64}), steps=10)

# %% [markdown]
# Why the difference? Look at how long the documents are compared with a 256-token row:
# `plot_document_lengths` tokenizes a seeded sample of each dataset.

# %%
plots.plot_document_lengths(recipe, samples=200)

# %% [markdown]
# ## A curriculum
#
# A `schedule` is a list of phases, each `{"step": N, "weights": {...}}`; from global step `N` on,
# the weights change (datasets not named get weight 0). In TOML:
#
# ```toml
# [[schedule]]
# step = 20
# weights = { web = 0.2, code = 0.7, books = 0.1 }
# ```
#
# The schedule is part of the recipe's fingerprint, like the weights: a checkpoint refuses to
# resume under a different curriculum rather than silently feeding different data.

# %%
curriculum = Recipe.from_dict({**config, "schedule": [{"step": 20, "weights": {"web": 0.2, "code": 0.7, "books": 0.1}}]}, root)
steps = 48
shares = plots.token_shares(curriculum, steps)  # cumulative realised share per dataset after each step
plots.plot_token_shares(curriculum, shares=shares)

# %% [markdown]
# The cumulative share bends at step 20 but only slowly reaches the new targets — by design, it
# averages over all steps so far. To see the switch itself, look at each step's own share (here
# smoothed over 4 steps):

# %%
per_step = []
with curriculum.global_loader(world_size=1) as g:
    for _ in range(steps):
        ds = next(g)["dataset"]
        per_step.append(np.bincount(ds[ds >= 0], minlength=len(curriculum.datasets)))
per_step = np.array(per_step, dtype=float)
kernel = np.ones(4)
smooth = np.stack([np.convolve(per_step[:, d], kernel, "valid") for d in range(per_step.shape[1])], 1)
smooth /= smooth.sum(1, keepdims=True)
target = plots.target_shares(curriculum, steps)

fig, ax = plt.subplots(figsize=(7, 3.2))
x = np.arange(3, steps)
for d, spec in enumerate(curriculum.datasets):
    line, = ax.plot(x, smooth[:, d], label=f"{spec.name} (realised, 4-step mean)")
    ax.plot(np.arange(steps), target[:, d], "--", color=line.get_color(), alpha=0.6)
ax.axvline(20, color="grey", lw=0.8)
ax.set_xlabel("step")
ax.set_ylabel("token share of the step")
ax.set_ylim(0, 1)
ax.legend(fontsize=7)
ax.set_title("Curriculum: per-step token shares (dashed: target)")
fig.tight_layout()
fig

# %% [markdown]
# Each lane switches when the tokens it has *planned* reach step 20's worth; the shuffle window
# and the packer's open rows delay the visible switch by a few steps (and the 4-step mean
# blurs it further). That delay is itself deterministic: it is identical for every world size
# and worker count (notebook 04).
#
# ## Mixing by samples vs by tokens
#
# Some recipes specify shares of *documents* instead (`"mixing": {"by": "samples"}`). With
# sources of very different document lengths the two are far apart. Compare the realised token
# shares of the same weights under both modes:

# %%
by_samples = Recipe.from_dict({**config, "mixing": {"by": "samples"}}, root)
tok = plots.token_shares(recipe, 30)[-1]
smp = plots.token_shares(by_samples, 30)[-1]
print(f"{'dataset':8s} {'weight':>7s} {'tokens: by tokens':>18s} {'tokens: by samples':>19s}")
for d, spec in enumerate(recipe.datasets):
    print(f"{spec.name:8s} {spec.weight:7.2f} {tok[d]:18.3f} {smp[d]:19.3f}")

# %% [markdown]
# Mixing by samples gives `books` — few but long records — several times its nominal share of
# the tokens the model actually sees. Mixing by tokens (the default) is what "15 % books" usually
# means.
#
# ## Where does the time go?
#
# Every node counts the items it produced and the seconds spent in `next()` — inclusive of its
# upstreams (`busy_s`) and its own (`self_s`). `router.summary_metrics()` sums them over a rank's
# lanes; the mapper also reports how long it waited for workers. With inline workers, fetch and
# tokenize dominates — the place to add `[workers]`.

# %%
with recipe.router(world_size=1, rank=0, workers=WorkerConfig(2, "thread")) as router:
    for _ in range(20):
        next(router)
    metrics = router.summary_metrics()
for name, m in metrics.items():
    print(f"{name:15s} items {m['items']:6d}  own {m['self_s']:.3f} s  {m.get('items_per_s', 0):10.0f} items/s")
plots.plot_node_throughput(metrics)
