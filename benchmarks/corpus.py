"""Deterministic benchmark corpora (text half).

JSONL shards of synthetic web-style prose from :func:`zephon.synth.generate_documents`
(log-normal lengths, median ~150 words, ~2% long documents of 2,000-8,000 words). Shard ``k`` of
a size is ``generate_documents("web", docs_per_shard, seed=1000 + k)``, so a size's bytes are the
same on every machine and run. Files are written once under ``benchmarks/.data/text_<size>/``
and reused (``.data/text_<size>.json`` holds the shard count and byte total).
"""

from __future__ import annotations

import json
import os
from typing import Dict

SIZES: Dict[str, Dict[str, int]] = {
    # shards x docs per shard; ~1.7 KB per document on average
    "smoke": {"shards": 2, "docs": 150},  # ~0.5 MB
    "small": {"shards": 8, "docs": 2500},  # ~34 MB
    "full": {"shards": 64, "docs": 2500},  # ~270 MB
}

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, ".data")


def text_corpus(size: str) -> Dict[str, object]:
    """Generate (once) and describe the JSONL corpus of ``size``: dir, glob, files, bytes, docs."""
    from zephon.synth import generate_documents, write_jsonl

    spec = SIZES[size]
    root = os.path.join(DATA, f"text_{size}")
    marker = os.path.join(DATA, f"text_{size}.json")  # outside the folder: loaders glob it
    files = [os.path.join(root, f"web-{k:05d}.jsonl") for k in range(spec["shards"])]
    if not os.path.exists(marker):
        os.makedirs(root, exist_ok=True)
        for k, path in enumerate(files):
            if not os.path.exists(path):
                write_jsonl(path, generate_documents("web", spec["docs"], seed=1000 + k))
        with open(marker, "w") as f:
            json.dump({"shards": spec["shards"], "docs": spec["docs"],
                       "bytes": sum(os.path.getsize(p) for p in files)}, f)
    with open(marker) as f:
        info = json.load(f)
    return {"dir": root, "glob": os.path.join(root, "*.jsonl"), "files": files,
            "bytes": info["bytes"], "docs": info["shards"] * info["docs"]}
