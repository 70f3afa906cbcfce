"""The text contenders: the same work (read JSONL, tokenize, pack greedily into rows of
``seq_len + 1`` tokens, shuffle, batch 8 rows of ``seq_len``) built with each loader.

Every builder returns a :class:`Built` with an iterator of batches, a function that returns the
loader's checkpoint size in bytes, and a ``close``. Batches are normalised by :func:`rows_of`
to the ``input`` array so the harness can check the shape and count tokens.

All contenders use the same tokenizer file (zephon's bundled 4096-vocab byte-level BPE), add
BOS and EOS per document, and (except TorchTitan, whose loader calls ``encode`` per document)
tokenize in batches of ``CHUNK`` documents with ``Tokenizer.encode_batch_fast`` while
``TOKENIZERS_PARALLELISM=false``.
"""

from __future__ import annotations

import json
import mmap
import os
import pickle
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: how reports and logs name each contender
LABELS = {
    "zephon": "zephon (thread workers)",
    "zephon_proc": "zephon (process workers)",
    "zephon_proc_noshm": "zephon (process workers, shm off)",
    "grain_threads": "Grain (threads)",
    "grain_mp": "Grain (mp_prefetch)",
    "torchdata": "torchdata.nodes ParallelMapper",
    "titan": "TorchTitan HuggingFaceTextDataLoader",
    "titan_nw2": "TorchTitan, num_workers=2",
    "limit": "limit: encode_batch_fast alone",
}

os.environ["TOKENIZERS_PARALLELISM"] = "false"

CHUNK = 32  # documents per tokenizer call (zephon's default [workers].chunk_size)
SHUFFLE_ROWS = 64  # rows per shuffle window
SEED = 1


@dataclass
class Settings:
    files: list[str]
    glob: str
    corpus_dir: str
    cache_dir: str
    tokenizer_dir: str
    seq_len: int = 2048
    batch_rows: int = 8
    lanes: int = 8
    shuffle_rows: int = SHUFFLE_ROWS

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Settings:
        return cls(**d)


@dataclass
class Built:
    it: Iterator[Any]
    state_bytes: Callable[[], dict[str, Any]]
    close: Callable[[], None] = lambda: None
    notes: list[str] = field(default_factory=list)
    loader: Any = None  # zephon: the GlobalLoader (state_dict / load_state_dict, pool metrics)


def rows_of(batch: Any) -> np.ndarray:
    """The ``input`` token array [rows, seq_len] of any contender's batch."""
    if isinstance(batch, (tuple, list)):  # TorchTitan: (input_dict, labels)
        batch = batch[0]
    x = batch["input"]
    if hasattr(x, "numpy"):
        x = x.numpy()
    return x


# --------------------------------------------------------------------------- shared pieces
def load_tokenizer(path: str):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    return tok, tok.token_to_id("<|bos|>"), tok.token_to_id("<|eos|>")


class Encoder:
    """``texts -> [int32 array with BOS ... EOS]`` with one ``encode_batch_fast`` call (picklable)."""

    def __init__(self, tokenizer_dir: str) -> None:
        self.tokenizer_dir = tokenizer_dir
        self._tok = None

    def __getstate__(self):
        return {"tokenizer_dir": self.tokenizer_dir, "_tok": None}

    def __call__(self, texts: list[str]) -> list[np.ndarray]:
        if self._tok is None:
            self._tok, self.bos, self.eos = load_tokenizer(self.tokenizer_dir)
        out = []
        for e in self._tok.encode_batch_fast(texts, add_special_tokens=False):
            ids = e.ids
            a = np.empty(len(ids) + 2, dtype=np.int32)
            a[1:-1] = ids
            a[0], a[-1] = self.bos, self.eos
            out.append(a)
        return out


class JsonlSource:
    """Random access to the lines of JSONL files (a line-offset index over mmaps); picklable.

    Grain 0.2.18 ships no JSONL source (ArrayRecord, Parquet, TFRecord only), and any object
    with ``__len__``/``__getitem__`` is a Grain ``RandomAccessDataSource``: this is that object.
    """

    def __init__(self, files: Sequence[str]) -> None:
        self.files = list(files)
        starts, ends = [], []
        for f in self.files:
            with open(f, "rb") as fh:
                data = np.frombuffer(fh.read(), dtype=np.uint8)
            nl = np.flatnonzero(data == 10)
            s = np.concatenate([[0], nl[:-1] + 1]) if len(nl) else np.zeros(0, np.int64)
            starts.append(s)
            ends.append(nl)
        self.counts = np.array([len(s) for s in starts])
        self.cum = np.concatenate([[0], np.cumsum(self.counts)])
        self.starts = np.concatenate(starts).astype(np.int64)
        self.ends = np.concatenate(ends).astype(np.int64)
        self._maps: list[mmap.mmap] | None = None

    def __getstate__(self):
        d = dict(self.__dict__)
        d["_maps"] = None
        return d

    def _m(self) -> list[mmap.mmap]:
        if self._maps is None:
            maps = []
            for f in self.files:
                with open(f, "rb") as fh:
                    maps.append(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ))
            self._maps = maps
        return self._maps

    def __len__(self) -> int:
        return int(self.cum[-1])

    def __getitem__(self, i: int) -> bytes:
        i = int(i)
        f = int(np.searchsorted(self.cum, i, side="right") - 1)
        return self._m()[f][self.starts[i] : self.ends[i]]


def parse(lines: Sequence[bytes]) -> list[str]:
    return [json.loads(b)["text"] for b in lines]


def make_row(segments: list[np.ndarray], seq_len: int) -> dict[str, np.ndarray]:
    """One packed row from segments summing to seq_len + 1 tokens (zephon's row fields)."""
    L = seq_len + 1
    tokens = np.empty(L, dtype=np.int64)
    positions = np.empty(L, dtype=np.int64)
    doc_ids = np.empty(L, dtype=np.int32)
    pos = 0
    for j, seg in enumerate(segments):
        k = len(seg)
        tokens[pos : pos + k] = seg
        positions[pos : pos + k] = np.arange(k)
        doc_ids[pos : pos + k] = j
        pos += k
    return {
        "input": tokens[:-1],
        "labels": tokens[1:].copy(),
        "positions": positions[:-1],
        "document_ids": doc_ids[:-1],
    }


def stack(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


# --------------------------------------------------------------------------- zephon
def build_zephon(
    s: Settings,
    threads: int,
    *,
    lanes: int | None = None,
    global_batch: int | None = None,
    shuffle_rows: int | None = None,
    backend: str = "thread",
    shm_mb: int | None = None,
) -> Built:
    from zephon import WorkerConfig

    r = zephon_recipe(s, lanes=lanes, global_batch=global_batch, shuffle_rows=shuffle_rows)
    r.prepare()
    g = r.global_loader(world_size=1, workers=WorkerConfig(threads, backend, shm_mb=shm_mb))

    def state_bytes():
        st = g.state_dict()
        per_lane = [len(json.dumps(v).encode()) for k, v in st.items() if k.startswith("lane_")]
        return {
            "bytes_per_rank": len(json.dumps(st).encode()),
            "max_bytes_per_lane": max(per_lane),
            "lanes": len(per_lane),
            "format": "JSON",
        }

    return Built(iter(g), state_bytes, g.close, loader=g)


def zephon_recipe(
    s: Settings, *, lanes: int | None = None, global_batch: int | None = None, shuffle_rows: int | None = None
):
    from zephon import Recipe

    lanes = lanes or s.lanes
    return Recipe.from_dict(
        {
            "seed": SEED,
            "lanes": lanes,
            "seq_len": s.seq_len,
            "global_batch_size": global_batch or s.batch_rows,
            "cache_dir": s.cache_dir,
            "tokenizer": {"path": s.tokenizer_dir},
            "datasets": [{"name": "web", "path": s.glob}],
            "shuffle": {"buffer": shuffle_rows or s.shuffle_rows},
            "pack": {"algorithm": "greedy"},
        },
        s.corpus_dir,
    )


# --------------------------------------------------------------------------- Grain
class _GrainTokenize:
    """Grain map: a chunk of JSON lines -> token arrays (runs on Grain's threads or workers)."""

    def __init__(self, tokenizer_dir: str) -> None:
        self.enc = Encoder(tokenizer_dir)

    def __call__(self, lines):
        return self.enc(parse(lines))


def _grain_unbatch():
    import grain

    class Unbatch(grain.experimental.FlatMapTransform):
        max_fan_out = CHUNK

        def flat_map(self, element):
            return [{"tokens": t} for t in element]

    return Unbatch()


def _grain_row(r):
    t = r["tokens"]
    return {
        "input": t[:-1].astype(np.int64),
        "labels": t[1:].astype(np.int64),
        "positions": r["tokens_positions"][:-1].astype(np.int64),
        "document_ids": r["tokens_segment_ids"][:-1],
    }


def _grain_pipeline(s: Settings, read_threads: int, src: JsonlSource):
    import grain
    import grain.experimental as ge

    tokenize, to_batch_row = _GrainTokenize(s.tokenizer_dir), _grain_row
    ds = grain.MapDataset.source(src).shuffle(seed=SEED).repeat().batch(CHUNK, batch_fn=list).map(tokenize)
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=read_threads))
    it = ge.FlatMapIterDataset(it, _grain_unbatch())
    it = ge.ConcatThenSplitIterDataset(it, length_struct={"tokens": s.seq_len + 1})
    it = ge.WindowShuffleIterDataset(it, window_size=s.shuffle_rows, seed=SEED)
    return it.map(to_batch_row).batch(s.batch_rows, drop_remainder=True)


def build_grain_threads(s: Settings, threads: int) -> Built:
    ds = _grain_pipeline(s, threads, JsonlSource(s.files))
    it = iter(ds)
    return Built(it, lambda: {"bytes_per_rank": len(json.dumps(it.get_state()).encode()), "format": "JSON"})


def build_grain_mp(s: Settings, threads: int) -> Built:
    import grain

    ds = _grain_pipeline(s, 1, JsonlSource(s.files))
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=threads))
    it = iter(ds)

    def close():
        c = getattr(it, "close", None)
        if c:
            c()

    return Built(
        it, lambda: {"bytes_per_rank": len(json.dumps(it.get_state(), default=str).encode()), "format": "JSON"}, close
    )


# --------------------------------------------------------------------------- torchdata.nodes
class GreedyPack:
    """A simple greedy packer as a torchdata node: concatenate documents, cut rows of seq_len+1."""

    @staticmethod
    def make(source, seq_len: int):
        from torchdata.nodes import BaseNode

        class _GreedyPack(BaseNode):
            def __init__(self, source):
                super().__init__()
                self.source, self.seq_len = source, seq_len

            def reset(self, initial_state=None):
                super().reset(initial_state)
                if initial_state is None:
                    self.source.reset(None)
                    self.pending: list[np.ndarray] = []
                else:
                    self.source.reset(initial_state["source"])
                    self.pending = [np.asarray(p, dtype=np.int32) for p in initial_state["pending"]]
                self.used = sum(len(p) for p in self.pending)

            def next(self):
                L = self.seq_len + 1
                while self.used < L:
                    t = next(self.source)
                    self.pending.append(t)
                    self.used += len(t)
                row, take, rest = [], 0, []
                for i, p in enumerate(self.pending):
                    k = min(len(p), L - take)
                    row.append(p[:k])
                    take += k
                    if take == L:
                        rest = ([p[k:]] if k < len(p) else []) + self.pending[i + 1 :]
                        break
                self.pending = rest
                self.used -= L
                return make_row(row, self.seq_len)

            def get_state(self):
                return {"source": self.source.state_dict(), "pending": [p.tolist() for p in self.pending]}

        return _GreedyPack(source)


class RowShuffle:
    """A seeded window shuffle as a torchdata node (its state holds the buffered rows)."""

    @staticmethod
    def make(source, window: int, seed: int):
        from torchdata.nodes import BaseNode

        class _RowShuffle(BaseNode):
            def __init__(self, source):
                super().__init__()
                self.source, self.window, self.seed = source, window, seed

            def reset(self, initial_state=None):
                super().reset(initial_state)
                self.source.reset(None if initial_state is None else initial_state["source"])
                self.w = 0 if initial_state is None else initial_state["w"]
                self.out: list[Any] = [] if initial_state is None else initial_state["out"]

            def next(self):
                if not self.out:
                    buf = []
                    try:
                        while len(buf) < self.window:
                            buf.append(next(self.source))
                    except StopIteration:
                        if not buf:
                            raise
                    order = np.random.default_rng([self.seed, self.w]).permutation(len(buf))
                    self.out = [buf[i] for i in order][::-1]
                    self.w += 1
                return self.out.pop()

            def get_state(self):
                return {"source": self.source.state_dict(), "w": self.w, "out": self.out}

        return _RowShuffle(source)


def build_torchdata(s: Settings, threads: int) -> Built:
    import torchdata.nodes as tn

    src = JsonlSource(s.files)
    enc = Encoder(s.tokenizer_dir)
    n = len(src)

    def doc_indices():
        epoch = 0
        while True:
            yield from np.random.default_rng([SEED, epoch]).permutation(n).tolist()
            epoch += 1

    def read_and_tokenize(idx: list[int]) -> list[np.ndarray]:
        return enc(parse([src[i] for i in idx]))

    node = tn.IterableWrapper(doc_indices())
    node = tn.Batcher(node, batch_size=CHUNK)
    node = tn.ParallelMapper(node, read_and_tokenize, num_workers=threads, in_order=True, method="thread")
    node = tn.Unbatcher(node)
    node = GreedyPack.make(node, s.seq_len)
    node = RowShuffle.make(node, s.shuffle_rows, SEED)
    node = tn.Batcher(node, batch_size=s.batch_rows, drop_last=True)
    node = tn.Mapper(node, stack)
    loader = tn.Loader(node)
    it = iter(loader)

    def state_bytes():
        return {"bytes_per_rank": len(pickle.dumps(loader.state_dict())), "format": "pickle"}

    return Built(
        it,
        state_bytes,
        lambda: None,
        notes=[
            "ParallelMapper(thread, in_order) over chunks of 32 documents; greedy packer and window "
            "shuffle written here (benchmarks/text_contenders.py); the document order is a seeded "
            "permutation per epoch built from a generator"
        ],
    )


# --------------------------------------------------------------------------- TorchTitan
def build_titan(s: Settings, num_workers: int) -> Built:
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    tok = HuggingFaceTokenizer(tokenizer_path=s.tokenizer_dir)
    cfg = HuggingFaceTextDataLoader.Config(
        dataset="c4_test", dataset_path=s.corpus_dir, infinite=True, num_workers=num_workers
    )
    dl = HuggingFaceTextDataLoader(
        cfg, dp_world_size=1, dp_rank=0, tokenizer=tok, seq_len=s.seq_len, local_batch_size=s.batch_rows
    )
    it = iter(dl)

    def state_bytes():
        return {"bytes_per_rank": len(pickle.dumps(dl.state_dict())), "format": "pickle"}

    def close():
        c = getattr(it, "_shutdown_workers", None)
        if c:
            c()

    return Built(it, state_bytes, close)


# --------------------------------------------------------------------------- the limit
def limit_tokens_per_s(
    s: Settings, threads: int, target_tokens: int, cpu: Callable[[], float] | None = None
) -> dict[str, float]:
    """``encode_batch_fast`` alone over the corpus's documents (already parsed, in memory), in
    chunks of ``CHUNK``, on ``threads`` threads, until ``target_tokens`` tokens (BOS/EOS counted)."""

    texts: list[str] = []
    for f in s.files:
        with open(f, "rb") as fh:
            texts.extend(parse(fh.read().splitlines()))
    enc = Encoder(s.tokenizer_dir)
    enc(texts[:2])  # load
    chunks = [texts[i : i + CHUNK] for i in range(0, len(texts), CHUNK)]

    def work(c):
        return sum(len(a) for a in enc(c))

    from benchmarks.common import run_chunks

    total, dt, cpu_s = run_chunks(work, chunks, threads, target_tokens, cpu)
    return {
        "tokens": total,
        "seconds": dt,
        "tokens_per_s": total / dt,
        "cpu_s_per_mtok": cpu_s / (total / 1e6) if cpu_s is not None else None,
    }
