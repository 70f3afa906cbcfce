"""A vision-language SFT recipe on generated data: conversations with images (WebDataset shards,
Parquet, JSON Lines with image files, the LLaVA form) mixed with image-text pairs, text chat and
plain text, for the tests, the notebook and a first run.

>>> import tempfile
>>> from zephon.recipe import Recipe
>>> r = Recipe.from_toml(write_vl_chat_recipe(tempfile.mkdtemp(), conversations=16))
>>> [d.name for d in r.datasets], r.multimodal
(['chat_wds', 'chat_parquet', 'llava', 'pairs', 'talk', 'web'], True)
"""

from __future__ import annotations

import json
import os

from zephon.data.chatimages import VL_CHAT_TOKENIZER
from zephon.tools.synth import (
    generate_conversations,
    generate_documents,
    make_vision_corpus,
    make_vl_chat_corpus,
    write_jsonl,
)

__all__ = ["VL_CHAT_TOML", "write_vl_chat_recipe"]

VL_CHAT_TOML = """\
# zephon vision-language SFT demo: conversations with images in three record forms, mixed by tokens
# with image-text pairs, text chat and plain text; only the assistants' text is trained on
seed = 11
lanes = {lanes}
seq_len = {seq_len}
global_batch_size = {gbs}
cache_dir = "cache"

[tokenizer]
path = "{tokenizer}"     # ChatML and Qwen-VL's vision tokens; its template renders image parts

[[datasets]]
name = "chat_wds"        # WebDataset: key.json (the conversation) and key.0.jpg, key.1.png, ...
path = "chat_wds/*.tar"
kind = "chat"
weight = {w0}

[[datasets]]
name = "chat_parquet"    # a messages column and an images column (binary or {{bytes, path}})
path = "chat_parquet/*.parquet"
kind = "chat"
image_field = "images"
chat_template = "chatml_vl_generation"
weight = {w1}

[[datasets]]
name = "llava"           # LLaVA: "<image>" in the human's text, the image's path beside it
path = "chat_llava/*.jsonl"
kind = "chat"
chat_format = "sharegpt"
image_field = "image"
long = "truncate_turns"
weight = {w2}

[[datasets]]
name = "pairs"           # image-caption pretraining data
path = "pairs/*.parquet"
kind = "image_text"
weight = {w3}

[[datasets]]
name = "talk"            # text chat
path = "talk/*.jsonl"
kind = "chat"
weight = {w4}

[[datasets]]
name = "web"             # plain text
path = "web/*.jsonl"
weight = {w5}

[vision]
patch_size = 16
merge_size = 2
min_pixels = 1024
max_pixels = 4096
max_images_per_batch = 16

[pack]
algorithm = "best_fit"  # a sample goes to the fullest row of the micro-batch it fits
flush_every = 16

[shuffle]
buffer = 4

[mixing]
count = "{count}"        # "loss": shares of the tokens trained on (images never are)

[workers]
count = 0
"""


def write_vl_chat_recipe(
    root: str,
    *,
    lanes: int = 4,
    seq_len: int = 256,
    global_batch_size: int = 8,
    weights: tuple[float, ...] = (0.25, 0.2, 0.15, 0.1, 0.15, 0.15),
    count: str = "all",
    conversations: int = 64,
) -> str:
    """Write the data and ``vlchat.toml`` under ``root``; returns the recipe's path."""
    n = max(int(conversations), 4)
    make_vl_chat_corpus(root, seed=2, n_wds=n, n_parquet=n, n_jsonl=n)
    make_vision_corpus(root, seed=3, n_wds=4, n_parquet=max(n // 2, 4), n_interleaved=2)
    os.makedirs(os.path.join(root, "talk"), exist_ok=True)
    with open(os.path.join(root, "talk", "chat.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"messages": c}) + "\n" for c in generate_conversations(2 * n, seed=4, tools=False))
    write_jsonl(os.path.join(root, "web", "part-0.jsonl"), generate_documents("web", 2 * n, seed=5))
    w = dict(zip(("w0", "w1", "w2", "w3", "w4", "w5"), weights))
    text = VL_CHAT_TOML.format(
        lanes=lanes,
        seq_len=seq_len,
        gbs=global_batch_size,
        tokenizer=VL_CHAT_TOKENIZER.replace("\\", "/"),
        count=count,
        **w,
    )
    path = os.path.join(root, "vlchat.toml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path
