"""Train the bundled byte-level BPE tokenizer (vocab 4096) on zephon's synthetic corpora.

    python scripts/make_tokenizer.py              # writes zephon/data/assets/tokenizer/
    python scripts/make_tokenizer.py --out DIR

Writes ``tokenizer.json`` and ``tokenizer_config.json`` (``bos_token``, ``eos_token``,
``pad_token``) so the folder loads with ``zephon.data.TextTokenizer``,
``transformers.AutoTokenizer.from_pretrained(folder)`` and TorchTitan's
``HuggingFaceTokenizer``. Special tokens get ids 0, 1, 2: ``<|bos|>``, ``<|eos|>``,
``<|pad|>``. The tokenizer itself adds no special tokens (no post-processor); the loader adds
BOS/EOS per its own policy.

The training text is deterministic (``zephon.tools.synth``); BPE training in ``tokenizers`` is
deterministic for a given input and version, so rerunning reproduces the same files with the
same ``tokenizers`` version.
"""

from __future__ import annotations

import argparse
import json
import os

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]
VOCAB_SIZE = 4096
DEFAULT_OUT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "zephon", "data", "assets", "tokenizer"
)


def _training_texts():
    from zephon.tools.synth import generate_documents

    # a seed that the tests and the demo corpus (seeds 0..) are unlikely to use
    for style, n in (("web", 4000), ("code", 4000), ("books", 600)):
        yield from generate_documents(style, n, seed=1234567)


def train(out_dir: str = DEFAULT_OUT, vocab_size: int = VOCAB_SIZE) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = list(_training_texts())
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))

    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"), pretty=False)
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "added_tokens_decoder": added,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1000000000000000019884624838656,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    return out_dir


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT, help="output folder (default: the bundled one)")
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = ap.parse_args(argv)
    out = train(args.out, args.vocab_size)
    size = os.path.getsize(os.path.join(out, "tokenizer.json"))
    print(f"wrote {out}/tokenizer.json ({size / 1e3:.0f} kB) and tokenizer_config.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
