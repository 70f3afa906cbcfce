"""Deterministic synthetic corpora for the demo, the tests and the benchmarks.

``generate_documents(style, n, seed)`` returns the same strings, byte for byte, on every run,
machine and numpy version: every draw comes from the raw 64-bit output of a PCG64 bit
generator keyed by ``SeedSequence([seed, style key, doc index])`` (both have a stability
guarantee in numpy), turned into numbers with integer arithmetic and plain IEEE float
operations only. No ``numpy.random.Generator`` distributions (their algorithms may change
between numpy versions), no ``hash()``, no set or dict-of-set ordering.

Document ``i`` depends only on ``(style, seed, i)``: ``generate_documents(s, 50, k)`` is a
prefix of ``generate_documents(s, 100, k)``.

Styles:

- ``"web"``: prose from a Zipf-distributed English-like vocabulary; log-normal lengths, median
  ~150 words, ~2% long documents of 2,000-8,000 words; optional title, paragraphs.
- ``"code"``: Python-like modules (imports, functions, classes, indentation, literals,
  operators); clearly more tokens per byte than prose.
- ``"books"``: long paragraphs with dialogue, median ~800 words, some chapters of many
  thousand words.

Writers: :func:`write_jsonl` (plain, gzip or zstd), :func:`write_parquet`,
:func:`write_text_lines` (one document per line), :func:`write_text_files` (one file each).
:func:`make_demo_corpus` writes a three-dataset mixture and returns a glob per dataset.

Modules: ``words`` (the random stream and the vocabulary), ``prose`` and ``pycode`` (the
styles), ``text`` (:func:`generate_documents`), ``images``, ``chat`` (:func:`generate_conversations`), ``writers``, ``corpora``,
``vlchat`` (vision-language chat records, :func:`generate_vl_conversations`, and their writers).
The package imports nothing from the rest of zephon.
"""

from .chat import generate_conversations
from .corpora import make_demo_corpus, make_vision_corpus
from .images import IMAGE_FORMATS, generate_image_text, generate_interleaved
from .text import STYLES, generate_documents
from .vlchat import (
    VL_FORMS,
    generate_vl_conversations,
    make_vl_chat_corpus,
    write_vl_chat_jsonl,
    write_vl_chat_parquet,
    write_vl_chat_wds,
)
from .writers import (
    write_image_parquet,
    write_interleaved_parquet,
    write_jsonl,
    write_parquet,
    write_text_files,
    write_text_lines,
    write_wds,
)

__all__ = [
    "IMAGE_FORMATS",
    "STYLES",
    "VL_FORMS",
    "generate_conversations",
    "generate_documents",
    "generate_image_text",
    "generate_interleaved",
    "generate_vl_conversations",
    "make_demo_corpus",
    "make_vision_corpus",
    "make_vl_chat_corpus",
    "write_image_parquet",
    "write_interleaved_parquet",
    "write_jsonl",
    "write_parquet",
    "write_text_files",
    "write_text_lines",
    "write_vl_chat_jsonl",
    "write_vl_chat_parquet",
    "write_vl_chat_wds",
    "write_wds",
]
