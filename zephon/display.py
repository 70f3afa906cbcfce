"""Seeing batches: decoded rows with document boundaries, padding and masked labels, provenance
back to the source record, and the plan of a pipeline. Plain-text ``repr`` everywhere, HTML in
Jupyter (``_repr_html_``).

    >>> view = show(batch, recipe)          # doctest: +SKIP
    >>> view.provenance(0)[0]["file"]       # doctest: +SKIP
"""

from __future__ import annotations

import html
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

__all__ = ["BatchView", "Explanation", "explain", "show", "provenance", "PALETTE"]

PALETTE = ["#dbeafe", "#dcfce7", "#fef3c7", "#fce7f3", "#ede9fe", "#cffafe", "#fee2e2", "#e5e7eb"]


def _segments(row: Dict[str, np.ndarray]) -> List[np.ndarray]:
    """Token positions of each segment of a row (in row order), padding excluded."""
    doc = row["document_ids"]
    out = []
    for j in np.unique(doc[doc >= 0]):
        out.append(np.nonzero(doc == j)[0])
    return out


def provenance(recipe: Any, batch: Dict[str, Any], row: int) -> List[Dict[str, Any]]:
    """Where every segment of ``batch`` row ``row`` came from.

    One dict per segment, in row order: ``dataset``, ``file``, ``locator`` (line / row),
    ``record``, ``epoch``, ``tokens`` (the range within the document's tokens, BOS/EOS
    included), ``chars`` and ``bytes`` (the range of the record's text those tokens cover; the
    bytes are UTF-8 offsets into the text field), ``file_bytes`` (the record's byte range in the
    file, for line formats), ``row_positions`` and ``text``. Re-reading the record, tokenizing it
    and taking ``tokens`` gives back the segment exactly.
    """
    p = recipe.prepare()
    tok = p.tokenizer
    prov = batch["provenance"][row]
    lead = 1 if tok.add_bos else 0
    out = []
    segs = _segments({k: batch[k][row] for k in ("document_ids",)})
    for j, (d, shard, record, epoch, t0, t1) in enumerate(prov):
        ix = p.indexes[d]
        text = ix.read(shard, [record])[0]
        if not isinstance(text, str):
            raise ValueError(f"record {record} of {ix.shards[shard].path} is no longer readable: {text}")
        enc = tok._tokenizer().encode(text, add_special_tokens=False)
        offsets = enc.offsets
        n_content = len(offsets)
        c0 = c1 = None
        for t in range(t0, t1):  # token t of the document; content tokens are t - lead
            k = t - lead
            if 0 <= k < n_content:
                c0 = offsets[k][0] if c0 is None else c0
                c1 = offsets[k][1]
        chars = (c0 or 0, c1 or 0) if c0 is not None else (0, 0)
        b0 = len(text[: chars[0]].encode("utf-8"))
        b1 = b0 + len(text[chars[0] : chars[1]].encode("utf-8"))
        loc = ix.locate(shard, record)
        out.append({
            "dataset": recipe.datasets[d].name, "file": loc["file"], "locator": loc["locator"], "record": record,
            "shard": shard, "epoch": epoch, "tokens": (t0, t1), "chars": chars, "bytes": (b0, b1),
            "row_positions": (int(segs[j][0]), int(segs[j][-1]) + 1) if j < len(segs) else None,
            "text": text[chars[0] : chars[1]],
            "has_bos": t0 == 0 and tok.add_bos, "has_eos": tok.add_eos and t1 == n_content + lead + 1,
            # the record's own bytes in the (decompressed) file, for line formats: re-read them,
            # parse, tokenize (with BOS/EOS) and take tokens[t0:t1] to get this segment back
            "file_bytes": ((loc["byte_offset"], loc["byte_offset"] + loc["byte_length"]) if "byte_offset" in loc else None),
        })
    return out


class BatchView:
    """A batch with its recipe: decoded rows in text (``repr``) and HTML (Jupyter)."""

    def __init__(self, batch: Dict[str, Any], recipe: Any, max_rows: int = 8, max_chars: int = 600) -> None:
        self.batch, self.recipe = batch, recipe
        self.max_rows, self.max_chars = max_rows, max_chars
        p = recipe.prepare()
        self.tokenizer = p.tokenizer
        self.names = [d.name for d in recipe.datasets]

    def __len__(self) -> int:
        return len(self.batch["input"])

    def row(self, i: int) -> Dict[str, Any]:
        return {k: v[i] for k, v in self.batch.items()}

    def efficiency(self, i: int) -> float:
        """Share of non-padding input tokens in row ``i``."""
        return float((self.batch["document_ids"][i] >= 0).mean())

    def provenance(self, i: int) -> List[Dict[str, Any]]:
        return provenance(self.recipe, self.batch, i)

    def segments(self, i: int) -> List[Dict[str, Any]]:
        """Decoded segments of row ``i``: dataset, text, token count, masked label count."""
        r = self.row(i)
        out = []
        for pos in _segments(r):
            ds = int(r["dataset"][pos[0]])
            out.append({
                "dataset": self.names[ds] if 0 <= ds < len(self.names) else str(ds),
                "dataset_index": ds,
                "text": self.tokenizer.decode(r["input"][pos]),
                "tokens": len(pos),
                "masked": int((r["labels"][pos] == -100).sum()),
            })
        return out

    def __repr__(self) -> str:
        n = len(self)
        lines = [f"Batch: {n} rows x {self.batch['input'].shape[1]} tokens; fields: {', '.join(sorted(self.batch))}"]
        for i in range(min(n, self.max_rows)):
            parts = [f"[{s['dataset']}:{s['tokens']}] {s['text']}" for s in self.segments(i)]
            pad = int((self.batch["document_ids"][i] < 0).sum())
            text = " ‖ ".join(parts).replace("\n", "⏎")
            if len(text) > self.max_chars:
                text = text[: self.max_chars - 1] + "…"
            lines.append(f"row {i} ({self.efficiency(i):.0%} tokens): {text}" + (f" [+{pad} pad]" if pad else ""))
        if n > self.max_rows:
            lines.append(f"... {n - self.max_rows} more rows")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        n = len(self)
        legend = " ".join(
            f'<span class="zp-legend" style="background:{PALETTE[i % len(PALETTE)]};padding:1px 6px;border-radius:3px">'
            f"{html.escape(name)}</span>" for i, name in enumerate(self.names))
        out = [
            '<div class="zephon-batch" style="font-family:monospace;font-size:12px">',
            f'<div class="zp-head"><b>Batch</b>: {n} rows &times; {self.batch["input"].shape[1]} tokens &middot; '
            f"datasets: {legend}</div>",
        ]
        for i in range(min(n, self.max_rows)):
            prov = self.batch.get("provenance")
            out.append(f'<div class="zp-row" data-row="{i}" style="margin:4px 0;padding:3px;border:1px solid #ccc">'
                       f'<div class="zp-row-head" style="color:#555">row {i} &middot; '
                       f'<span class="zp-eff">{self.efficiency(i):.1%}</span> non-padding</div>')
            for j, seg in enumerate(self.segments(i)):
                color = PALETTE[seg["dataset_index"] % len(PALETTE)]
                title = seg["dataset"]
                if prov is not None and j < len(prov[i]):
                    d, shard, record, epoch, t0, t1 = prov[i][j]
                    title += f" · shard {shard} · record {record} · epoch {epoch} · tokens {t0}–{t1}"
                text = html.escape(seg["text"])
                if len(text) > self.max_chars:
                    text = text[: self.max_chars] + "…"
                masked = f' <span class="zp-masked" style="color:#999">[{seg["masked"]} labels masked]</span>' if seg["masked"] else ""
                out.append(f'<span class="zp-boundary" style="color:#e11d48;font-weight:bold">‖</span>'
                           f'<span class="zp-seg" data-dataset="{html.escape(seg["dataset"])}" title="{html.escape(title)}" '
                           f'style="background:{color};white-space:pre-wrap">{text}</span>{masked}')
            pad = int((self.batch["document_ids"][i] < 0).sum())
            if pad:
                out.append(f'<span class="zp-pad" style="background:#eee;color:#888">[pad &times;{pad}]</span>')
            out.append("</div>")
        if n > self.max_rows:
            out.append(f"<div>… {n - self.max_rows} more rows</div>")
        out.append("</div>")
        return "\n".join(out)


def show(batch: Dict[str, Any], recipe: Any, **kw: Any) -> BatchView:
    """Wrap a batch for display (Jupyter renders it as HTML, the console as text)."""
    return BatchView(batch, recipe, **kw)


class Explanation:
    """What a pipeline will do: plan, token shares, lane graph and lane-to-rank map."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text

    def _repr_html_(self) -> str:
        return '<pre class="zephon-explain">' + html.escape(self.text) + "</pre>"


def explain(recipe: Any, world_size: Optional[int] = None) -> Explanation:
    """The plan (datasets, sizes, tokens per byte, target vs expected token shares, lanes, rows
    per lane per step, flush intervals, workers), the node graph of a lane, and for
    ``world_size`` the lanes each rank owns. Same content as ``zephon inspect``."""
    from zephon.cli import describe_plan
    from zephon.lanes import LaneContext

    text = describe_plan(recipe, world_size)
    lane = recipe.build_lane(LaneContext(seed=recipe.seed, lane=0, lanes=recipe.lanes, workers=recipe.workers))
    try:
        graph = lane.describe()
    finally:
        lane.close()
    return Explanation(text + "\n\nnode graph of each lane (lane 0 shown):\n" + graph)
