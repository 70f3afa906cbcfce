"""Multimodal batch display: thumbnails beside their placeholder tokens (HTML, parsed), the text
repr's and ``zephon inspect --show``'s ``[image N: HxW, K tokens]`` markers, and the un-patchify
round trip behind the thumbnails."""

from __future__ import annotations

import base64
import io
import json
import os
import re
from html.parser import HTMLParser

import numpy as np
import pytest

pytest.importorskip("PIL")

from PIL import Image
from vl_fixtures import vl_config, write_vl_root

from zephon import Recipe
from zephon.nodes.images import patchify
from zephon.tools.display import denormalize, row_images, show, thumbnail_size, unpatchify

LABEL = re.compile(r"\[image (\d+): (\d+)x(\d+), (\d+) tokens\]")


# -- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return write_vl_root(tmp_path_factory.mktemp("dmm"), seed=2, n_wds=32, n_parquet=16, n_interleaved=12)


@pytest.fixture(scope="module")
def recipe(root):
    # non-default mean/std so that de-normalisation is really exercised
    cfg = vl_config(root)
    cfg["vision"] = dict(
        cfg["vision"], mean=[0.48145466, 0.4578275, 0.40821073], std=[0.26862954, 0.26130258, 0.27577711]
    )
    return Recipe.from_dict(cfg, root)


@pytest.fixture(scope="module")
def batches(recipe):
    with recipe.global_loader(2) as g:
        return [next(g) for _ in range(3)]


def write_toml(cfg: dict, path: str) -> str:
    lines = [f"{k} = {json.dumps(v)}" for k, v in cfg.items() if not isinstance(v, (dict, list))]
    lines.append(f"[tokenizer]\npath = {json.dumps(cfg['tokenizer']['path'])}")
    for d in cfg["datasets"]:
        lines.append("[[datasets]]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in d.items()]
    for sec in ("vision", "pack", "shuffle"):
        lines.append(f"[{sec}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in cfg[sec].items()]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return path


# -- a small DOM --------------------------------------------------------------------------------
class Node:
    def __init__(self, tag, attrs):
        self.tag, self.attrs, self.children = tag, dict(attrs), []

    @property
    def cls(self):
        return self.attrs.get("class", "")

    def text(self):
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def find(self, cls):
        out = []
        for c in self.children:
            if isinstance(c, Node):
                if c.cls == cls:
                    out.append(c)
                out += c.find(cls)
        return out


class Dom(HTMLParser):
    VOID = {"img", "br", "hr", "meta", "input"}

    def __init__(self, text):
        super().__init__(convert_charrefs=True)
        self.root = Node("#root", {})
        self.stack = [self.root]
        self.feed(text)
        self.close()
        assert len(self.stack) == 1, "unbalanced HTML"

    def handle_starttag(self, tag, attrs):
        n = Node(tag, attrs)
        self.stack[-1].children.append(n)
        if tag not in self.VOID:
            self.stack.append(n)

    def handle_startendtag(self, tag, attrs):
        self.stack[-1].children.append(Node(tag, attrs))

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        assert self.stack[-1].tag == tag, f"</{tag}> closes <{self.stack[-1].tag}>"
        self.stack.pop()

    def handle_data(self, data):
        self.stack[-1].children.append(data)


# -- an independent reading of a row: documents, images, text between ----------------------------
def expected_row(recipe, b, r):
    """Per document of row r: list of ("text", str) / ("image", n) from the raw token ids."""
    p = recipe.prepare()
    sp, tok = p.special, p.tokenizer
    ids, doc = b["input"][r], b["document_ids"][r]
    first = int(b["images_per_row"][:r].sum())
    n_img = first
    out = []
    for j in np.unique(doc[doc >= 0]):
        pos = np.flatnonzero(doc == j)
        lo, hi = pos[0], pos[-1] + 1
        assert hi - lo == len(pos)
        pieces, cur, i = [], lo, lo
        while i < hi:
            if ids[i] == sp["vision_start"]:
                k = i + 1
                while k < hi and ids[k] == sp["image"]:
                    k += 1
                assert k < hi and ids[k] == sp["vision_end"], "an image block is cut"
                if i > cur:
                    pieces.append(("text", tok.decode(ids[cur:i])))
                pieces.append(("image", n_img, k - i - 1))
                n_img += 1
                cur = i = k + 1
            else:
                i += 1
        if cur < hi:
            pieces.append(("text", tok.decode(ids[cur:hi])))
        out.append(pieces)
    assert n_img - first == b["images_per_row"][r]
    return out


def label_of(recipe, b, n, k):
    ps = recipe.vision.patch_size
    _, gh, gw = (int(v) for v in b["grid_thw"][n])
    assert k == gh * gw // recipe.vision.merge_size**2
    return f"[image {n}: {gh * ps}x{gw * ps}, {k} tokens]"


def decode_png(img_node):
    src = img_node.attrs["src"]
    assert src.startswith("data:image/png;base64,")
    raw = base64.b64decode(src.split(",", 1)[1], validate=True)
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    im = Image.open(io.BytesIO(raw))
    im.load()
    return im


# -- HTML ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("thumb_px", [96, 24])  # 96: thumbnails at full size; 24: scaled down
def test_html_thumbnails_text_and_boundaries(recipe, batches, thumb_px):
    ps, m = recipe.vision.patch_size, recipe.vision.merge_size
    total_images = 0
    for b in batches:
        B = len(b["input"])
        view = show(b, recipe, max_rows=B, max_chars=100_000, thumb_px=thumb_px)
        dom = Dom(view._repr_html_()).root
        rows = dom.find("zp-row")
        assert [int(x.attrs["data-row"]) for x in rows] == list(range(B))
        for r, row in enumerate(rows):
            thumbs = row.find("zp-thumb")
            k = int(b["images_per_row"][r])
            assert len(thumbs) == k
            assert row.find("zp-row-images")[0].text() == str(k)
            first, grids, _ = row_images(b, r)
            assert [int(t.attrs["data-image"]) for t in thumbs] == list(range(first, first + k))
            for t, (_, gh, gw) in zip(thumbs, grids):
                im = decode_png(t)
                H, W = int(gh) * ps, int(gw) * ps
                assert im.mode == "RGB" and im.size == thumbnail_size(H, W, thumb_px)
                assert (int(t.attrs["width"]), int(t.attrs["height"])) == im.size
                if thumb_px >= max(H, W):  # not scaled: the thumbnail is the image the model sees
                    assert np.array_equal(np.asarray(im), view.image(int(t.attrs["data-image"])))
                else:
                    assert max(im.size) == thumb_px
                    assert abs(im.size[0] / im.size[1] - W / H) < 0.1
                    # and it looks like the image (a downscale, not noise)
                    ref = np.asarray(
                        Image.fromarray(view.image(int(t.attrs["data-image"]))).resize(im.size, Image.BOX), np.float32
                    )
                    assert np.abs(np.asarray(im, np.float32) - ref).mean() < 12
            total_images += k
            # documents: one red boundary marker each, in order; text and images as the tokens say
            segs = row.find("zp-seg")
            bounds = row.find("zp-boundary")
            exp = expected_row(recipe, b, r)
            assert len(segs) == len(bounds) == len(exp)
            assert all(x.text() == "‖" and "#e11d48" in x.attrs["style"] for x in bounds)
            for seg, pieces in zip(segs, exp):
                # walk the segment's children: text, then an image block, then text ...
                got = []
                for c in seg.children:
                    if isinstance(c, str):
                        if got and got[-1][0] == "text":
                            got[-1] = ("text", got[-1][1] + c)
                        else:
                            got.append(("text", c))
                    else:
                        assert c.cls == "zp-image", c.cls
                        (img,) = c.find("zp-thumb")
                        (lab,) = c.find("zp-image-label")
                        n = int(c.attrs["data-image"])
                        assert int(img.attrs["data-image"]) == n
                        assert int(c.attrs["data-tokens"]) == int(b["grid_thw"][n].prod()) // m**2
                        got.append(("image", n, int(c.attrs["data-tokens"])))
                        assert lab.text() == label_of(recipe, b, n, got[-1][2])
                assert got == pieces
                assert "<|image_pad|>" not in seg.text() and "<|vision_start|>" not in seg.text()
            # masked labels: every label from <|vision_start|> to the last placeholder is -100 and
            # the image block says so (the one at <|vision_end|> too when another image follows)
            sp = recipe.prepare().special
            ids, labels = b["input"][r], b["labels"][r]
            vs = np.flatnonzero(ids == sp["vision_start"])
            ve = np.flatnonzero(ids == sp["vision_end"])
            assert len(vs) == len(ve) == k
            for c, s0, e0 in zip(row.find("zp-image"), vs, ve):
                assert (labels[s0:e0] == -100).all()
                follows_image = e0 + 1 < len(ids) and ids[e0 + 1] == sp["vision_start"]
                assert int(c.attrs["data-masked"]) == e0 - s0 + int(follows_image)
                assert "dashed" in c.attrs["style"] and "-100" in c.attrs["title"]
            pad = int((b["document_ids"][r] < 0).sum())
            pads = row.find("zp-pad")
            assert (len(pads) == 1 and f"×{pad}" in pads[0].text()) if pad else not pads
            masked = [int(re.search(r"\d+", x.text()).group()) for x in row.find("zp-masked")]
            assert sum(masked) == sum(s["masked"] for s in view.segments(r))
    assert total_images == sum(len(b["grid_thw"]) for b in batches) > 10


def test_text_repr_shows_labels_not_placeholders(recipe, batches):
    b = batches[0]
    text = repr(show(b, recipe, max_rows=len(b["input"]), max_chars=100_000))
    assert "<|image_pad|>" not in text
    lines = [x for x in text.splitlines() if x.startswith("row ")]
    assert len(lines) == len(b["input"])
    for r, line in enumerate(lines):
        labels = LABEL.findall(line)
        assert len(labels) == b["images_per_row"][r] and f"{b['images_per_row'][r]} images" in line
        first = int(b["images_per_row"][:r].sum())
        for j, (n, h, w, k) in enumerate(labels):
            assert int(n) == first + j
            assert f"[image {n}: {h}x{w}, {k} tokens]" == label_of(recipe, b, int(n), int(k))
    assert f"{len(b['grid_thw'])} images" in text.splitlines()[0]


def test_unpatchify_round_trip(recipe, batches):
    v = recipe.vision
    mean, std = np.asarray(v.mean, np.float32), np.asarray(v.std, np.float32)
    for b in batches:
        view = show(b, recipe)
        sizes = b["grid_thw"].prod(axis=1)
        starts = np.concatenate([[0], np.cumsum(sizes)])
        for n, grid in enumerate(b["grid_thw"]):
            patches = b["pixel_values"][starts[n] : starts[n + 1]]
            img = unpatchify(patches, grid, v.patch_size, v.temporal_patch_size, v.merge_size)
            assert img.shape == (grid[1] * v.patch_size, grid[2] * v.patch_size, 3)
            again, g2 = patchify(img, v.patch_size, v.temporal_patch_size, v.merge_size)
            assert np.array_equal(again, patches) and g2.tolist() == grid.tolist()
            # through 8-bit pixels (what the thumbnail shows) and the pipeline's normalisation
            rgb = view.image(n)
            assert rgb.dtype == np.uint8 and np.array_equal(rgb, denormalize(img, v.mean, v.std))
            x = rgb.astype(np.float32) * np.float32(1 / 255)
            x = (x - mean) / std
            renorm, _ = patchify(x, v.patch_size, v.temporal_patch_size, v.merge_size)
            # exact decoding (data version 2) keeps float pixels: the 8-bit view is within one step
            step = 1e-5 if v.decode == "convert" else float(1 / 255 / std.min()) + 1e-5
            np.testing.assert_allclose(renorm, patches, rtol=0, atol=step)
    # a synthetic image with an odd layout (3 x 5 merged blocks), patch 14, 2 frames
    rng = np.random.default_rng(0)
    img = rng.standard_normal((3 * 28, 5 * 28, 3)).astype(np.float32)
    p, g = patchify(img, 14, 2, 2)
    assert np.array_equal(unpatchify(p, g, 14, 2, 2), img)
    with pytest.raises(ValueError, match="do not match grid"):
        unpatchify(p[:-1], g, 14, 2, 2)


def test_text_only_rows_and_batches_are_unchanged(recipe, root):
    # a text-only recipe over the same text data: no image fields, no image markup
    cfg = vl_config(root)
    cfg["datasets"] = [d for d in cfg["datasets"] if d.get("kind", "text") == "text"]
    r = Recipe.from_dict(cfg, root)
    with r.global_loader(1) as g:
        b = next(g)
    view = show(b, r)
    html = view._repr_html_()
    assert "zp-thumb" not in html and "zp-image" not in html
    assert all("pieces" not in s for s in view.segments(0))


# -- provenance: every sample of every row back to its source bytes --------------------------------
def row_tokens(b, r):
    """The row's seq_len + 1 tokens: the inputs, then the last label (-1 where that is masked)."""
    last = b["labels"][r][-1]
    return np.r_[b["input"][r], last if last != -100 else -1]


def cited_value(seg):
    """Re-read one cited caption / image from the file alone (not through zephon's reader)."""
    if seg.get("member"):  # a tar member: its bytes at the cited range of the .tar file
        a, z = seg["file_bytes"]
        with open(seg["file"], "rb") as f:
            f.seek(a)
            raw = f.read(z - a)
        if "sha256" in seg:
            return raw
        text = raw.decode("utf-8")
        return json.loads(text)[seg["field"]] if seg["field"] else text
    import pyarrow.parquet as pq

    v = pq.read_table(seg["file"], columns=[seg["column"]]).column(seg["column"])[seg["row"]].as_py()
    if seg["list_index"] is not None:
        v = v[seg["list_index"]]
    if seg["field"]:
        v = v[seg["field"]]
    return v


def test_provenance_reproduces_every_sample_from_its_source(recipe, batches):
    import hashlib

    from zephon.nodes.images import preprocess_image
    from zephon.tools.display import provenance

    p = recipe.prepare()
    tok, sp, v = p.tokenizer, p.special, recipe.vision
    m2 = v.merge_size**2
    seen = set()
    for b in batches:
        view = show(b, recipe)
        sizes = b["grid_thw"].prod(axis=1)
        pstart = np.concatenate([[0], np.cumsum(sizes)])
        for r in range(len(b["input"])):
            full = row_tokens(b, r)
            provs = view.provenance(r)
            assert provs == provenance(recipe, b, r)
            assert (
                len(provs) == len(b["provenance"][r]) == len(np.unique(b["document_ids"][r][b["document_ids"][r] >= 0]))
            )
            json.dumps(b["provenance"][r])  # plain JSON
            covered = 0
            first = int(b["images_per_row"][:r].sum())
            row_imgs = []
            for seg in provs:
                a0, z0 = seg["row_positions"]
                t0, t1 = seg["tokens"]
                assert z0 - a0 == t1 - t0 and a0 == covered
                covered = z0
                want = full[a0:z0]
                if seg["kind"] == "text":
                    assert seg["images"] == []
                    with open(seg["file"], "rb") as f:
                        f.seek(seg["file_bytes"][0])
                        raw = f.read(seg["file_bytes"][1] - seg["file_bytes"][0])
                    again = tok.encode_batch([json.loads(raw)["text"]])[0][t0:t1]
                    seen.add("text")
                else:
                    assert seg["file"].endswith(".tar") == ("key" in seg) == (seg["locator"].startswith("key"))
                    # the sample's token sequence, rebuilt from the cited bytes alone:
                    # [BOS] (text | <|vision_start|> <|image_pad|> x N <|vision_end|>)... [EOS]
                    pieces = sorted(seg["texts"] + seg["images"], key=lambda x: x["segment"])
                    ids = [np.array([tok.bos_id])] if tok.add_bos else []
                    for piece in pieces:
                        value = cited_value(dict(piece, file=seg["file"]))
                        if "sha256" in piece:  # an image: same bytes, same pixels as in the batch
                            assert hashlib.sha256(value).hexdigest() == piece["sha256"]
                            assert len(value) == piece["num_bytes"]
                            n = piece["index"]
                            assert n == first + len(row_imgs)
                            row_imgs.append(n)
                            img = preprocess_image(value, v)
                            patches, grid = patchify(img, v.patch_size, v.temporal_patch_size, v.merge_size)
                            assert grid.tolist() == b["grid_thw"][n].tolist() == list(piece["grid"])
                            assert np.array_equal(patches, b["pixel_values"][pstart[n] : pstart[n + 1]])
                            k = int(grid.prod()) // m2
                            ids.append(np.r_[sp["vision_start"], np.full(k, sp["image"]), sp["vision_end"]])
                            pa, pz = piece["row_positions"]
                            assert (full[pa + 1 : pz - 1] == sp["image"]).all() and pz - pa == k + 2
                            seen.add(
                                ("image", seg["kind"], "member" if piece.get("member") else piece["field"] or "column")
                            )
                        else:  # a caption / text entry: re-tokenized, the row's tokens
                            text = value
                            b0, b1 = piece["bytes"]
                            assert text.encode("utf-8")[b0:b1].decode("utf-8") == piece["text"]
                            assert text[slice(*piece["chars"])] == piece["text"]
                            tids = np.asarray(tok._tokenizer().encode(text, add_special_tokens=False).ids)
                            ids.append(tids)
                            pa, pz = piece["row_positions"]
                            ta, tz = piece["tokens"]
                            off = sum(len(x) for x in ids[:-1])
                            assert np.array_equal(full[pa:pz], tids[ta - off : tz - off])
                            if piece.get("member"):
                                seen.add(("text", "json" if piece["field"] else "txt"))
                            else:
                                seen.add(("text", seg["kind"], "list" if piece["list_index"] is not None else "column"))
                    if tok.add_eos:
                        ids.append(np.array([tok.eos_id]))
                    again = np.concatenate(ids)[t0:t1]
                    assert seg["text"] == "".join(x["text"] for x in seg["texts"])
                assert len(again) == len(want)
                known = want >= 0
                assert np.array_equal(again[known], want[known]), (r, seg["file"], seg["locator"])
            assert row_imgs == list(range(first, first + int(b["images_per_row"][r])))
            n_in = int((b["document_ids"][r] >= 0).sum())  # the segments account for every token of the row
            assert covered == n_in or covered == n_in + 1 == len(full)
    # every source kind was traced: text, tar (.txt and .json captions), Parquet pairs (plain and
    # Hugging Face image structs), interleaved Parquet
    assert {
        "text",
        ("text", "txt"),
        ("text", "json"),
        ("image", "image_text", "member"),
        ("image", "image_text", "column"),
        ("image", "image_text", "bytes"),
        ("text", "image_text", "column"),
        ("image", "interleaved", "column"),
        ("text", "interleaved", "list"),
    } <= seen, seen


def test_provenance_is_the_same_on_every_world_size(recipe, batches):
    with recipe.global_loader(4) as g:
        again = [next(g) for _ in range(len(batches))]
    assert [b["provenance"] for b in again] == [b["provenance"] for b in batches]


def test_html_titles_name_the_source(recipe, batches):
    b = batches[0]
    view = show(b, recipe, max_rows=len(b["input"]))
    dom = Dom(view._repr_html_()).root
    for r, row in enumerate(dom.find("zp-row")):
        titles = [s.attrs["title"] for s in row.find("zp-seg")]
        for title, seg in zip(titles, view.provenance(r)):
            assert f"{seg['file']} · {seg['locator']}" in title, title
            assert f"tokens {seg['tokens'][0]}–{seg['tokens'][1]}" in title


def test_provenance_without_the_field_says_why(recipe, batches):
    b = {k: v for k, v in batches[0].items() if k != "provenance"}
    with pytest.raises(ValueError, match="no provenance"):
        show(b, recipe).provenance(0)


# -- zephon inspect --show -------------------------------------------------------------------------
def test_cli_inspect_show_multimodal(recipe, root, capsys):
    from zephon.tools.cli import main

    cfg = vl_config(root)
    cfg["vision"] = dict(cfg["vision"], mean=list(recipe.vision.mean), std=list(recipe.vision.std))
    path = write_toml(cfg, os.path.join(root, "dmm.toml"))
    assert main(["inspect", path, "--show", "4", "--measure-steps", "1"]) == 0
    out = capsys.readouterr().out
    rows = [x for x in out.splitlines() if x.startswith("row ")]
    assert len(rows) == 4
    rec = Recipe.from_toml(path)
    with rec.global_loader(1) as g:
        b = next(g)
    assert sum(b["images_per_row"][:4]) > 0
    for r, line in enumerate(rows):
        k = int(b["images_per_row"][r])
        assert line.startswith(f"row {r} ({k} images): ")
        assert "<|image_pad|>" not in line
        # documents in order, each "[dataset:N tok] text [image ...] text"
        body = line.split(": ", 1)[1]
        pad = int((b["document_ids"][r] < 0).sum())
        if pad:
            assert body.endswith(f" [+{pad} pad]")
            body = body[: -len(f" [+{pad} pad]")]
        docs = body.split(" ‖ ")
        exp = expected_row(rec, b, r)
        assert len(docs) == len(exp)
        for d, pieces in zip(docs, exp):
            tag, text = d.split("] ", 1)
            want = "".join(p[1] if p[0] == "text" else label_of(rec, b, p[1], p[2]) for p in pieces)
            assert text == want.replace("\n", "⏎")
        assert len(LABEL.findall(line)) == k
