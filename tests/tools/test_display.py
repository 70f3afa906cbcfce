"""Batch display (text and HTML, parsed) and provenance back to the source bytes."""

from __future__ import annotations

import json
from html.parser import HTMLParser

import numpy as np
import pytest
from text_fixtures import write_corpus, write_recipe

from zephon import Recipe
from zephon.nodes import part_span
from zephon.tools.display import provenance, show


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("display")
    write_corpus(str(root))
    return str(root)


class Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.stack, self.found = [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.stack.append((a.get("class", ""), []))
        self.found.append((a.get("class", ""), a))

    def handle_endtag(self, tag):
        cls, text = self.stack.pop()
        if self.stack:
            self.stack[-1][1].extend(text)
        self.found.append(("/" + cls, "".join(text)))

    def handle_data(self, data):
        if self.stack:
            self.stack[-1][1].append(data)


def texts(parsed, cls):
    return [t for c, t in parsed.found if c == "/" + cls]


@pytest.mark.parametrize("algorithm", ["greedy", "best_fit"])
def test_html_shows_text_boundaries_padding_and_datasets(corpus, algorithm):
    r = Recipe.from_toml(write_recipe(corpus, f"d_{algorithm}.toml", algorithm=algorithm))
    if algorithm == "best_fit":
        r = r.replace(seq_len=512)  # rows longer than most documents: best-fit pads
    with r.global_loader(1) as g:
        b = next(g)
        for _ in range(20):  # best-fit: find a batch that has padded rows
            if algorithm == "greedy" or (b["document_ids"] < 0).any():
                break
            b = next(g)
    view = show(b, r, max_rows=16, max_chars=10_000)
    p = Collect()
    p.feed(view._repr_html_())
    rows = [a for c, a in p.found if c == "zp-row"]
    assert len(rows) == 16
    segs = texts(p, "zp-seg")
    boundaries = texts(p, "zp-boundary")
    n_segments = sum(len(view.segments(i)) for i in range(16))
    assert len(segs) == len(boundaries) == n_segments
    # the decoded text of every segment is there, tagged with its dataset
    decoded = [s["text"] for i in range(16) for s in view.segments(i)]
    assert segs == decoded
    seg_ds = [a["data-dataset"] for c, a in p.found if c == "zp-seg"]
    assert set(seg_ds) <= {"web", "code", "books"} and len(set(seg_ds)) >= 2
    pads = texts(p, "zp-pad")
    n_padded = int(((b["document_ids"] < 0).sum(axis=1) > 0).sum())
    assert len(pads) == n_padded
    if algorithm == "best_fit":
        assert n_padded > 0
    effs = texts(p, "zp-eff")
    assert effs[0] == f"{view.efficiency(0):.1%}"
    assert "row 0" in repr(view) and "‖" in repr(view)


def test_provenance_reproduces_tokens_from_cited_bytes(corpus):
    r = Recipe.from_toml(write_recipe(corpus, "prov.toml"))
    tok = r.prepare().tokenizer
    with r.global_loader(2) as g:
        for _ in range(3):
            b = next(g)
    checked = 0
    for row in range(len(b["input"])):
        # the row's seq_len + 1 tokens: inputs, then the last label (when it is not padding, or
        # with labels = "document" the target of a document's last token: then it is unknown)
        valid = b["document_ids"][row] >= 0
        full = b["input"][row][valid]
        if b["labels"][row][-1] != -100:
            full = np.r_[full, b["labels"][row][-1:]]
        used = sum(e[5] - e[4] for e in b["provenance"][row])
        offset = 0
        for seg in provenance(r, b, row):
            t0, t1 = seg["tokens"]
            if seg["file_bytes"] is not None:
                # re-read the cited bytes from the file itself, parse and tokenize
                with open(seg["file"], "rb") as f:
                    f.seek(seg["file_bytes"][0])
                    raw = f.read(seg["file_bytes"][1] - seg["file_bytes"][0])
                text = json.loads(raw)["text"] if seg["file"].endswith(".jsonl") else raw.decode().rstrip("\n")
            else:  # Parquet: the cited row
                import pyarrow.parquet as pq

                text = pq.read_table(seg["file"], columns=["text"]).column("text")[seg["record"]].as_py()
            if seg["part"] is not None:  # a part cut from the text: its own tokens, BOS/EOS at the ends only
                part, parts = seg["part"]
                ids = tok.encode_content([text[slice(*part_span(text, part, parts))]])[0]
                ids = np.r_[[tok.bos_id] * (part == 0), ids, [tok.eos_id] * (part == parts - 1)]
                again = ids.astype(np.int32)[t0:t1]
            else:
                again = tok.encode_batch([text])[0][t0:t1]
            assert seg["row_positions"] == (offset, offset + len(again))  # the final label slot too
            piece = full[offset : offset + len(again)]  # one short where the final label is unknown
            assert (again[: len(piece)] == piece).all(), (row, seg["file"], seg["locator"])
            assert seg["text"] in text
            offset += len(again)
            checked += 1
        assert offset == used and len(full) in (used, used - 1)  # the segments account for every token
    assert checked >= len(b["input"])


def test_node_chain_repr(corpus):
    from zephon.engine import LaneContext

    r = Recipe.from_toml(write_recipe(corpus, "repr.toml"))
    lane = r.build_lane(LaneContext(seed=r.seed, lane=0, lanes=r.lanes))
    html = lane._repr_html_()
    for name in ("Batch", "WindowShuffle", "Pack", "SkipCounter", "OrderedMapper", "LaneWorkSource"):
        assert name in html and name in lane.describe()
    lane.close()
