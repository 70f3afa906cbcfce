"""Every image mode and format Pillow reads gives the right pixels, the same from every container.

The references are computed here with numpy from the raw arrays the images were made from (never
by zephon's decoder): 16-bit / 32-bit samples divided by 65535, floats as they are, transparency
composited onto the background, palettes looked up. Images are 64 x 32 with a pixel budget that
keeps that size, so ``pixel_values`` are the normalised reference in patch order.
"""

from __future__ import annotations

import io
import os
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image
from vl_fixtures import make_vl_tokenizer

from zephon import Recipe
from zephon.data import BadRecord
from zephon.data.datasets.multimodal import index_multimodal
from zephon.data.datasets.wds import IMAGE_EXTS, tar_member_role
from zephon.nodes.images import VisionConfig, decode_image, decode_pixels, patchify, preprocess_patches
from zephon.recipe.parse import read_table
from zephon.recipe.spec import DATA_VERSION, VisionTable, versioned_default

W, H = 64, 32
CFG = VisionConfig(min_pixels=1024, max_pixels=1 << 20, decode="exact")
rng = np.random.default_rng(0)
GRAD16 = (np.arange(W * H, dtype=np.int64).reshape(H, W) * 65535 // (W * H - 1)).astype(np.uint16)
RGB = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
ALPHA = rng.integers(0, 256, (H, W), dtype=np.uint8)
ALPHA[:4] = 0  # fully transparent rows (their colour must not show)
GREY = rng.integers(0, 256, (H, W), dtype=np.uint8)
FLOAT = rng.random((H, W), dtype=np.float32)
PALETTE = rng.integers(0, 256, (16, 3), dtype=np.uint8)
INDEX = rng.integers(0, 16, (H, W), dtype=np.uint8)
BITS = (np.indices((H, W)).sum(axis=0) % 2).astype(bool)


def _img(a: np.ndarray, mode: str) -> Image.Image:
    return Image.frombytes(mode, (W, H), np.ascontiguousarray(a).tobytes())


def _grey(g: np.ndarray) -> np.ndarray:
    return np.repeat(g.astype(np.float64)[:, :, None], 3, axis=2)


def _over_white(rgb: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    a = alpha.astype(np.float64)[:, :, None] / 255
    return rgb.astype(np.float64) / 255 * a + 1.0 * (1 - a)


def _palette(transparent: int | None) -> tuple[Image.Image, np.ndarray]:
    im = _img(INDEX, "P")
    im.putpalette(PALETTE.reshape(-1).tolist())
    ref = PALETTE[INDEX].astype(np.float64) / 255
    if transparent is not None:
        im.info["transparency"] = transparent
        ref[transparent == INDEX] = 1.0
    return im, ref


def _cases() -> dict[str, tuple[Image.Image, np.ndarray]]:
    """mode name -> (Pillow image, reference RGB float64 in [0, 1])."""
    rgba = np.dstack([RGB, ALPHA])
    la = np.dstack([GREY, ALPHA])
    return {
        "RGB": (_img(RGB, "RGB"), RGB / 255.0),
        "L": (_img(GREY, "L"), _grey(GREY) / 255),
        "1": (Image.fromarray(BITS), _grey(BITS)),
        "I;16": (_img(GRAD16, "I;16"), _grey(GRAD16) / 65535),
        "I": (_img(GRAD16.astype(np.int32), "I"), _grey(GRAD16) / 65535),
        "F": (_img(FLOAT, "F"), _grey(FLOAT)),
        "LA": (_img(la, "LA"), _over_white(np.dstack([GREY] * 3), ALPHA)),
        "RGBA": (_img(rgba, "RGBA"), _over_white(RGB, ALPHA)),
        "P": _palette(None),
        "P+transparency": _palette(3),
        # K = 0: CMYK -> RGB is 255 - C, 255 - M, 255 - Y whatever the formula for K
        "CMYK": (_img(np.dstack([255 - RGB, np.zeros((H, W), np.uint8)]), "CMYK"), RGB / 255.0),
    }


CASES = _cases()
#: (format, extension, modes it stores losslessly in that mode)
FORMATS = [
    ("PNG", "png", ["RGB", "L", "1", "I;16", "LA", "RGBA", "P", "P+transparency"]),
    ("TIFF", "tif", ["RGB", "L", "1", "I;16", "I", "F", "LA", "RGBA", "P", "CMYK"]),
    ("GIF", "gif", ["L", "P", "P+transparency"]),
    ("BMP", "bmp", ["RGB", "L", "1", "P"]),
    ("WEBP", "webp", ["RGB", "RGBA"]),
    ("PPM", "pgm", ["L", "I;16"]),
]


def _encode(mode: str, fmt: str) -> bytes:
    im = CASES[mode][0]
    buf = io.BytesIO()
    kw: dict = {"lossless": True, "exact": True} if fmt == "WEBP" else {}
    if "transparency" in im.info:
        kw["transparency"] = im.info["transparency"]
    im.save(buf, fmt, **kw)
    return buf.getvalue()


ALL = [(fmt, ext, mode) for fmt, ext, modes in FORMATS for mode in modes]


def _expected(ref: np.ndarray) -> np.ndarray:
    x = ((ref.astype(np.float32) - np.float32(0.5)) / np.float32(0.5)).astype(np.float32)
    return patchify(x, CFG.patch_size, CFG.temporal_patch_size, CFG.merge_size)[0]


@pytest.mark.parametrize(("fmt", "ext", "mode"), ALL, ids=[f"{f}-{m}" for f, _, m in ALL])
def test_every_mode_and_format_decodes_to_the_reference(fmt: str, ext: str, mode: str) -> None:
    data = _encode(mode, fmt)
    x = decode_pixels(data)
    np.testing.assert_allclose(
        np.asarray(x, np.float64) / (255 if x.dtype == np.uint8 else 1), CASES[mode][1], atol=2e-6
    )
    p, grid = preprocess_patches(data, CFG)
    assert grid.tolist() == [1, H // 16, W // 16]
    np.testing.assert_allclose(p, _expected(CASES[mode][1]), atol=1e-5)


def _containers(tmp: str, images: list[tuple[str, bytes]]) -> dict[str, list[bytes]]:
    """The same images in a WebDataset tar, an image_text Parquet file and an interleaved one;
    each read back through zephon's index: container -> the image bytes of its records."""
    os.makedirs(f"{tmp}/wds")
    with tarfile.open(f"{tmp}/wds/s.tar", "w") as tf:
        for i, (ext, data) in enumerate(images):
            for name, blob in ((f"{i:04d}.{ext}", data), (f"{i:04d}.txt", f"caption {i}".encode())):
                info = tarfile.TarInfo(name)
                info.size = len(blob)
                tf.addfile(info, io.BytesIO(blob))
    blobs = [d for _, d in images]
    captions = [f"caption {i}" for i in range(len(images))]
    pq.write_table(pa.table({"image": blobs, "caption": captions}), f"{tmp}/pairs.parquet")
    inter = pa.table({"images": [[b, None] for b in blobs], "texts": [[None, c] for c in captions]})
    pq.write_table(inter, f"{tmp}/docs.parquet")
    out = {}
    for name, path, kind in (
        ("wds", f"{tmp}/wds/*.tar", "image_text"),
        ("parquet", f"{tmp}/pairs.parquet", "image_text"),
        ("interleaved", f"{tmp}/docs.parquet", "interleaved"),
    ):
        ix = index_multimodal(name, path, kind=kind)
        recs = ix.read(0, list(range(len(images))))
        got = []
        for r in recs:
            assert hasattr(r, "segments"), f"{name}: {r}"  # a BadRecord: 'caption but no image'
            got.append(next(s for s in r.segments if isinstance(s, (bytes, bytearray))))
        out[name] = got
    return out


def test_every_container_gives_the_same_pixels(tmp_path) -> None:
    images = [(ext, _encode(mode, fmt)) for fmt, ext, mode in ALL]
    jpeg = io.BytesIO()
    Image.fromarray(RGB).save(jpeg, "JPEG")
    images.append(("jpg", jpeg.getvalue()))
    by = _containers(str(tmp_path), images)
    for i, (ext, data) in enumerate(images):
        ref, _ = preprocess_patches(data, CFG)
        for name, got in by.items():
            assert bytes(got[i]) == data, f"{name}: image #{i} (.{ext}) read back different bytes"
            p, _ = preprocess_patches(bytes(got[i]), CFG)
            assert np.array_equal(p, ref), f"{name}: image #{i} (.{ext})"


def test_tar_image_members_are_every_extension_pillow_opens() -> None:
    Image.init()
    openable = {e.lstrip(".") for e, f in Image.registered_extensions().items() if f in Image.OPEN}
    for ext in ("jpg", "png", "webp", "gif", "tif", "tiff", "bmp", "pgm", "ico", "jp2", "tga"):
        if ext in openable:
            assert tar_member_role(f"k.{ext.upper()}") == ("k", "image", ext)
    assert set(IMAGE_EXTS) <= openable
    assert {"gif", "tif", "tiff", "bmp"} <= set(IMAGE_EXTS)
    assert tar_member_role("k.pdf") is None  # Pillow writes PDF but cannot open it


def test_a_multi_frame_image_is_its_first_frame() -> None:
    frames = [_img(np.full((H, W), v, np.uint8), "L") for v in (10, 200, 90)]
    for fmt in ("GIF", "TIFF", "PNG"):
        buf = io.BytesIO()
        frames[0].save(buf, fmt, save_all=True, append_images=frames[1:])
        with Image.open(io.BytesIO(buf.getvalue())) as im:
            assert getattr(im, "n_frames", 1) == 3, fmt
        x = decode_pixels(buf.getvalue())
        assert x.dtype == np.uint8 and (x == 10).all(), fmt


def test_high_depth_and_alpha_resize_in_float_without_clipping_to_white() -> None:
    cfg = VisionConfig(min_pixels=8192, max_pixels=1 << 20, decode="exact")  # 64x32 -> 128x64, resized
    data = _encode("I;16", "PNG")
    p, grid = preprocess_patches(data, cfg)
    assert grid.tolist() != [1, H // 16, W // 16]
    assert p.dtype == np.float32 and -1.0 <= p.min() < -0.9 and 0.9 < p.max() <= 1.0  # a gradient, not white
    ref = CASES["I;16"][1].mean()
    assert abs(float(p.mean()) - (ref - 0.5) / 0.5) < 0.02


def test_background_setting() -> None:
    data = _encode("RGBA", "PNG")
    x = decode_pixels(data, background=(0.0, 0.5, 1.0))
    assert np.allclose(x[0], [0.0, 0.5, 1.0])  # row 0 is fully transparent


def test_version_1_keeps_pillows_convert() -> None:
    """data_version 1 (``decode = "convert"``) decodes as before: a 16-bit PNG clips to white,
    alpha is dropped (the colour under it shows)."""
    assert versioned_default(VisionTable, "decode", 1) == "convert"
    assert versioned_default(VisionTable, "decode", 2) == "exact" and DATA_VERSION >= 2
    assert read_table(VisionTable, {}, "[vision]", version=1)["decode"] == "convert"
    assert read_table(VisionTable, {}, "[vision]", version=DATA_VERSION)["decode"] == "exact"
    assert read_table(VisionTable, {"decode": "convert"}, "[vision]", version=DATA_VERSION)["decode"] == "convert"
    old = VisionConfig(min_pixels=1024, max_pixels=1 << 20)
    assert old.decode == "convert"
    assert (np.asarray(decode_image(_encode("I;16", "PNG")))[:, W // 2 :] == 255).all()
    p1, _ = preprocess_patches(_encode("RGBA", "PNG"), old)
    np.testing.assert_allclose(p1, _expected(RGB / 255.0), atol=1e-5)  # the colour under alpha 0 shows
    # an 8-bit opaque image is the same bytes under both rules
    rgb = _encode("RGB", "PNG")
    assert np.array_equal(preprocess_patches(rgb, old)[0], preprocess_patches(rgb, CFG)[0])


def _tar_with(path: str, exts: list[str]) -> None:
    with tarfile.open(path, "w") as tar:
        for i, ext in enumerate(exts):
            fmt = {"jpg": "JPEG", "png": "PNG", "gif": "GIF", "tif": "TIFF", "bmp": "BMP"}[ext]
            buf = io.BytesIO()
            Image.new("RGB", (32, 32), (i * 40, 10, 10)).save(buf, fmt)
            for name, data in ((f"s{i}.{ext}", buf.getvalue()), (f"s{i}.txt", f"sample {i}".encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("version", [1, 2])
def test_which_tar_members_are_images_follows_the_data_version(tmp_path, version) -> None:
    """Data version 1 keeps the four classic extensions (a .gif or .tif sample has no image and a
    skip recipe skips it, as before version 2); version 2 reads every extension Pillow opens."""
    os.makedirs(tmp_path / "wds")
    _tar_with(str(tmp_path / "wds" / "a.tar"), ["jpg", "gif", "png", "tif", "bmp"])
    make_vl_tokenizer(str(tmp_path / "tok"))
    recipe = Recipe.from_dict(
        {
            "seed": 1,
            "lanes": 1,
            "seq_len": 128,
            "global_batch_size": 1,
            "data_version": version,
            "cache_dir": "cache",
            "tokenizer": {"path": "tok"},
            "datasets": [{"name": "wds", "kind": "image_text", "path": "wds/*.tar", "on_error": "skip"}],
            "vision": {"patch_size": 16, "merge_size": 2, "min_pixels": 1024, "max_pixels": 4096},
        },
        base_dir=str(tmp_path),
    )
    (ix,) = recipe.prepare(progress=None).indexes
    bad = [isinstance(r, BadRecord) for r in ix.read(0, list(range(ix.shards[0].num_records)))]
    assert bad == ([False, True, False, True, True] if version == 1 else [False] * 5)
    if version == 1:
        assert "(.jpg/.jpeg/.png/.webp; data version 2 reads" in ix.read(0, [1])[0].reason
