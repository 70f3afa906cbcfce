"""Fetch and tokenize: the stateless, parallel half of the text pipeline.

:class:`FetchTokenize` is an elementwise batch function for :class:`zephon.engine.OrderedMapper`: it
turns a chunk of :class:`zephon.worksource.WorkItem` into :class:`TokDoc` s, reading the
records from their shards (grouped per shard) and tokenizing them with one batched call. It is
picklable (datasets and tokenizer travel as small handles) and caches itself per process, so
process workers load the tokenizer once.

Long documents are planned as parts (:class:`zephon.worksource.DatasetPlan`). How a part is made
is the ``split`` mode (``[mixing] split_mode``):

* ``"text"`` (data version 2): part ``i`` of ``k`` is a range of the document's *text*, cut at a
  whitespace boundary near ``i/k`` of it (:func:`part_span`), and tokenized on its own (BOS on
  the first part only, EOS on the last only). Any worker of any lane or rank makes its part with
  tokenizer work and memory proportional to the part: a document is tokenized once per pass,
  whatever the lane count, worker mode or world size. Only the (cheap) read of the record is
  shared, through a small per-process text cache.
* ``"tokens"`` (data version 1): every part tokenizes the whole document and cuts its token
  slice. A per-process cache of whole-document tokens avoids repeating that while the parts are
  near, but no cache is shared by processes, and a lane that has delivered a few parts of a
  long document has paid for all of it (measured: 6.4x the tokens delivered at 16 lanes).

Measured on the 2-core machine (``benchmarks/work.py``): "text" needs 1.00 token tokenized per
token delivered at 1 to 256 lanes; see ``benchmarks/results/work.md``.
"""

from __future__ import annotations

import collections
import functools
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from zephon.data.datasets import BadRecord, DataError, DatasetIndex, out_of_vocab
from zephon.data.datasets.tokencache import TokenCache, TokenEntry, width_of
from zephon.data.tokenizer import TextTokenizer
from zephon.engine import ProcessLocal

from .policy import policies, skip_hint
from .tokencached import cache_setting, through_cache
from .worksource import WorkItem, read_items

__all__ = ["SPLIT_MODES", "FetchTokenize", "TokDoc", "check_token_widths", "part_span"]

Key = tuple[int, int, int]  # a record: (dataset, shard, record)

#: how a long document's parts are made (see the module doc): from its "text" or its "tokens"
SPLIT_MODES = ("tokens", "text")

#: how far before a part's nominal start :func:`part_span` looks for a line or word boundary
PART_SEARCH_CHARS = 2048


def _cut(text: str, i: int, k: int) -> int:
    """Where part ``i`` of ``k`` of ``text`` starts (see :func:`part_span`)."""
    n = len(text)
    if i <= 0:
        return 0
    if i >= k:
        return n
    t = i * n // k
    lo = max(0, t - min(PART_SEARCH_CHARS, n // k // 2))
    j = text.rfind("\n", lo, t + 1)
    if j < 0:
        j = max(text.rfind(" ", lo, t + 1), text.rfind("\t", lo, t + 1))
    if j < 0:
        return t  # no whitespace near: a text without spaces is cut at the character
    while j > lo and text[j - 1].isspace():  # the start of the whitespace run
        j -= 1
    return j


def part_span(text: str, part: int, parts: int) -> tuple[int, int]:
    r"""The characters ``[start, end)`` of ``text`` that part ``part`` of ``parts`` holds under
    the "text" split mode: cuts near ``i/parts`` of the text, moved back (at most
    :data:`PART_SEARCH_CHARS`, and at most half a part) to the start of the whitespace before a
    line break, else before a word, else at the character. A cut is a function of the text and
    ``(i, parts)`` alone, so a part's end is the next part's start, on any worker: the parts
    tile the text. Cutting before whitespace keeps the tokens of byte-level BPE pre-tokenizers
    (whitespace runs attach to the next word) the same as the whole text's, except at most one
    merge at each cut.

    >>> text = "one two\nthree four five\nsix"
    >>> [text[slice(*part_span(text, i, 3))] for i in range(3)]
    ['one two', '\nthree four', ' five\nsix']
    """
    return _cut(text, part, parts), _cut(text, part + 1, parts)


def check_token_widths(datasets: Sequence[Any], tokenizer: TextTokenizer) -> None:
    """Refuse a pretokenized dataset whose stored id width cannot hold the tokenizer's ids (uint16
    data holds ids below 65,536: it was not written by a tokenizer with more): the one record of
    the tokenizer that the numpy and Megatron formats keep."""
    for d in datasets:
        for s, dt in enumerate(getattr(d, "dtypes", ())):
            top = 1 << (8 * dt.itemsize - (dt.kind == "i"))
            if tokenizer.vocab_size > top:
                raise DataError(
                    f"its token ids are stored as {dt} (below {top:,}), but the recipe tokenizer has "
                    f"{tokenizer.vocab_size:,} ids: the data was tokenized with another (smaller) tokenizer",
                    dataset=d.name,
                    file=d.shards[s].path,
                    fix="Use the tokenizer the data was written with in [tokenizer] path, or re-tokenize the data.",
                )


class TokDoc(NamedTuple):
    """A tokenized document (BOS/EOS included) or a skipped record (``tokens`` empty)."""

    tokens: np.ndarray
    dataset: int
    item: WorkItem
    skipped: str | None = None  # reason, when the record was bad and the policy is "skip"
    offset: int = 0  # index of tokens[0] in the whole document's tokens (parts of long documents)
    text_part: bool = False  # a part cut from the text: ``offset`` counts in the part's own tokens

    @property
    def provenance(self) -> str:
        """Where this record comes from, in words (dataset, shard, record, epoch, part)."""
        return self.item.provenance


class _DocCache:
    """Recent multi-part documents (their tokens, or the :class:`BadRecord` they read as; their
    texts in the "text" split mode), shared by the worker threads of a process.

    The parts of a long document come close together in a lane's stream, often in one chunk or
    in chunks mapped at the same time on different threads. Without coordination each part
    would read, parse and tokenize the whole document again (measured: 14% of all tokenizer
    work on the benchmark corpus; a 20 MB record planned as 5,000 parts was read 5,000 times).
    :meth:`claim` makes one caller read and tokenize a document while the others wait for the
    result; the cache keeps the last ``size`` documents, and at most ``max_bytes`` of tokens
    (always the newest one).
    """

    def __init__(self, size: int, max_bytes: int = 512 << 20, sizeof: Any = None) -> None:
        self.size, self.max_bytes, self._lock = size, max_bytes, threading.Lock()
        self._sizeof = sizeof or (lambda v: getattr(v, "nbytes", 0))
        self._d: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        self._bytes = 0
        self._pending: dict[Any, threading.Event] = {}  # key -> Event while a caller reads it

    def claim(self, key: Any) -> Any:
        """The cached value (tokens or a BadRecord), an Event to wait on (another caller is
        reading the document), or None: the caller now owns the key and must :meth:`put` or
        :meth:`release` it."""
        with self._lock:
            v = self._d.get(key)
            if v is not None:
                self._d.move_to_end(key)
                return v
            ev = self._pending.get(key)
            if ev is not None:
                return ev
            self._pending[key] = threading.Event()
            return None

    def get(self, key: Any) -> Any:
        with self._lock:
            return self._d.get(key)

    def put(self, key: Any, value: Any) -> None:
        with self._lock:
            old = self._d.pop(key, None)
            if old is not None:
                self._bytes -= self._sizeof(old)
            self._d[key] = value
            self._bytes += self._sizeof(value)
            while len(self._d) > 1 and (len(self._d) > self.size or self._bytes > self.max_bytes):
                _, gone = self._d.popitem(last=False)
                self._bytes -= self._sizeof(gone)
            ev = self._pending.pop(key, None)
        if ev is not None:
            ev.set()

    def release(self, key: Any) -> None:
        """Give up a claim without a value (the owner failed); waiters then read it themselves."""
        with self._lock:
            ev = self._pending.pop(key, None)
        if ev is not None:
            ev.set()


class FetchTokenize(ProcessLocal):
    """``items -> [TokDoc]``: read records (grouped per shard), tokenize them in one batch.

    ``on_error[d]`` is "raise" (a bad record stops the run with a message naming dataset, file
    and record) or "skip" (the record becomes a counted, deterministic skip). ``split`` is how a
    long document's parts are made (module doc); ``align`` applies to "tokens" parts only: a
    "text" part is tokenized alone, so a packer that never splits a document cuts each part into
    rows of its own (a part's last piece is shorter than a row). ``rewritten``: the datasets a
    ``transform`` rule rewrites (their tokens are not kept in the token cache: user code may change).
    """

    def __init__(
        self,
        datasets: Sequence[DatasetIndex],
        tokenizer: TextTokenizer,
        on_error: Sequence[str] | None = None,
        align: int = 1,
        split: str = "tokens",
        rewritten: Sequence[int] = (),
    ) -> None:
        self.datasets = list(datasets)
        self.rewritten = frozenset(rewritten)  # datasets a transform rewrites (not in the token cache)
        self.align = int(align)
        self.tokenizer = tokenizer
        self.on_error = policies(on_error, len(self.datasets))
        if split not in SPLIT_MODES:
            raise ValueError(f"split must be one of {SPLIT_MODES}, got {split!r}")
        self.split = split
        check_token_widths(self.datasets, tokenizer)
        self.token_cache = cache_setting()  # the node's token cache ($ZEPHON_TOKEN_CACHE), carried to workers
        ProcessLocal.__init__(self)

    _transient: tuple[str, ...] = ("_parts_cache", "_text_cache")

    #: texts of multi-part records kept per process ("text" mode): a part re-reads its record
    #: only when the record left this cache (a read is ~1/400 of tokenizing the record here)
    TEXT_CACHE_DOCS = 64
    TEXT_CACHE_BYTES = 256 << 20

    def fetch(self, items: Sequence[WorkItem]) -> list[Any]:
        """Texts (or BadRecord) of ``items``, in order; one read per (dataset, shard) group (a
        record above its dataset's size limit is a BadRecord, and is not read)."""
        return read_items(self.datasets, items)

    def read(self, items: Sequence[WorkItem], given: Mapping[Key, Any] | None = None) -> list[Any]:
        """Each item's record as :meth:`fetch` reads it, or as ``given`` holds it (by
        ``(dataset, shard, record)``: what the record pipeline read, a transform's new text)."""
        return read_items(self.datasets, items, given)

    def __call__(self, items: list[WorkItem], given: Mapping[Key, Any] | None = None) -> list[TokDoc]:
        """``items -> [TokDoc]``, through the node's token cache if set; ``given``: see :meth:`read`."""
        return through_cache(self, items, functools.partial(self.tokenize, given=given))

    # -- the token cache's view of this encoder (tokencached.py) ---------------------------------
    def cache_settings(self, d: int, whole: bool) -> str | None:
        """What dataset ``d``'s entries depend on besides the record (None: not cached): the
        tokenizer and, for the parts of a long document, how parts are cut."""
        if d in self.rewritten:  # a transform's text is not the shard's (user code may change)
            return None
        if whole:
            return TokenCache.settings_key(self.tokenizer.fingerprint)
        align = self.align if self.split == "tokens" else 1
        return TokenCache.settings_key(self.tokenizer.fingerprint, f"{self.split}|{align}|{PART_SEARCH_CHARS}")

    def cache_width(self) -> int:
        """Bytes per id in the token cache."""
        return width_of(self.tokenizer.vocab_size)

    @staticmethod
    def from_entry(e: TokenEntry, it: WorkItem) -> TokDoc:
        """The document a cache entry holds."""
        return TokDoc(e.tokens, it.dataset, it, None, e.offset, e.text_part)

    @staticmethod
    def to_entry(doc: TokDoc) -> TokenEntry | None:
        """A tokenized document as a cache entry (None: a skip, not cached)."""
        return None if doc.skipped is not None else TokenEntry(doc.tokens, doc.offset, doc.text_part)

    def tokenize(self, items: list[WorkItem], given: Mapping[Key, Any] | None = None) -> list[TokDoc]:
        """``items -> [TokDoc]`` without the token cache."""
        if self.split == "text":
            return self._text_parts(items, given)
        docs = self._documents(items, given)
        out: list[TokDoc] = []
        empty = np.zeros(0, dtype=np.int32)
        for it, doc in zip(items, docs):
            if isinstance(doc, BadRecord):
                if self.on_error[it.dataset] == "raise":
                    raise doc.to_error(skip_hint(self.datasets[it.dataset].name))
                out.append(TokDoc(empty, it.dataset, it, f"{doc.reason} ({doc.locator})"))
                continue
            toks, offset = doc, 0
            if it.parts > 1:  # one planned slice of a long document
                offset = self.cut(len(toks), it.part, it.parts)
                toks = toks[offset : self.cut(len(toks), it.part + 1, it.parts)]
            out.append(TokDoc(toks, it.dataset, it, None, offset))
        return out

    def _read_encode(self, items: Sequence[WorkItem], given: Mapping[Key, Any] | None = None) -> list[Any]:
        """Each item's whole document: its tokens (one batched tokenizer call), or its BadRecord."""
        texts = self.read(items, given)
        good = [i for i, t in enumerate(texts) if isinstance(t, str)]
        out: list[Any] = [self._stored(it, t) if isinstance(t, np.ndarray) else t for it, t in zip(items, texts)]
        if good:
            for i, toks in zip(good, self.tokenizer.encode_batch([texts[i] for i in good])):
                out[i] = toks
        return out

    def _text_parts(self, items: Sequence[WorkItem], given: Mapping[Key, Any] | None = None) -> list[TokDoc]:
        """The "text" split mode: each item's text (its record's, or its part's range of it),
        tokenized in one batched call; BOS only on a first part, EOS only on a last part."""
        texts = self._texts(items, given)
        out: list[Any] = [None] * len(items)
        whole: list[int] = []  # items that are whole documents
        cut: list[int] = []  # items that are parts of a long one
        pieces: list[str] = []
        for j, (it, text) in enumerate(zip(items, texts)):
            if isinstance(text, BadRecord):
                out[j] = self._bad(it, text)
            elif isinstance(text, np.ndarray):  # a pretokenized document: its ids (a part: its slice)
                out[j] = self._stored_doc(it, text)
            elif it.parts <= 1:
                whole.append(j)
            else:
                cut.append(j)
                pieces.append(text[slice(*part_span(text, it.part, it.parts))])
        for j, doc in enumerate(out):  # a pretokenized document that is bad (ids outside the vocabulary)
            if isinstance(doc, BadRecord):
                out[j] = self._bad(items[j], doc)
        tok = self.tokenizer
        if whole:
            for j, toks in zip(whole, tok.encode_batch([texts[j] for j in whole])):
                out[j] = TokDoc(toks, items[j].dataset, items[j])
        if cut:
            for j, ids in zip(cut, tok.encode_content(pieces)):
                it = items[j]
                bos = tok.add_bos and it.part == 0
                eos = tok.add_eos and it.part == it.parts - 1
                if bos or eos:
                    a = np.empty(len(ids) + bos + eos, dtype=np.int32)
                    a[bos : bos + len(ids)] = ids
                    if bos:
                        a[0] = tok.bos_id or 0
                    if eos:
                        a[-1] = tok.eos_id or 0
                    ids = a
                out[j] = TokDoc(ids, it.dataset, it, text_part=True)
        return out

    def _texts(self, items: Sequence[WorkItem], given: Mapping[Key, Any] | None = None) -> list[Any]:
        """Each item's record text (or BadRecord): one read per record within the call, and a
        multi-part record once per process while it stays in the text cache."""
        cache = self.__dict__.get("_text_cache")
        if cache is None:
            cache = self.__dict__.setdefault(
                "_text_cache", _DocCache(self.TEXT_CACHE_DOCS, self.TEXT_CACHE_BYTES, sys.getsizeof)
            )

        def read(sub: Sequence[WorkItem]) -> list[Any]:
            keys = list(dict.fromkeys((it.dataset, it.shard, it.record) for it in sub))
            texts = dict(zip(keys, self.read([WorkItem(d, s, r, 0, 0) for d, s, r in keys], given)))
            return [texts[it.dataset, it.shard, it.record] for it in sub]

        return self._shared(items, read, cache)

    def _documents(self, items: Sequence[WorkItem], given: Mapping[Key, Any] | None = None) -> list[Any]:
        """Tokens (or BadRecord) of each item's whole document. A multi-part document is read and
        tokenized once per process while its parts are near (within a chunk, across concurrent
        chunks, and from the cache), a bad one is read once too."""
        cache = self.__dict__.get("_parts_cache")
        if cache is None:
            cache = self.__dict__.setdefault("_parts_cache", _DocCache(64))
        return self._shared(items, functools.partial(self._read_encode, given=given), cache)

    @staticmethod
    def _shared(items: Sequence[WorkItem], load: Any, cache: _DocCache) -> list[Any]:
        """``load(items)`` for each item, a multi-part record's value loaded once per process
        while it stays in ``cache`` (claimed, so concurrent callers wait instead of loading it)."""
        out: list[Any] = [None] * len(items)
        here: list[int] = []  # items whose record is read here
        owned: dict[Any, int] = {}  # key -> the item that reads it (claimed by us)
        same: list[tuple[int, Any]] = []  # (item, key) of a document read in this call
        waits: list[tuple[int, Any, threading.Event]] = []  # read by another caller
        for j, it in enumerate(items):
            if it.parts <= 1:
                here.append(j)
                continue
            key = (it.dataset, it.shard, it.record)
            if key in owned:
                same.append((j, key))
                continue
            got = cache.claim(key)
            if got is None:
                owned[key] = j
                here.append(j)
            elif isinstance(got, threading.Event):
                waits.append((j, key, got))
            else:
                out[j] = got
        try:
            if here:
                for j, doc in zip(here, load([items[j] for j in here])):
                    out[j] = doc
            for key, j in owned.items():
                cache.put(key, out[j])
        finally:
            for key in owned:
                cache.release(key)  # no-op after put; frees waiters if reading failed
        for j, key in same:
            out[j] = out[owned[key]]
        for j, key, ev in waits:
            ev.wait()
            doc = cache.get(key)
            if doc is None:  # evicted already, or the owner failed: read it here
                doc = load([items[j]])[0]
            out[j] = doc
        return out

    def _bad(self, it: WorkItem, rec: BadRecord) -> TokDoc:
        """A bad record under the dataset's policy: raised, or a counted skip."""
        if self.on_error[it.dataset] == "raise":
            raise rec.to_error(skip_hint(self.datasets[it.dataset].name))
        return TokDoc(np.zeros(0, dtype=np.int32), it.dataset, it, f"{rec.reason} ({rec.locator})")

    def _stored(self, it: WorkItem, ids: np.ndarray) -> Any:
        """A pretokenized document's ids as int32 (copied out of the memory map), or a
        :class:`BadRecord` when an id lies outside the tokenizer's vocabulary."""
        why = out_of_vocab(ids, self.tokenizer.vocab_size)
        if why is not None:
            where = self.datasets[it.dataset].locate(it.shard, it.record)
            return BadRecord(self.datasets[it.dataset].name, where["file"], where["locator"], why)
        return np.asarray(ids, dtype=np.int32)

    def _stored_doc(self, it: WorkItem, ids: np.ndarray) -> Any:
        """The TokDoc of a pretokenized document, or of its planned part (a slice of its ids, cut
        as the "tokens" split mode cuts); a BadRecord when its ids are not the tokenizer's."""
        offset = 0
        if it.parts > 1:
            offset = self.cut(len(ids), it.part, it.parts)
            ids = ids[offset : self.cut(len(ids), it.part + 1, it.parts)]
        got = self._stored(it, ids)
        return got if isinstance(got, BadRecord) else TokDoc(got, it.dataset, it, None, offset)

    def cut(self, n: int, i: int, k: int) -> int:
        """Where part i of k of an n-token document starts ("tokens" split mode). Cuts fall on multiples of ``align``
        (the row length for packers that never split), so a document that fits a row is never
        cut, whatever the byte-based estimate said; parts may then be empty."""
        a = self.align
        return min(n, -(-(i * n // k) // a) * a) if a > 1 else i * n // k

    def __repr__(self) -> str:
        return (
            f"FetchTokenize(datasets={[d.name for d in self.datasets]}, tokenizer={self.tokenizer!r}, "
            f"split={self.split!r})"
        )
