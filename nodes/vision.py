"""Vision operators: decode, resize, normalise, patchify, placeholder tokens; run on the mapper.

The per-image steps are plain functions in :mod:`zephon.nodes.images` (decode, resize,
normalise, patchify); :class:`FetchVision` is the elementwise batch
function for :class:`zephon.engine.OrderedMapper` that turns a chunk of WorkItems into
:class:`MMDoc` s: it reads image-text records, decodes their images (Pillow releases the GIL
while decoding and resizing, so threads scale), tokenizes all text segments of the chunk in one
call and lays out each sample's tokens as TorchTitan's multimodal pipeline does::

    [BOS] text... <|vision_start|> <|image_pad|> x N <|vision_end|> text... [EOS]

with ``N = (H / patch) * (W / patch) / merge**2`` for an image resized to H x W. Text-only
datasets of the same recipe have their own encoder, :class:`MMText` (their
:class:`zephon.nodes.FetchTokenize` documents as :class:`MMDoc`); ``[[filters]]`` see a sample's
caption (:func:`caption`).

Layout (TorchTitan 0.3.0, ``hf_datasets/multimodal/utils/image.py::vision_to_patches`` with
``patch_order="block"``): an image becomes ``temporal_patch_size`` identical frames; patches
are ordered ``(t, bh, bw, m, n)`` (each merge group contiguous) and each patch vector is
channel-first ``(c, pt, ph, pw)``: ``patch_dim = 3 * temporal_patch_size * patch**2``;
``grid_thw = [1, H / patch, W / patch]``.

Bad images (:class:`zephon.nodes.images.ImageError`) follow the dataset's ``on_error``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from zephon.data.datasets import BadRecord, DataError
from zephon.engine import ProcessLocal

from .images import ImageError, VisionConfig, preprocess_patches
from .policy import skip_hint
from .tokenize import FetchTokenize
from .worksource import WorkItem, read_items

__all__ = [
    "SPECIAL_NAMES",
    "FetchVision",
    "LayoutSpan",
    "MMDoc",
    "MMText",
    "caption",
    "mrope_positions",
    "sample_layout",
]

SPECIAL_NAMES = ("image", "video", "vision_start", "vision_end")


def mrope_positions(tokens: np.ndarray, image_id: int, grids: np.ndarray, merge_size: int) -> np.ndarray:
    """3D (t, h, w) rotary positions ``(n, 3)`` of one document, as TorchTitan's collator builds
    them: text tokens count up on all three axes; an image's placeholder run gets its merged
    grid coordinates offset by the position where it starts; the text after it resumes at the
    largest position so far + 1.

    >>> tokens = np.array([7, 9, 9, 8])           # text, a 1 x 2 merged image (2 tokens), text
    >>> mrope_positions(tokens, 9, np.array([[1, 2, 4]]), 2).tolist()
    [[0, 0, 0], [1, 1, 1], [1, 1, 2], [3, 3, 3]]
    """
    n = len(tokens)
    out = np.empty((n, 3), dtype=np.int64)
    is_img = tokens == image_id
    cur, i, k = 0, 0, 0
    while i < n:
        if is_img[i] and k < len(grids):
            t, gh, gw = (int(v) for v in grids[k])
            lh, lw = gh // merge_size, gw // merge_size
            cnt = min(t * lh * lw, n - i)
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(lh), np.arange(lw), indexing="ij")
            grid = np.stack([tt.ravel(), hh.ravel(), ww.ravel()], axis=1)[:cnt] + cur
            out[i : i + cnt] = grid
            cur = int(grid.max()) + 1
            i += cnt
            k += 1
        else:
            j = i + 1
            while j < n and not is_img[j]:
                j += 1
            out[i:j] = (np.arange(j - i, dtype=np.int64) + cur)[:, None]
            cur += j - i
            i = j
    return out


class LayoutSpan(NamedTuple):
    """One piece of an image-text sample's token sequence: ``kind`` is "bos", "text", "image"
    (a vision block: ``<|vision_start|>``, placeholders, ``<|vision_end|>``) or "eos";
    ``segment`` its index among the record's segments (-1 for BOS/EOS); tokens ``start:stop``."""

    kind: str
    segment: int
    start: int
    stop: int


def sample_layout(lengths: Sequence[tuple[str, int]], *, bos: bool, eos: bool) -> list[LayoutSpan]:
    """The token layout of one image-text sample, the one rule that :class:`FetchVision` builds
    samples by and provenance reads them back with: [BOS], then each segment in record order
    (a caption's text tokens, or an image's vision block), then [EOS].

    ``lengths[j]`` is ``("text", tokens)`` or ``("image", tokens of the block, start and end
    included)`` for segment ``j``.

    >>> [tuple(s) for s in sample_layout([("image", 6), ("text", 3)], bos=True, eos=True)]
    [('bos', -1, 0, 1), ('image', 0, 1, 7), ('text', 1, 7, 10), ('eos', -1, 10, 11)]
    """
    out: list[LayoutSpan] = []
    pos = 0
    if bos:
        out.append(LayoutSpan("bos", -1, 0, 1))
        pos = 1
    for j, (kind, n) in enumerate(lengths):
        if kind not in ("text", "image"):
            raise ValueError(f"a sample segment is 'text' or 'image', got {kind!r}")
        out.append(LayoutSpan(kind, j, pos, pos + int(n)))
        pos += int(n)
    if eos:
        out.append(LayoutSpan("eos", -1, pos, pos + 1))
    return out


class MMDoc(NamedTuple):
    """One sample for :class:`zephon.nodes.MMPack`: tokens with placeholder runs, the
    concatenated patches of its images, their grids, optional MRoPE positions.

    A text document of a mixed recipe is an ``MMDoc`` without images; ``offset`` is where its
    ``tokens`` start in the whole document (a long document planned as several parts), so the
    packer can cite token ranges of the document (provenance).

    >>> import numpy as np
    >>> from zephon.nodes.worksource import WorkItem
    >>> doc = MMDoc(np.arange(5, dtype=np.int32), 0, WorkItem(0, 1, 7, 0, 0))
    >>> doc.num_images, doc.provenance
    (0, 'dataset #0, shard #1, record 7 (epoch 0)')
    """

    tokens: np.ndarray  # int32 (n,)
    dataset: int
    item: WorkItem
    pixel_values: np.ndarray | None = None  # float32 (patches, patch_dim), images in order
    grid_thw: np.ndarray | None = None  # int64 (images, 3)
    mrope: np.ndarray | None = None  # int64 (n, 3)
    skipped: str | None = None
    offset: int = 0  # index of tokens[0] in the whole document's tokens (parts of long text documents)
    truncated: int = 0  # tokens cut from its end to fit a row (text after its last image; counted by MMPack)
    mask: np.ndarray | None = None  # bool (n,): the tokens trained on as targets (chat); None: every one

    @property
    def num_images(self) -> int:
        """How many images the sample has (0 for text)."""
        return 0 if self.grid_thw is None else int(len(self.grid_thw))

    @property
    def provenance(self) -> str:
        """A short human-readable origin (dataset, shard, record, epoch) for error messages."""
        return self.item.provenance


def caption(value: Any, how: str = "rendered") -> str:
    """What a text rule sees of an image-text sample: its text segments joined by line breaks."""
    return "\n".join(seg for seg in getattr(value, "segments", ()) if isinstance(seg, str))


class MMText(ProcessLocal):
    """The encoder of the text datasets of an image-text recipe: :class:`FetchTokenize`'s
    documents as :class:`MMDoc` s (no images), so one packer takes both."""

    def __init__(self, text: FetchTokenize) -> None:
        self.text = text
        ProcessLocal.__init__(self)

    def __call__(self, items: list[WorkItem], given: Mapping[tuple[int, int, int], Any] | None = None) -> list[MMDoc]:
        return [MMDoc(d.tokens, d.dataset, d.item, skipped=d.skipped, offset=d.offset) for d in self.text(items, given)]

    def __repr__(self) -> str:
        return f"MMText({self.text!r})"


class FetchVision(ProcessLocal):
    """``items -> [MMDoc]`` for a recipe mixing text and image-text datasets.

    ``kinds[d]`` is "text", "image_text" or "interleaved"; ``special`` maps ``image``,
    ``video``, ``vision_start``, ``vision_end`` to token ids; ``row_len`` (seq_len + 1) bounds a
    sample: one with images that is longer is cut after its last image if possible, else
    skipped (counted, the same on every world size). Picklable; cached per process.
    """

    def __init__(
        self,
        datasets: Sequence[Any],
        kinds: Sequence[str],
        tokenizer: Any,
        vision: VisionConfig,
        special: dict[str, int],
        *,
        on_error: Sequence[str] | None = None,
        row_len: int,
    ) -> None:
        self.datasets = list(datasets)
        self.kinds = list(kinds)
        self.tokenizer = tokenizer
        self.vision = vision
        self.special = dict(special)
        self.on_error = list(on_error or ["raise"] * len(self.datasets))
        self.row_len = int(row_len)
        self._special_ids = np.array([self.special[k] for k in SPECIAL_NAMES], dtype=np.int64)
        ProcessLocal.__init__(self)

    # -- per record ---------------------------------------------------------------------------
    def _bad(self, it: WorkItem, rec: Any, reason: str) -> MMDoc:
        """Apply on_error to a bad record: raise (naming dataset, file, key) or a counted skip."""
        file = getattr(rec, "file", None)
        loc = getattr(rec, "locator", None)
        if self.on_error[it.dataset] == "raise":
            name = self.datasets[it.dataset].name
            raise DataError(reason, dataset=name, file=file, locator=loc, fix=skip_hint(name))
        return MMDoc(np.zeros(0, np.int32), it.dataset, it, skipped=f"{reason} ({file}, {loc})")

    def _skip(self, it: WorkItem, reason: str) -> MMDoc:
        return MMDoc(np.zeros(0, np.int32), it.dataset, it, skipped=reason)

    def __call__(self, items: list[WorkItem], given: Mapping[tuple[int, int, int], Any] | None = None) -> list[MMDoc]:
        """``items`` (of image-text datasets) -> their :class:`MMDoc` s; ``given``: samples already
        read, by ``(dataset, shard, record)`` (the others are read here, grouped per shard)."""
        out: list[MMDoc | None] = [None] * len(items)
        text = [i for i, it in enumerate(items) if self.kinds[it.dataset] == "text"]
        if text:
            raise ValueError(
                f"FetchVision encodes image-text datasets only, not {sorted({items[i].dataset for i in text})}"
            )
        records = read_items(self.datasets, items, given)
        # decode images, collect text segments (one tokenizer call for the chunk)
        texts: list[str] = []
        prepared: dict[int, list[Any]] = {}
        for i, (it, rec) in enumerate(zip(items, records)):
            if isinstance(rec, BadRecord):
                out[i] = self._bad(it, rec, rec.reason)
                continue
            segs: list[Any] = []
            try:
                for j, seg in enumerate(rec.segments):
                    if isinstance(seg, str):
                        segs.append(("t", len(texts)))
                        texts.append(seg)
                    else:
                        try:
                            segs.append(("i", preprocess_patches(seg, self.vision)))
                        except ImageError as e:
                            n_img = sum(1 for x in rec.segments[:j] if not isinstance(x, str))
                            raise ImageError(f"{e} (image #{n_img + 1} of the sample)") from None
            except ImageError as e:
                out[i] = self._bad(it, rec, str(e))
                continue
            prepared[i] = segs
        encoded = self.tokenizer.encode_content(texts) if texts else []
        for i, segs in prepared.items():
            out[i] = self._assemble(items[i], records[i], segs, encoded)
        return out  # type: ignore[return-value]

    def _assemble(self, it: WorkItem, rec: Any, segs: list[Any], encoded: list[np.ndarray]) -> MMDoc:
        v, sp, tok = self.vision, self.special, self.tokenizer
        m2 = v.merge_size * v.merge_size
        lengths: list[tuple[str, int]] = []
        patches, grids = [], []
        for kind, val in segs:
            if kind == "t":
                ids = encoded[val]
                if ids.size and np.isin(ids, self._special_ids).any():
                    return self._bad(
                        it,
                        rec,
                        "the text contains an image/vision placeholder token; it would "
                        "misalign images and placeholders",
                    )
                lengths.append(("text", len(ids)))
            else:
                p, g = val
                lengths.append(("image", int(g.prod()) // m2 + 2))
                patches.append(p)
                grids.append(g)
        if len(grids) > v.max_images_per_batch or (v.max_images_per_row and len(grids) > v.max_images_per_row):
            limit = "max_images_per_batch" if len(grids) > v.max_images_per_batch else "max_images_per_row"
            return self._skip(it, f"sample has {len(grids)} images, more than [vision].{limit}")
        layout = sample_layout(lengths, bos=tok.add_bos, eos=tok.add_eos)
        n = layout[-1].stop if layout else 0
        tokens = np.empty(n, np.int32)
        for span in layout:
            if span.kind == "text":
                tokens[span.start : span.stop] = encoded[segs[span.segment][1]]
            elif span.kind == "image":
                tokens[span.start] = sp["vision_start"]
                tokens[span.start + 1 : span.stop - 1] = sp["image"]
                tokens[span.stop - 1] = sp["vision_end"]
            else:
                tokens[span.start] = tok.bos_id if span.kind == "bos" else tok.eos_id
        if n > self.row_len:
            last_image_end = max((s.stop for s in layout if s.kind == "image"), default=0)
            if last_image_end > self.row_len:
                return self._skip(
                    it,
                    f"sample too long: {n} tokens with images ending at token {last_image_end}, "
                    f"more than seq_len + 1 = {self.row_len}; raise seq_len or lower [vision].max_pixels",
                )
            tokens = tokens[: self.row_len]  # cut the text after the last image
        cut = max(0, n - self.row_len)
        if len(patches) == 1:
            pix = patches[0]  # no copy for the common one-image sample
        else:
            pix = np.concatenate(patches) if patches else np.zeros((0, v.patch_dim), np.float32)
        grid = np.stack(grids) if grids else np.zeros((0, 3), np.int64)
        mrope = mrope_positions(tokens, sp["image"], grid, v.merge_size) if v.mrope else None
        return MMDoc(tokens, it.dataset, it, pix, grid, mrope, truncated=cut)

    def __repr__(self) -> str:
        return f"FetchVision(datasets={[d.name for d in self.datasets]}, kinds={self.kinds}, vision={self.vision})"
