"""Long documents planned as parts are tokenized once, whether their parts share a chunk, run in
concurrent chunks on different threads, or come later; the tokens are the same as without the
cache, and a failing owner does not leave waiters hanging."""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading

import numpy as np
import pytest

from zephon.data.datasets import index_dataset
from zephon.data.tokenizer import TextTokenizer
from zephon.nodes.tokenize import FetchTokenize
from zephon.nodes.worksource import WorkItem
from zephon.tools.demo import TOKENIZER_DIR
from zephon.tools.synth import write_jsonl


class CountingTokenizer(TextTokenizer):
    """Counts how often each text is tokenized; optionally slow, optionally failing once."""

    def __init__(self, *a, delay: float = 0.0, fail_first: bool = False, **kw) -> None:
        super().__init__(*a, **kw)
        self.calls: dict = {}
        self.delay = delay
        self.fail_first = fail_first
        self.count_lock = threading.Lock()

    def encode_batch(self, texts):
        with self.count_lock:
            for t in texts:
                self.calls[t] = self.calls.get(t, 0) + 1
            fail, self.fail_first = self.fail_first, False
        if self.delay:
            threading.Event().wait(self.delay)
        if fail:
            raise RuntimeError("tokenizer failed (test)")
        return super().encode_batch(texts)


@pytest.fixture()
def corpus(tmp_path):
    docs = [f"document {i} " + " ".join(f"w{i}_{k}" for k in range(40 + 30 * i)) for i in range(6)]
    write_jsonl(os.path.join(tmp_path, "a.jsonl"), docs)
    ix = index_dataset("a", os.path.join(tmp_path, "a.jsonl"), cache_dir=str(tmp_path / "cache"))
    return docs, ix


def parts_of(record: int, parts: int, start: int = 0):
    return [WorkItem(0, 0, record, 0, record, i, parts) for i in range(start, parts)]


def reference(ix, items):
    """The tokens of each part, computed without any sharing."""
    tok = TextTokenizer(TOKENIZER_DIR)
    f = FetchTokenize([ix], tok)
    out = []
    for it in items:
        whole = tok.encode_batch(ix.read(it.shard, [it.record]))[0]
        out.append(whole[f.cut(len(whole), it.part, it.parts) : f.cut(len(whole), it.part + 1, it.parts)])
    return out


def test_parts_in_one_chunk_tokenize_once(corpus):
    docs, ix = corpus
    tok = CountingTokenizer(TOKENIZER_DIR)
    f = FetchTokenize([ix], tok)
    items = parts_of(3, 4) + [WorkItem(0, 0, 1, 0, 1)] + parts_of(5, 3)
    got = f(items)
    assert all(n == 1 for n in tok.calls.values()), tok.calls
    assert len(tok.calls) == 3
    for g, want in zip(got, reference(ix, items)):
        np.testing.assert_array_equal(g.tokens, want)
    # the parts together are the whole document, once
    whole = np.concatenate([g.tokens for g in got[:4]])
    np.testing.assert_array_equal(whole, TextTokenizer(TOKENIZER_DIR).encode(docs[3]))


def test_parts_in_concurrent_chunks_tokenize_once(corpus):
    docs, ix = corpus
    tok = CountingTokenizer(TOKENIZER_DIR, delay=0.2)  # slow: the chunks overlap in time
    f = FetchTokenize([ix], tok)
    chunks = [parts_of(4, 6)[:2], parts_of(4, 6)[2:4], parts_of(4, 6)[4:]]
    with cf.ThreadPoolExecutor(3) as ex:
        results = list(ex.map(f, chunks))
    assert tok.calls == {docs[4]: 1}
    flat = [d for r in results for d in r]
    for g, want in zip(flat, reference(ix, parts_of(4, 6))):
        np.testing.assert_array_equal(g.tokens, want)
    # a later chunk is served from the cache
    f(parts_of(4, 6, start=5))
    assert tok.calls == {docs[4]: 1}


def test_failing_owner_releases_waiters(corpus):
    docs, ix = corpus
    tok = CountingTokenizer(TOKENIZER_DIR, delay=0.2, fail_first=True)
    f = FetchTokenize([ix], tok)
    with cf.ThreadPoolExecutor(2) as ex:
        first = ex.submit(f, parts_of(2, 4)[:2])
        threading.Event().wait(0.05)  # the first chunk owns the document by now
        second = ex.submit(f, parts_of(2, 4)[2:])
        with pytest.raises(RuntimeError, match="tokenizer failed"):
            first.result(timeout=10)
        got = second.result(timeout=10)  # did not hang; tokenized the document itself
    for g, want in zip(got, reference(ix, parts_of(2, 4)[2:])):
        np.testing.assert_array_equal(g.tokens, want)


class CountingIndex:
    """Wraps an index: counts how often each record is read."""

    def __init__(self, ix) -> None:
        self.ix, self.reads, self.name = ix, {}, ix.name
        self._lock = threading.Lock()

    def read(self, shard, indices):
        with self._lock:
            for i in indices:
                self.reads[i] = self.reads.get(i, 0) + 1
        return self.ix.read(shard, indices)


def test_a_long_document_is_read_once_not_once_per_part(corpus):
    docs, ix = corpus
    counted = CountingIndex(ix)
    f = FetchTokenize([counted], TextTokenizer(TOKENIZER_DIR))
    items = parts_of(5, 8)
    got = f(items[:3]) + f(items[3:6]) + f(items[6:])  # one chunk, then two later ones (from the cache)
    assert counted.reads == {5: 1}
    for g, want in zip(got, reference(ix, items)):
        np.testing.assert_array_equal(g.tokens, want)
    with cf.ThreadPoolExecutor(3) as ex:  # concurrent chunks of another document: still one read
        list(ex.map(f, [parts_of(4, 6)[:2], parts_of(4, 6)[2:4], parts_of(4, 6)[4:]]))
    assert counted.reads == {5: 1, 4: 1}


def test_a_bad_long_document_is_read_once(tmp_path):
    path = os.path.join(tmp_path, "a.jsonl")
    with open(path, "w") as f:
        f.write('{"text": "fine"}\n{"text": "never closed ' + "x" * 1000 + "\n")
    ix = index_dataset("a", path, cache_dir=str(tmp_path / "cache"))
    counted = CountingIndex(ix)
    f = FetchTokenize([counted], TextTokenizer(TOKENIZER_DIR), on_error=["skip"])
    out = f(parts_of(1, 10)[:5]) + f(parts_of(1, 10)[5:])
    assert counted.reads == {1: 1} and all(d.skipped and "invalid JSON" in d.skipped for d in out)
