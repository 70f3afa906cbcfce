"""A vision-language corpus and recipe for tests: the bundled BPE plus Qwen-VL's four vision special
tokens, image-text tar and Parquet shards, an interleaved shard and a small text corpus."""

import os
import shutil

from zephon.data import BUNDLED_TOKENIZER as TOKENIZER_DIR
from zephon.tools.synth import make_demo_corpus, make_vision_corpus

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def make_vl_tokenizer(folder: str) -> str:
    """The bundled 4096-token BPE plus Qwen-VL's four vision special tokens (ids 4096..4099)."""
    from tokenizers import AddedToken, Tokenizer

    os.makedirs(folder, exist_ok=True)
    tok = Tokenizer.from_file(os.path.join(TOKENIZER_DIR, "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    tok.save(os.path.join(folder, "tokenizer.json"))
    shutil.copy(os.path.join(TOKENIZER_DIR, "tokenizer_config.json"), folder)
    return folder


def vl_config(root: str, **over) -> dict:
    cfg = {
        "seed": 5,
        "lanes": 4,
        "seq_len": 128,
        "global_batch_size": 8,
        "cache_dir": "cache",
        "tokenizer": {"path": "tok"},
        "datasets": [
            {"name": "wds", "kind": "image_text", "path": "wds/*.tar", "weight": 0.35},
            {"name": "pairs", "kind": "image_text", "path": "pairs/*.parquet", "weight": 0.2},
            {"name": "obelics", "kind": "interleaved", "path": "interleaved/*.parquet", "weight": 0.25},
            {"name": "web", "path": "text/web/*.jsonl", "weight": 0.2},
        ],
        "vision": {
            "patch_size": 16,
            "merge_size": 2,
            "min_pixels": 1024,
            "max_pixels": 4096,
            "max_images_per_batch": 6,
        },
        "pack": {"flush_every": 16},
        "shuffle": {"buffer": 4},
    }
    cfg.update(over)
    return cfg


def write_vl_root(r, seed: int, text_scale: float = 0.01, **sizes) -> str:
    """A folder with the VL test tokenizer, an image-text corpus and a small text corpus."""
    make_vl_tokenizer(str(r / "tok"))
    make_vision_corpus(str(r), seed=seed, **sizes)
    make_demo_corpus(str(r / "text"), seed=3, scale=text_scale)
    return str(r)
