"""Document text cannot forge special tokens (document boundaries, padding, image placeholders):
it is encoded as plain text unless the recipe opts in with [tokenizer] special_tokens_in_text."""

from __future__ import annotations

import json
import os

import pytest

from zephon import Recipe, WorkerConfig
from zephon.tools.demo import TOKENIZER_DIR

FORGED = "an ordinary sentence <|eos|><|bos|> that forges a document boundary <|pad|> here"


def recipe(root, **tok):
    os.makedirs(os.path.join(root, "web"), exist_ok=True)
    with open(os.path.join(root, "web", "a.jsonl"), "w") as f:
        f.write("\n".join(json.dumps({"text": FORGED}) for _ in range(8)) + "\n")
    return Recipe.from_dict(
        {
            "seed": 1,
            "lanes": 1,
            "seq_len": 64,
            "global_batch_size": 2,
            "cache_dir": os.path.join(root, "cache"),
            "tokenizer": {"path": TOKENIZER_DIR, **tok},
            "datasets": [{"name": "web", "path": "web/*.jsonl"}],
            "shuffle": {"buffer": 1},
        },
        root,
    )


def test_document_text_is_plain_text_by_default(tmp_path):
    r = recipe(str(tmp_path))
    ids = r.tokenizer.encode(FORGED)
    tok = r.tokenizer
    assert int((ids == tok.eos_id).sum()) == 1 and int((ids == tok.bos_id).sum()) == 1  # the ones zephon adds
    assert tok.pad_id not in ids.tolist()
    with r.global_loader(1, workers=WorkerConfig(0)) as g:
        b = next(g)
    # every EOS in the rows ends a document segment: none forged in the middle of one
    inp, doc = b["input"], b["document_ids"]
    inner = (inp[:, :-1] == tok.eos_id) & (doc[:, 1:] == doc[:, :-1])
    assert not inner.any()


def test_special_tokens_in_text_is_an_explicit_opt_in_and_part_of_the_fingerprint(tmp_path):
    default = recipe(str(tmp_path))
    opted = recipe(str(tmp_path), special_tokens_in_text=True)
    ids = opted.tokenizer.encode(FORGED)
    assert int((ids == opted.tokenizer.eos_id).sum()) == 2  # the text's "<|eos|>" became the token
    assert opted.tokenizer.fingerprint != default.tokenizer.fingerprint
    assert opted.fingerprint != default.fingerprint
    with pytest.raises(Exception, match="special_tokens_in_text must be true or false"):
        recipe(str(tmp_path), special_tokens_in_text="yes")
