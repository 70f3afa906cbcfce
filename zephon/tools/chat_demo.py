"""A chat fine-tuning recipe on generated data: conversations (JSONL in the ``messages`` form and
Parquet in the ShareGPT form) mixed with plain text, for the tests, the notebook and TorchTitan."""

from __future__ import annotations

import json
import os

from zephon.data.chat import CHAT_TOKENIZER
from zephon.tools.synth import generate_conversations, generate_documents, write_jsonl

__all__ = ["CHAT_TOML", "write_chat_recipe"]

CHAT_TOML = """\
# zephon chat demo: instruction data (two forms) mixed with plain text, by tokens
seed = 7
lanes = {lanes}
seq_len = {seq_len}
global_batch_size = {gbs}
cache_dir = "cache"

[tokenizer]
path = "{tokenizer}"

[[datasets]]
name = "chat"
path = "chat/*.jsonl"
kind = "chat"
weight = {chat_weight}
loss_on = "{loss_on}"
long = "{long}"

[[datasets]]
name = "sharegpt"
path = "sharegpt/*.parquet"
kind = "chat"
chat_format = "sharegpt"
chat_template = "chatml_generation"
system_prompt = "You are a helpful assistant."
weight = {sharegpt_weight}
long = "truncate_turns"

[[datasets]]
name = "web"
path = "web/*.jsonl"
weight = {web_weight}

[pack]
algorithm = "best_fit"
flush_every = 32

[shuffle]
buffer = 8

[mixing]
count = "{count}"

[workers]
count = 0
"""

_TO_SHAREGPT = {"user": "human", "assistant": "gpt", "system": "system", "tool": "tool"}


def write_chat_recipe(
    root: str,
    *,
    lanes: int = 4,
    seq_len: int = 256,
    global_batch_size: int = 8,
    weights: tuple[float, float, float] = (0.5, 0.2, 0.3),
    loss_on: str = "all",
    long: str = "drop",
    count: str = "all",
    conversations: int = 400,
) -> str:
    """Write the data and ``chat.toml`` under ``root``; returns the recipe's path."""
    for sub in ("chat", "sharegpt", "web"):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    convs = generate_conversations(conversations, seed=1)
    half = conversations // 2
    for k in range(2):  # two shards of the messages form
        part = convs[k * half // 2 : (k + 1) * half // 2]
        with open(os.path.join(root, "chat", f"part-{k}.jsonl"), "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"messages": c, "id": i}) + "\n" for i, c in enumerate(part))
    _write_sharegpt(os.path.join(root, "sharegpt", "part-0.parquet"), convs[half:])
    write_jsonl(os.path.join(root, "web", "part-0.jsonl"), generate_documents("web", 200, seed=3))
    text = CHAT_TOML.format(
        lanes=lanes,
        seq_len=seq_len,
        gbs=global_batch_size,
        tokenizer=CHAT_TOKENIZER.replace("\\", "/"),
        chat_weight=weights[0],
        sharegpt_weight=weights[1],
        web_weight=weights[2],
        loss_on=loss_on,
        long=long,
        count=count,
    )
    path = os.path.join(root, "chat.toml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def _write_sharegpt(path: str, convs: list) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        [{"from": _TO_SHAREGPT[m["role"]], "value": m["content"]} for m in c if not m.get("tool_calls")]
        for c in convs
        if not any(m.get("tool_calls") for m in c)  # ShareGPT has no tool calls: those are left out
    ]
    pq.write_table(pa.table({"conversations": rows}), path, row_group_size=64)
