"""Corpora for the shuffle tests: real text (paragraphs of the standard library's own ``.py``
files) cut into JSON Lines shards of chosen sizes, and a recipe over them."""

from __future__ import annotations

import glob
import json
import os
import sysconfig

import numpy as np

from zephon.tools.demo import TOKENIZER_DIR


def paragraphs(n: int, offset: int = 0) -> list[str]:
    """``n`` paragraphs (blank-line separated, 40..4000 characters) of the standard library's
    modules, in file order, starting after the first ``offset``; repeated if there are too few."""
    out: list[str] = []
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            out += [p for p in f.read().split("\n\n") if 40 < len(p) < 4000]
        if len(out) >= n + offset:
            break
    while len(out) < n + offset:
        out += out
    return out[offset : offset + n]


def write_shards(root: str, name: str, sizes: list[int], offset: int = 0, join: int = 1) -> None:
    """Dataset ``name`` under ``root/name/``: one ``.jsonl`` shard per entry of ``sizes``; each
    document is ``join`` paragraphs."""
    folder = os.path.join(root, name)
    os.makedirs(folder, exist_ok=True)
    paras = paragraphs(sum(sizes) * join, offset)
    docs = ["\n\n".join(paras[k : k + join]) for k in range(0, len(paras), join)]
    i = 0
    for s, n in enumerate(sizes):
        with open(os.path.join(folder, f"part-{s:04d}.jsonl"), "w") as f:
            for d in docs[i : i + n]:
                f.write(json.dumps({"text": d, "id": i}) + "\n")
                i += 1


def unequal_sizes(shards: int, seed: int = 1) -> list[int]:
    """Very unequal shard sizes (log-normal: the largest hundreds of times the smallest)."""
    rng = np.random.default_rng(seed)
    return [int(x) + 1 for x in rng.lognormal(4.0, 1.5, shards)]


def write_recipe(
    root: str,
    names: list[str],
    *,
    lanes: int,
    global_batch_size: int,
    seq_len: int = 256,
    buffer: int | None = 256,
    data_version: int | None = None,
    shuffle_extra: str = "",
    dataset_extra: str = "",
    file: str = "recipe.toml",
) -> str:
    datasets = "".join(
        f'[[datasets]]\nname = "{n}"\npath = "{n}/*"\nformat = "jsonl"\nweight = 1\n{dataset_extra}\n' for n in names
    )
    version = "" if data_version is None else f"data_version = {data_version}\n"
    path = os.path.join(root, file)
    with open(path, "w") as f:
        f.write(
            f"{version}seed = 11\nlanes = {lanes}\nseq_len = {seq_len}\nglobal_batch_size = {global_batch_size}\n"
            f'cache_dir = "cache"\n\n[tokenizer]\npath = "{TOKENIZER_DIR}"\n\n{datasets}'
            "[shuffle]\n" + ("" if buffer is None else f"buffer = {buffer}\n") + shuffle_extra
        )
    return path
