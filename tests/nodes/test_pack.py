"""Pack on synthetic documents: exact segments, restore at every step, all algorithms."""

import numpy as np
import pytest

from zephon.engine import ZNode
from zephon.engine.testing import ListSource, check_node
from zephon.nodes import IGNORE_INDEX, LABELS, Pack, TokDoc, WorkItem, row_spans


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


# -- labels inside documents (issue 20, class 6) and row positions of provenance (class 4) ---------


def titled_docs(n, row_len, seed=1):
    """Documents with record identities (so provenance names them), every length from 1 to
    2 * row_len + 1: tails of one token fall on a row's final label slot."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        k = int(rng.integers(1, 2 * row_len + 2))
        docs.append(TokDoc(np.arange(k, dtype=np.int32) + 1000 * (i + 1), 0, WorkItem(0, 0, i, 0, i)))
    return docs


def check_targets(row, docs, mode):
    """Every target of ``row`` against the documents' own tokens, located through the
    provenance: a target inside a segment is the document's next token; the target of a
    segment's last token is the next segment's first token ("row") or -100 ("document");
    padding targets are -100. Returns how many targets crossed a document boundary."""
    seq_len = len(row["input"])
    spans = row_spans(row["provenance"])
    owner = np.full(seq_len + 1, -1)
    token = np.full(seq_len + 1, -1)
    for j, (p, (lo, hi)) in enumerate(zip(row["provenance"], spans)):
        owner[lo:hi] = j
        token[lo:hi] = docs[p.record].tokens[p.tok_start : p.tok_end]  # the document's own tokens
    assert (row["input"][owner[:-1] >= 0] == token[:-1][owner[:-1] >= 0]).all()
    crossed = 0
    for i in range(seq_len):
        if owner[i] < 0 or owner[i + 1] < 0:
            assert row["labels"][i] == IGNORE_INDEX  # padding
        elif owner[i] == owner[i + 1]:
            assert row["labels"][i] == token[i + 1]  # inside one document: its next token
        else:
            crossed += 1
            assert row["labels"][i] == (token[i + 1] if mode == "row" else IGNORE_INDEX)
    return crossed


@pytest.mark.parametrize("algorithm", ["greedy", "first_fit", "best_fit"])
def test_document_labels_never_cross_a_document(algorithm):
    docs = titled_docs(120, 9)
    rows = {m: list(Pack(ListSource(docs), seq_len=8, algorithm=algorithm, flush_every=13, labels=m)) for m in LABELS}
    crossed = {m: sum(check_targets(r, docs, m) for r in rows[m]) for m in LABELS}
    assert crossed["row"] > 30 and crossed["document"] == crossed["row"]  # the same rows, other targets
    for a, b in zip(rows["row"], rows["document"]):
        for k in ("input", "positions", "document_ids", "dataset"):
            np.testing.assert_array_equal(a[k], b[k])
        assert a["provenance"] == b["provenance"]


def test_document_labels_restore_every_step():
    check_node(lambda: Pack(ListSource(titled_docs(40, 9)), seq_len=8, flush_every=7, labels="document"))


def test_row_labels_are_the_whole_row_shifted():
    docs = [TokDoc(np.array(t, dtype=np.int32), 0, WorkItem(0, 0, i, 0, i)) for i, t in enumerate([[1, 2, 3], [7, 8]])]
    row = next(Pack(ListSource(docs), seq_len=5, labels="row"))
    assert row["labels"].tolist() == [2, 3, 7, 8, IGNORE_INDEX]
    row = next(Pack(ListSource(docs), seq_len=5, labels="document"))
    assert row["labels"].tolist() == [2, 3, IGNORE_INDEX, 8, IGNORE_INDEX]
    with pytest.raises(ValueError, match="pack.labels"):
        Pack(ListSource(docs), seq_len=5, labels="sample")


def test_document_in_the_final_label_slot_has_row_positions():
    """A document whose first token is the row's last token (the final label, no input) still
    has its row positions: row_spans reads them from the provenance."""
    docs = [
        TokDoc(np.array(t, dtype=np.int32), 0, WorkItem(0, 0, i, 0, i)) for i, t in enumerate([[1, 2, 3, 4], [7, 8]])
    ]
    row = next(Pack(ListSource(docs), seq_len=4))  # tokens 1 2 3 4 | 7, then 8 opens the next row
    assert [tuple(p) for p in row["provenance"]] == [(0, 0, 0, 0, 0, 4), (0, 0, 1, 0, 0, 1)]
    assert 1 not in row["document_ids"]  # the inputs cannot place it
    assert row_spans(row["provenance"]) == [(0, 4), (4, 5)]
    assert row["labels"][-1] == 7  # position 4 of the row's 5 tokens is the final label


@pytest.mark.parametrize("algorithm", ["greedy", "first_fit", "best_fit"])
def test_row_spans_place_every_segment(algorithm):
    docs = titled_docs(80, 9, seed=3)
    for row in Pack(ListSource(docs), seq_len=8, algorithm=algorithm, flush_every=11):
        full = np.r_[row["input"], row["labels"][-1:]]  # the row's seq_len + 1 tokens ("row" labels)
        for p, (lo, hi) in zip(row["provenance"], row_spans(row["provenance"])):
            np.testing.assert_array_equal(full[lo:hi], docs[p.record].tokens[p.tok_start : p.tok_end])
            assert (row["document_ids"][lo : min(hi, 8)] >= 0).all()
