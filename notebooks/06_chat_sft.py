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
# # 06 · Chat and SFT data: a packed batch and its assistant-only loss mask
#
# Fine-tuning data is conversations. zephon renders each one with a chat template (the
# tokenizer's own, or one the recipe names), tokenizes it **whole** and trains only on the
# assistant's tokens: every other label is `-100`. Conversations are packed whole into rows
# (`first_fit` / `best_fit`), with `positions` restarting at each one, mixed with plain text by
# tokens, and every batch is the same bytes on any world size, worker count and resume.
#
# This notebook:
#
# 1. writes a small recipe: conversations in the `messages` form (JSONL, the tokenizer's own
#    ChatML template) and in the ShareGPT form (Parquet, the named `chatml_generation` template with
#    `{% generation %}` markers), mixed with web text;
# 2. shows one packed row: which tokens are trained on, conversation by conversation;
# 3. checks the mask against transformers' `return_assistant_tokens_mask`;
# 4. reports the long-conversation policy counts and the realized token shares;
# 5. checks the hashes across world sizes, workers and a resume;
# 6. shows conversations with images (vision-language SFT): a packed batch with its images in
#    place of their placeholder runs, and each dataset's share of tokens trained on.

# %%
import json
import os
import tempfile

import numpy as np

from zephon import Recipe, WorkerConfig, batch_sha256
from zephon.data import TextTokenizer
from zephon.data.chat import CHAT_TOKENIZER, load_chat_template
from zephon.nodes import provenance_entry, row_spans
from zephon.recipe.chat import realized_shares
from zephon.tools.chat_demo import write_chat_recipe

root = tempfile.mkdtemp(prefix="zephon-chat-")
path = write_chat_recipe(root, lanes=4, seq_len=256, global_batch_size=8, long="truncate_turns")
print(open(path).read())

# %% [markdown]
# ## One packed batch
#
# `labels` is the input shifted by one inside each conversation, and `-100` wherever the target
# is not an assistant token. Below, each conversation of the first row: trained-on targets are
# shown in `[[...]]`.

# %%
recipe = Recipe.from_toml(path)
tok = TextTokenizer(CHAT_TOKENIZER)
with recipe.global_loader(world_size=1) as g:
    batch = next(g)
print({k: getattr(v, "shape", len(v)) for k, v in batch.items()})
row = 0
labels, inputs = batch["labels"][row], batch["input"][row]
names = [d.name for d in recipe.datasets]
for entry, (lo, hi) in zip(batch["provenance"][row], row_spans(batch["provenance"][row])):
    p = provenance_entry(entry)
    pieces = []
    for i in range(lo, min(hi, len(inputs))):
        text = tok.decode([int(inputs[i])])
        trained = i > lo and labels[i - 1] != -100  # token i is the target of position i - 1
        pieces.append(f"[[{text}]]" if trained else text)
    print(f"--- {names[p.dataset]} record {p.record}, positions {lo}..{hi - 1} ---")
    print("".join(pieces)[:700])

# %% [markdown]
# The mask as a picture: one line per row, `#` where a target is trained on, `.` where it is not
# (prompts, system and tool turns, padding), `|` where a conversation starts.

# %%
for r in range(batch["input"].shape[0]):
    line = ["#" if lab != -100 else "." for lab in batch["labels"][r]]
    for i in np.flatnonzero(batch["positions"][r] == 0):
        line[i] = "|"
    print("".join(line)[:200])
print("share of targets trained on:", round(float((batch["labels"] != -100).mean()), 3))

# %% [markdown]
# ## The same mask as transformers
#
# For every conversation of the batch, re-render it with transformers (the marked ChatML
# template) and compare its `assistant_masks` with the labels zephon produced.

# %%
from transformers import AutoTokenizer  # noqa: E402

hf = AutoTokenizer.from_pretrained(CHAT_TOKENIZER)
marked = load_chat_template("chatml_generation", CHAT_TOKENIZER)
checked = 0
for r in range(batch["input"].shape[0]):
    for entry, (lo, hi) in zip(batch["provenance"][r], row_spans(batch["provenance"][r])):
        p = provenance_entry(entry)
        if recipe.datasets[p.dataset].kind != "chat" or hi > batch["input"].shape[1]:
            continue
        where = recipe.indexes[p.dataset].locate(p.shard, p.record)
        if where["locator"].startswith("line"):
            n = int(where["locator"].split()[1])
            conv = json.loads(open(where["file"]).read().splitlines()[n - 1])["messages"]
        else:
            continue  # the ShareGPT rows are checked the same way in tests/recipe/test_chat_recipe.py
        want = hf.apply_chat_template(conv, chat_template=marked, return_dict=True, return_assistant_tokens_mask=True)
        mask = np.asarray(want["assistant_masks"][: hi - lo], bool)
        got = batch["labels"][r][lo : hi - 1] != -100
        assert (got == mask[1:]).all()
        checked += 1
print("conversations checked against transformers:", checked)

# %% [markdown]
# ## Long conversations and token shares
#
# A conversation longer than a row follows its dataset's `long` policy: here `truncate_turns`
# (keep whole turns up to the last assistant turn that fits). The packer counts what it cut;
# dropped ones (`long = "drop"`) are counted skips. Mixing weights are shares of tokens
# (`[mixing] count = "all"`, or `"loss"`: only the tokens trained on).

# %%
router = recipe.router(world_size=1)
steps = [next(router) for _ in range(8)]
metrics = router.summary_metrics()
router.close()
# the packers' counts include what the prefetch thread has computed ahead of step 8, so the
# number varies by a few from run to run
truncated = {k: v.get("truncated") for k, v in metrics.items() if v.get("node_type") == "chat_pack"}
print("conversations cut by the packers (prefetch included):", truncated)
print("declared:", [round(d.weight, 2) for d in recipe.datasets])
print("realized (all tokens):", realized_shares(steps, len(names)).round(3))
print("realized (loss tokens):", realized_shares(steps, len(names), "loss").round(3))

# %% [markdown]
# ## The same bytes everywhere

# %%
want = []
with recipe.global_loader(world_size=1) as g:
    want = [batch_sha256(next(g)) for _ in range(4)]
for world, workers in [(2, WorkerConfig(2, "thread")), (4, WorkerConfig(0))]:
    with recipe.global_loader(world_size=world, workers=workers) as g:
        assert [batch_sha256(next(g)) for _ in range(4)] == want
with recipe.global_loader(world_size=4) as g:
    first = [batch_sha256(next(g)) for _ in range(2)]
    state = g.state_dict()
with recipe.global_loader(world_size=2) as g:
    g.load_state_dict(state)
    assert first + [batch_sha256(next(g)) for _ in range(2)] == want
print("same hashes on W = 1, 2, 4, with thread workers, and after a resume from W = 4 on W = 2")

# %% [markdown]
# ## Conversations with images
#
# A chat dataset that names `image_field` (or is read from `.tar` shards) holds conversations
# whose turns show images, as `{"type": "image"}` content parts or LLaVA's `<image>` markers
# (`docs/vl-chat.md`). Each image's placeholder is expanded to its grid and its pixels are
# preprocessed as image-text samples' are; labels are `-100` on every vision token too.
# `write_vl_chat_recipe` writes a small recipe: conversations in WebDataset, Parquet and LLaVA
# JSON Lines datasets, mixed with image-caption pairs, text chat and web text. Below, its first
# rows: each image drawn in place of its placeholder run, the tokens not trained on hatched.

# %%
from zephon.recipe import LoaderMetrics  # noqa: E402
from zephon.tools.display import show  # noqa: E402
from zephon.tools.vlchat_demo import write_vl_chat_recipe  # noqa: E402

vl = Recipe.from_toml(write_vl_chat_recipe(os.path.join(root, "vl"), conversations=16))
with vl.global_loader(world_size=1) as g:
    vl_batches = [next(g) for _ in range(4)]
print({k: getattr(v, "shape", len(v)) for k, v in vl_batches[0].items() if k != "provenance"})
show(vl_batches[0], vl, max_rows=4, max_chars=400)

# %% [markdown]
# The share of each dataset's tokens trained on over those 4 steps (the loader metric
# `trained_share/<dataset>`; `zephon inspect` prints it too): nearly all of plain text, the
# captions of image-text pairs (not their image tokens), the assistants' text of conversations.

# %%
metrics = LoaderMetrics(vl)
for b in vl_batches:
    metrics.record(b)
out = metrics.collect()
for d in vl.datasets:
    print(f"{d.name:>13} ({d.kind}): trained share {out[f'zephon/trained_share/{d.name}']:.2f}")
