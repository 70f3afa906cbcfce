"""Pack on synthetic documents: exact segments, restore at every step, all algorithms."""

import numpy as np
import pytest

from zephon import ZNode
from zephon.engine.testing import check_node
from zephon.nodes import Pack


class Doc:
    def __init__(self, tokens, dataset):
        self.tokens, self.dataset, self.skipped = tokens, dataset, None


class DocSource(ZNode):
    """Documents of seeded lengths 2..2*row: token values encode (doc, position)."""

    node_type = "doc_source"

    def __init__(self, n, row_len, seed=0):
        super().__init__()
        rng = np.random.default_rng(seed)
        lengths = rng.integers(2, 2 * row_len, n)  # real documents have BOS+EOS: >= 2 tokens
        # no 1-token tail chunks: a 1-token segment at a row's last position is only a label,
        # which document_ids cannot attribute (segments() below would merge it)
        self.lengths = np.where(lengths % row_len == 1, lengths + 1, lengths)
        self.docs = [np.arange(k, dtype=np.int32) + 1000 * (i + 1) for i, k in enumerate(self.lengths)]
        self.i = 0

    def reset(self, initial_state=None):
        super().reset(initial_state)
        self.i = 0 if initial_state is None else initial_state["i"]

    def next(self):
        if self.i >= len(self.docs):
            raise StopIteration
        self.i += 1
        return Doc(self.docs[self.i - 1], self.i % 3)

    def get_state(self):
        return self._tagged({"i": self.i})


def segments(rows):
    out = []
    for r in rows:
        doc = r["document_ids"]
        full = np.r_[r["input"], r["labels"][-1:]]  # the row's seq_len + 1 tokens
        ids = np.r_[doc, doc[-1:] if r["labels"][-1] != -100 else [-1]]
        for j in np.unique(ids[ids >= 0]):
            out.append(full[ids == j])
    return out


@pytest.mark.parametrize("algorithm", ["greedy", "first_fit", "best_fit"])
def test_restore_every_step(algorithm):
    check_node(lambda: Pack(DocSource(40, 17), seq_len=16, algorithm=algorithm, flush_every=7, max_open=3))


@pytest.mark.parametrize("algorithm", ["first_fit", "best_fit"])
def test_never_split_documents_that_fit(algorithm):
    row = 17
    src = DocSource(300, row, seed=4)
    rows = list(Pack(src, seq_len=row - 1, algorithm=algorithm, flush_every=50, max_open=4))
    segs = segments(rows)
    got = sorted(tuple(s.tolist()) for s in segs)
    expected = []
    for d in src.docs:
        expected += [tuple(d[i : i + row].tolist()) for i in range(0, len(d), row)]
    assert got == sorted(expected)


def test_greedy_keeps_order_and_fills_rows():
    row = 17
    src = DocSource(200, row, seed=5)
    pack = Pack(src, seq_len=row - 1, algorithm="greedy", flush_every=1000)
    rows = list(pack)
    stream = np.concatenate([np.r_[r["input"], r["labels"][-1:]][np.r_[r["document_ids"], [0]] >= 0] for r in rows])
    stream = stream[stream != -100]
    assert (stream == np.concatenate(src.docs)).all()
    assert pack.efficiency > 0.99
    for r in rows:
        v = r["document_ids"] >= 0
        n = int(v.sum())
        assert (r["labels"][: n - 1] == r["input"][1:n]).all()


def test_best_fit_is_at_least_as_efficient_as_first_fit():
    def eff(alg):
        p = Pack(DocSource(400, 33, seed=9), seq_len=32, algorithm=alg, flush_every=100, max_open=6)
        list(p)
        return p.efficiency

    assert eff("best_fit") >= eff("first_fit") - 0.02
    assert eff("greedy") > eff("first_fit")


def test_bad_arguments():
    with pytest.raises(ValueError, match="algorithm"):
        Pack(DocSource(1, 4), seq_len=8, algorithm="tetris")
    with pytest.raises(ValueError, match="seq_len"):
        Pack(DocSource(1, 4), seq_len=1)
    assert "first_fit" in repr(Pack(DocSource(1, 4), seq_len=8, algorithm="first_fit"))
