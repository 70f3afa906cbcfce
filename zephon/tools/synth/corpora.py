"""Ready-made corpora: the three-dataset text demo mixture and the image-text corpus."""

from __future__ import annotations

import json
import os

from .images import generate_image_text, generate_interleaved
from .text import _GEN_VERSION, generate_documents
from .writers import (
    write_image_parquet,
    write_interleaved_parquet,
    write_jsonl,
    write_parquet,
    write_text_lines,
    write_wds,
)

_MARKER = ".zephon_demo.json"


def _demo_plan(seed: int, scale: float) -> dict:
    def n(base: int) -> int:
        return max(1, int(round(base * scale)))

    return {
        "web": {"style": "web", "docs": n(2400), "shards": 4, "format": "jsonl", "seed": seed * 3 + 0},
        "code": {
            "style": "code",
            "docs": n(2400),
            "shards": 3,
            "format": "parquet",
            "seed": seed * 3 + 1,
            "row_group_size": max(1, n(2400) // 3 // 4),
        },
        "books": {"style": "books", "docs": n(320), "shards": 2, "format": "text_lines", "seed": seed * 3 + 2},
    }


def make_demo_corpus(root: str | os.PathLike, seed: int = 0, scale: float = 1.0) -> dict[str, str]:
    """Write the demo mixture under ``root`` and return ``{dataset: glob pattern}``:

    - ``web/``: JSONL shards (``web-0000.jsonl`` ...), field ``text``;
    - ``code/``: Parquet shards with several row groups each, column ``text``;
    - ``books/``: text files, one document per line.

    About 7 MB at ``scale=1.0``. Idempotent: a marker file records the parameters, and a call
    with the same ``(seed, scale)`` whose files all exist writes nothing.
    """
    root = os.fspath(root)
    if int(seed) < 0 or not scale > 0:
        raise ValueError(f"seed must be >= 0 and scale > 0, got seed={seed}, scale={scale}")
    seed = int(seed)
    scale = float(scale)
    plan = _demo_plan(seed, scale)
    patterns = {
        "web": os.path.join(root, "web", "*.jsonl"),
        "code": os.path.join(root, "code", "*.parquet"),
        "books": os.path.join(root, "books", "*.txt"),
    }
    params = {"version": _GEN_VERSION, "seed": seed, "scale": scale, "plan": plan}
    marker = os.path.join(root, _MARKER)
    if os.path.exists(marker):
        try:
            with open(marker, encoding="utf-8") as f:
                old = json.load(f)
        except (OSError, ValueError):
            old = {}
        if old.get("params") == params and all(os.path.exists(os.path.join(root, p)) for p in old.get("files", [])):
            return patterns
        # different parameters (or damaged): remove what the old marker says we wrote
        for p in old.get("files", []):
            fp = os.path.join(root, p)
            if os.path.isfile(fp):
                os.remove(fp)
        os.remove(marker)

    files: list[str] = []
    for name, spec in plan.items():
        d = os.path.join(root, name)
        os.makedirs(d, exist_ok=True)
        docs = generate_documents(spec["style"], spec["docs"], spec["seed"])
        k = spec["shards"]
        bounds = [len(docs) * j // k for j in range(k + 1)]
        for j in range(k):
            part = docs[bounds[j] : bounds[j + 1]]
            if spec["format"] == "jsonl":
                rel = f"{name}/{name}-{j:04d}.jsonl"
                write_jsonl(os.path.join(root, rel), part)
            elif spec["format"] == "parquet":
                rel = f"{name}/{name}-{j:04d}.parquet"
                write_parquet(os.path.join(root, rel), part, row_group_size=spec["row_group_size"])
            else:
                rel = f"{name}/{name}-{j:04d}.txt"
                write_text_lines(os.path.join(root, rel), part)
            files.append(rel)
    tmp = marker + f".tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"params": params, "files": files}, f, indent=1, sort_keys=True)
    os.replace(tmp, marker)
    return patterns


def make_vision_corpus(
    root: str | os.PathLike, seed: int = 0, n_wds: int = 96, n_parquet: int = 64, n_interleaved: int = 32
) -> dict[str, str]:
    """Image-text data under ``root``: ``wds/`` (2 tar shards, .txt and .json captions),
    ``pairs/`` (2 Parquet shards, image bytes + caption), ``interleaved/`` (1 Parquet shard).
    Returns ``{name: glob}``."""
    root = os.fspath(root)
    samples = generate_image_text(n_wds + n_parquet, seed)
    half = n_wds // 2
    write_wds(os.path.join(root, "wds", "wds-0000.tar"), samples[:half], caption="txt")
    write_wds(os.path.join(root, "wds", "wds-0001.tar"), samples[half:n_wds], caption="json")
    rest = samples[n_wds:]
    write_image_parquet(os.path.join(root, "pairs", "pairs-0000.parquet"), rest[: len(rest) // 2], row_group_size=16)
    write_image_parquet(
        os.path.join(root, "pairs", "pairs-0001.parquet"), rest[len(rest) // 2 :], row_group_size=16, hf_struct=True
    )
    write_interleaved_parquet(
        os.path.join(root, "interleaved", "obelics-0000.parquet"),
        generate_interleaved(n_interleaved, seed + 1),
        row_group_size=8,
    )
    return {
        "wds": os.path.join(root, "wds", "*.tar"),
        "pairs": os.path.join(root, "pairs", "*.parquet"),
        "interleaved": os.path.join(root, "interleaved", "*.parquet"),
    }
