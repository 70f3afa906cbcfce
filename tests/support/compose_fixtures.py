"""Tiny corpora of every dataset kind, and recipes built from a kind and a list of features, for the
feature-pair matrix of tests/recipe/test_compose.py (issue 31: every pair a user would combine
works on every W, worker mode and resume, or is refused at build naming why).

All text comes from one pool of short documents (20..500 characters) so that one threshold drops
some records of every kind: every 5th text has the word "zebra" (a regex drops it), every 7th record
repeats an earlier one (dedup drops it), records carry a ``score`` (a field rule drops the low ones),
images have sides 24..96 pixels (an image-size rule drops the small ones). The ``bad/`` folder holds
records a dataset with ``on_error = "skip"`` skips: a JSONL line without its text field, a chat
record without messages, an image that does not decode.
"""

from __future__ import annotations

import copy
import json
import os
import random
from typing import Any

import numpy as np

#: the pool: documents, two datasets of each kind (a and b), the bad records beside
POOL = 160
KINDS = ("text", "chat", "pretok", "image_text", "interleaved", "mix", "vlchat")


def pool(n: int = POOL, seed: int = 31) -> list[str]:
    """``n`` deterministic texts of 20..500 characters; every 5th has "zebra", every 7th repeats one."""
    from zephon.tools.synth import generate_documents

    words = " ".join(generate_documents("web", 40, seed=seed)).split()
    rng = random.Random(seed)
    out: list[str] = []
    for i in range(n):
        if i % 7 == 6:
            out.append(out[rng.randrange(len(out))])
            continue
        want = rng.randrange(20, 500)
        start = rng.randrange(len(words) - 200)
        text, k = "", start
        while len(text) < want:
            text += words[k] + " "
            k += 1
        text = f"src{i % 4} " + text.strip()
        if i % 5 == 0:
            text += " zebra"
        out.append(text)
    return out


def score(i: int) -> float:
    return ((i * 37) % 100) / 100


def _jsonl(path: str, rows: list[dict]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def _conversation(texts: list[str], i: int) -> list[dict]:
    """A user turn and a short answer (every conversation fits a row of 256 tokens, so none is
    skipped as too long); a record whose text repeats an earlier one repeats its whole conversation."""
    i = texts.index(texts[i])
    answer = texts[(i * 3 + 1) % len(texts)][:200]
    return [{"role": "user", "content": texts[i]}, {"role": "assistant", "content": answer}]


def _images(n: int, seed: int) -> list[bytes]:
    from zephon.tools.synth import generate_image_text

    return [s["image"] for s in generate_image_text(n, seed)]


def _write_image_text(path: str, texts: list[str], images: list[bytes], first: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(path), exist_ok=True)
    table = pa.table(
        {
            "image": pa.array(images, type=pa.binary()),
            "caption": pa.array(texts, type=pa.string()),
            "score": pa.array([score(first + i) for i in range(len(texts))], type=pa.float64()),
        }
    )
    pq.write_table(table, path, row_group_size=16)


def _vl_conversation(texts: list[str], i: int) -> list[dict]:
    """A conversation with images (issue 32): the user's text then one ``<image>`` marker (two in
    every 4th record), so the raw and rendered rules of text chat match it alike; a shorter answer."""
    conv = _conversation(texts, i)
    conv[0]["content"] += " <image>" * (2 if i % 4 == 3 else 1)
    conv[1]["content"] = conv[1]["content"][:100]  # as long in tokens as text chat's, the image markup counted
    return conv


def _write_vlchat(path: str, texts: list[str], rows: range, images: list[bytes]) -> None:
    """Conversations ``rows`` of the pool with images in Parquet: the conversation as JSON text,
    its images (``images[k]`` for the row's k-th image), a score."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(path), exist_ok=True)
    convs = [_vl_conversation(texts, i) for i in rows]
    imgs = [
        [images[j % len(images)], images[(j + 3) % len(images)]][: 2 if i % 4 == 3 else 1] for j, i in enumerate(rows)
    ]
    table = pa.table(
        {
            "messages": pa.array([json.dumps(c) for c in convs], type=pa.string()),
            "images": pa.array(imgs, type=pa.list_(pa.binary())),
            "score": pa.array([score(i) for i in rows], type=pa.float64()),
        }
    )
    pq.write_table(table, path, row_group_size=16)


def _write_interleaved(path: str, texts: list[str], images: list[bytes], first: int) -> None:
    """Documents of 1..3 text segments and one or two images; duplicated texts make duplicate documents."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(path), exist_ok=True)
    docs_t, docs_i = [], []
    for i, t in enumerate(texts):
        img = images[i % len(images)]
        if i % 3 == 0:
            docs_t.append([None, t]), docs_i.append([img, None])
        elif i % 3 == 1:
            docs_t.append([t, None, t[:40]]), docs_i.append([None, img, None])
        else:
            docs_t.append([None, t, None]), docs_i.append([img, None, images[(i + 5) % len(images)]])
    table = pa.table(
        {
            "texts": pa.array(docs_t, type=pa.list_(pa.string())),
            "images": pa.array(docs_i, type=pa.list_(pa.binary())),
            "score": pa.array([score(first + i) for i in range(len(texts))], type=pa.float64()),
        }
    )
    pq.write_table(table, path, row_group_size=8)


def write_compose_root(root: str) -> str:
    """Write every kind's two datasets (``a``, ``b``), their bad records and the VL tokenizer under ``root``."""
    from vl_fixtures import make_vl_tokenizer

    from zephon.data import BUNDLED_TOKENIZER, TextTokenizer, write_tokens

    make_vl_tokenizer(os.path.join(root, "tok"))
    texts = pool()
    halves = {"a": (0, POOL // 2), "b": (POOL // 2, POOL)}
    tok = TextTokenizer(BUNDLED_TOKENIZER, True, True)
    images = _images(POOL, seed=4)
    for name, (lo, hi) in halves.items():
        part = texts[lo:hi]
        _jsonl(
            f"{root}/text/{name}/0.jsonl",
            [{"text": t, "score": score(lo + i), "id": lo + i} for i, t in enumerate(part)],
        )
        _jsonl(
            f"{root}/chat/{name}/0.jsonl",
            [{"messages": _conversation(texts, lo + i), "score": score(lo + i)} for i in range(len(part))],
        )
        os.makedirs(f"{root}/pretok/{name}", exist_ok=True)
        write_tokens(f"{root}/pretok/{name}/0.npy", [np.asarray(a) for a in tok.encode_batch(part)], dtype="int32")
        _write_image_text(f"{root}/image_text/{name}/0.parquet", part, images[lo:hi], lo)
        _write_interleaved(f"{root}/interleaved/{name}/0.parquet", part, images[lo:hi], lo)
        _write_vlchat(f"{root}/vlchat/{name}/0.parquet", texts, range(lo, hi), images[lo:hi])
    bad_texts = texts[:6]
    _jsonl(f"{root}/bad/text.jsonl", [{"body": t} for t in bad_texts] + [{"text": t} for t in bad_texts])
    _jsonl(
        f"{root}/bad/chat.jsonl",
        [{"turns": _conversation(texts, i)} for i in range(6)]
        + [{"messages": _conversation(texts, i)} for i in range(6)],
    )
    broken = [b"not an image at all"] * 6 + images[:6]
    _write_image_text(f"{root}/bad/image_text.parquet", bad_texts * 2, broken, 0)
    _write_interleaved(f"{root}/bad/interleaved.parquet", bad_texts * 2, broken, 0)
    _write_vlchat(f"{root}/bad/vlchat.parquet", texts, range(12), broken)  # 6 broken images, then 6 good
    return root


# -- recipes -------------------------------------------------------------------------------------
def _datasets(kind: str) -> list[dict[str, Any]]:
    if kind == "mix":
        return [
            {"name": "a", "path": "text/a/*.jsonl", "weight": 0.5},
            {"name": "b", "path": "chat/b/*.jsonl", "kind": "chat", "weight": 0.5, "long": "truncate_turns"},
        ]
    out = []
    for name, weight in (("a", 0.6), ("b", 0.4)):
        d: dict[str, Any] = {"name": name, "weight": weight}
        if kind == "text":
            d |= {"path": f"text/{name}/*.jsonl"}
        elif kind == "chat":
            d |= {"path": f"chat/{name}/*.jsonl", "kind": "chat", "long": "truncate_turns"}
        elif kind == "vlchat":
            d |= {"path": f"vlchat/{name}/*.parquet", "kind": "chat", "image_field": "images", "long": "truncate_turns"}
        elif kind == "pretok":
            d |= {"path": f"pretok/{name}/*.npy", "format": "tokens", "dtype": "int32"}
        else:
            d |= {"path": f"{kind}/{name}/*.parquet", "kind": kind}
        out.append(d)
    return out


#: the bad-records file of a dataset of each kind (pretokenized ids have no bad record to write)
BAD = {"text": "bad/text.jsonl", "chat": "bad/chat.jsonl", "image_text": "bad/image_text.parquet"}
BAD["interleaved"] = "bad/interleaved.parquet"
BAD["vlchat"] = "bad/vlchat.parquet"


def kind_of(kind: str, dataset: dict) -> str:
    if dataset.get("format") == "tokens":
        return "pretok"
    if dataset.get("kind") == "chat" and "image_field" in dataset:
        return "vlchat"
    return {"chat": "chat", "image_text": "image_text", "interleaved": "interleaved"}.get(
        dataset.get("kind", ""), "text"
    )


def base_config(kind: str, root: str) -> dict[str, Any]:
    """A small recipe of two datasets of ``kind`` (``mix``: a text and a chat dataset)."""
    from zephon.data import BUNDLED_TOKENIZER
    from zephon.data.chat import CHAT_TOKENIZER
    from zephon.data.chatimages import VL_CHAT_TOKENIZER

    tokenizer = {"text": BUNDLED_TOKENIZER, "pretok": BUNDLED_TOKENIZER, "chat": CHAT_TOKENIZER}
    tokenizer["vlchat"] = VL_CHAT_TOKENIZER  # ChatML's and Qwen-VL's special tokens
    cfg: dict[str, Any] = {
        "seed": 31,
        "lanes": 4,
        "seq_len": 128,
        "global_batch_size": 8,
        "cache_dir": os.path.join(root, "cache"),
        "tokenizer": {"path": tokenizer.get(kind, CHAT_TOKENIZER if kind == "mix" else os.path.join(root, "tok"))},
        "datasets": _datasets(kind),
        "pack": {"flush_every": 16},
        "shuffle": {"buffer": 4},
        "workers": {"count": 0},
    }
    if kind in ("chat", "mix", "vlchat"):
        cfg["pack"]["algorithm"] = "best_fit"  # a conversation stays in one row
        cfg["seq_len"] = 256  # a user turn and an answer of up to 500 characters each
    if kind in ("image_text", "interleaved", "vlchat"):
        cfg["vision"] = {"patch_size": 16, "merge_size": 2, "min_pixels": 1024, "max_pixels": 4096}
    return cfg


def add_filter(cfg: dict, rule: dict) -> None:
    cfg.setdefault("filters", []).append(dict(rule))


def with_skips(cfg: dict, kind: str) -> None:
    """Every dataset skips bad records; each reads its kind's bad records too."""
    for d in cfg["datasets"]:
        d["on_error"] = "skip"
        bad = BAD.get(kind_of(kind, d))
        if bad is not None:
            d["path"] = [d["path"], bad]


def finite(cfg: dict) -> None:
    for d in cfg["datasets"]:
        d["policy"] = "stop"


def forked(cfg: dict, parent: str, step: int) -> dict:
    """``cfg`` continued from ``parent`` (its TOML, written from ``cfg``) at ``step`` with the weights swapped."""
    out = copy.deepcopy(cfg)
    out["datasets"][0]["weight"], out["datasets"][1]["weight"] = 0.2, 0.8
    out["fork"] = {"parent": parent, "step": step}
    return out


# -- user code for the matrix's function and stateful rules --------------------------------------
def no_zebra(text: str) -> bool:
    """A filter function: drop texts with the word zebra."""
    return "zebra" not in text


class EveryThird:
    """Stateful: drop every third document a lane sees (its state: how many it has seen)."""

    def __init__(self) -> None:
        self.seen = 0

    def __call__(self, text: str) -> bool:
        self.seen += 1
        return self.seen % 3 != 0

    def state(self) -> dict:
        return {"seen": self.seen}

    def load(self, state: dict) -> None:
        self.seen = int(state["seen"])
