"""Deterministic benchmark corpora: JSONL text (text half) and image-text tar shards (vision half).

JSONL shards of synthetic web-style prose from :func:`zephon.tools.synth.generate_documents`
(log-normal lengths, median ~150 words, ~2% long documents of 2,000-8,000 words). Shard ``k`` of
a size is ``generate_documents("web", docs_per_shard, seed=1000 + k)``, so a size's bytes are the
same on every machine and run. Files are written once under ``benchmarks/.data/text_<size>/``
and reused (``.data/text_<size>.json`` holds the shard count and byte total).
"""

from __future__ import annotations

import json
import os

SIZES: dict[str, dict[str, int]] = {
    # shards x docs per shard; ~1.7 KB per document on average
    "smoke": {"shards": 2, "docs": 150},  # ~0.5 MB
    "small": {"shards": 8, "docs": 2500},  # ~34 MB
    "full": {"shards": 64, "docs": 2500},  # ~270 MB
}

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, ".data")
#: zephon's bundled tokenizer (a path, so that corpora need no import of zephon)
TOKENIZER_DIR = os.path.join(os.path.dirname(HERE), "zephon", "data", "assets", "tokenizer")


def synth():
    """``zephon.tools.synth`` (numpy only). Loaded from its file where zephon cannot be imported
    (a machine without torchdata: the Grain contenders still get their corpora)."""
    try:
        from zephon.tools import synth as mod

        return mod
    except ImportError:
        import importlib.util
        import sys

        name = "zephon_synth_standalone"
        if name not in sys.modules:
            pkg = os.path.join(os.path.dirname(HERE), "zephon", "tools", "synth")
            spec = importlib.util.spec_from_file_location(
                name, os.path.join(pkg, "__init__.py"), submodule_search_locations=[pkg]
            )
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
        return sys.modules[name]


def text_corpus(size: str) -> dict[str, object]:
    """Generate (once) and describe the JSONL corpus of ``size``: dir, glob, files, bytes, docs."""
    generate_documents, write_jsonl = synth().generate_documents, synth().write_jsonl

    spec = SIZES[size]
    root = os.path.join(DATA, f"text_{size}")
    marker = os.path.join(DATA, f"text_{size}.json")  # outside the folder: loaders glob it
    files = [os.path.join(root, f"web-{k:05d}.jsonl") for k in range(spec["shards"])]
    if not os.path.exists(marker):
        os.makedirs(root, exist_ok=True)
        for k, path in enumerate(files):
            if not os.path.exists(path):
                write_jsonl(path, generate_documents("web", spec["docs"], seed=1000 + k))
        with open(marker, "w") as f:
            json.dump(
                {"shards": spec["shards"], "docs": spec["docs"], "bytes": sum(os.path.getsize(p) for p in files)}, f
            )
    with open(marker) as f:
        info = json.load(f)
    return {
        "dir": root,
        "glob": os.path.join(root, "*.jsonl"),
        "files": files,
        "bytes": info["bytes"],
        "docs": info["shards"] * info["docs"],
    }


# =========================================================================== vision half
VISION_SIZES: dict[str, dict[str, int]] = {
    # shards x images per shard; sides drawn uniformly in [min_side, max_side]
    "smoke": {"shards": 2, "images": 24, "min_side": 160, "max_side": 320},
    "small": {"shards": 8, "images": 400, "min_side": 200, "max_side": 640},  # 3,200 images
    "full": {"shards": 32, "images": 1000, "min_side": 200, "max_side": 640},  # 32,000 images
}
PNG_SHARE = (1, 4)  # 1 image in 4 is a PNG (graphics-like), the rest JPEG (photo-like)
_VISION_KEY = 0x7615_1043  # fixed part of every image's seed
VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def _raw_bytes(bg, n: int):
    """``n`` bytes from a PCG64's raw 64-bit outputs (stable across numpy versions)."""
    import numpy as np

    return bg.random_raw(-(-n // 8)).view(np.uint8)[:n]


def draw_image(seed: int, i: int, min_side: int, max_side: int) -> dict[str, object]:
    """Image ``i`` of ``seed``: ``{"image": encoded bytes, "ext": "jpg"|"png", "width", "height"}``.

    JPEG (3 in 4): a photo-like picture: a smooth colour field (a random 3x3..10x10 grid upscaled
    bicubically), a few soft shapes and per-pixel sensor-like noise (+-10), quality 80-95, 4:2:0;
    1 in 20 is greyscale. PNG (1 in 4): a graphics-like picture (gradient background, flat shapes, lines;
    1 in 4 of them RGBA). Every draw comes from PCG64's raw output keyed by (seed, i); the bytes
    are the same for a given Pillow (its zlib and libjpeg) on every run and machine.
    """
    import io

    import numpy as np
    from PIL import Image, ImageDraw, ImageFilter

    bg = np.random.PCG64(np.random.SeedSequence([int(seed), _VISION_KEY, int(i)]))
    r = [int(x) for x in bg.random_raw(160)]
    k = iter(r)
    span = max_side - min_side + 1
    w, h = min_side + next(k) % span, min_side + next(k) % span
    is_png = next(k) % PNG_SHARE[1] < PNG_SHARE[0]

    def colour():
        v = next(k)
        return (v & 255, (v >> 8) & 255, (v >> 16) & 255)

    if not is_png:
        gw, gh = 3 + next(k) % 8, 3 + next(k) % 8
        grid = _raw_bytes(bg, gw * gh * 3).reshape(gh, gw, 3)
        img = Image.fromarray(np.ascontiguousarray(grid)).resize((w, h), Image.Resampling.BICUBIC)
        layer = Image.new("RGB", (w, h), (0, 0, 0))
        mask = Image.new("L", (w, h), 0)
        d, dm = ImageDraw.Draw(layer), ImageDraw.Draw(mask)
        for _ in range(2 + next(k) % 4):
            x0, y0 = next(k) % w, next(k) % h
            box = [x0, y0, x0 + 10 + next(k) % w, y0 + 10 + next(k) % h]
            d.ellipse(box, fill=colour())
            dm.ellipse(box, fill=140 + next(k) % 116)
        img = Image.composite(layer, img, mask.filter(ImageFilter.GaussianBlur(3)))
        a = np.asarray(img, dtype=np.int16)
        noise = _raw_bytes(bg, w * h * 3).reshape(h, w, 3).astype(np.int16) % 21 - 10
        img = Image.fromarray(np.clip(a + noise, 0, 255).astype(np.uint8))
        if next(k) % 20 == 0:
            img = img.convert("L")
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=80 + next(k) % 16)
        return {"image": buf.getvalue(), "ext": "jpg", "width": w, "height": h}
    c0, c1 = np.array(colour(), np.float32), np.array(colour(), np.float32)
    t = np.linspace(0.0, 1.0, w if next(k) % 2 else h, dtype=np.float32)[:, None]
    ramp = (c0 + (c1 - c0) * t).astype(np.uint8)  # a linear gradient background
    grad = ramp[None, :, :] if len(ramp) == w else ramp[:, None, :]
    img = Image.fromarray(np.ascontiguousarray(np.broadcast_to(grad, (h, w, 3))))
    d = ImageDraw.Draw(img)
    for _ in range(3 + next(k) % 6):
        x0, y0 = next(k) % w, next(k) % h
        box = [x0, y0, x0 + 5 + next(k) % w, y0 + 5 + next(k) % h]
        (d.rectangle if next(k) % 2 else d.ellipse)(box, fill=colour())
    for _ in range(2 + next(k) % 6):
        d.line([next(k) % w, next(k) % h, next(k) % w, next(k) % h], fill=colour(), width=1 + next(k) % 4)
    if next(k) % 4 == 0:
        img = img.convert("RGBA")
        img.putalpha(Image.new("L", (w, h), 160 + next(k) % 96))
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=6)
    return {"image": buf.getvalue(), "ext": "png", "width": w, "height": h}


def captions(n: int, seed: int):
    """``n`` captions of 8-37 words: the start of synthetic web documents (``zephon.tools.synth``)."""
    generate_documents = synth().generate_documents

    out = []
    for j, doc in enumerate(generate_documents("web", n, seed)):
        words = doc.split()
        c = " ".join(words[: 8 + (j * 7919 + seed) % 30]).rstrip(".,;:!?")
        out.append(c + ".")
    return out


def vl_tokenizer() -> str:
    """zephon's bundled 4096-token BPE plus Qwen-VL's four vision special tokens (ids 4096..4099)."""
    import shutil

    from tokenizers import AddedToken, Tokenizer

    folder = os.path.join(DATA, "vl_tokenizer")
    if not os.path.exists(os.path.join(folder, "tokenizer.json")):
        os.makedirs(folder, exist_ok=True)
        tok = Tokenizer.from_file(os.path.join(TOKENIZER_DIR, "tokenizer.json"))
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VL_TOKENS])
        shutil.copy(os.path.join(TOKENIZER_DIR, "tokenizer_config.json"), folder)
        tok.save(os.path.join(folder, "tokenizer.json"))
    return folder


def vision_corpus(size: str) -> dict[str, object]:
    """Generate (once) and describe the image-text corpus of ``size``: WebDataset ``.tar`` shards
    (``{key}.jpg`` or ``{key}.png`` + ``{key}.txt`` per sample) under ``.data/vision_<size>/``.
    Shard ``k`` holds images ``k * images .. (k + 1) * images - 1`` of seed 2000."""
    write_wds = synth().write_wds

    spec = VISION_SIZES[size]
    root = os.path.join(DATA, f"vision_{size}")
    marker = os.path.join(DATA, f"vision_{size}.json")
    files = [os.path.join(root, f"pairs-{k:05d}.tar") for k in range(spec["shards"])]
    if not os.path.exists(marker):
        os.makedirs(root, exist_ok=True)
        n = spec["images"]
        caps = captions(spec["shards"] * n, 2000)
        stats = {"jpg": 0, "png": 0, "pixels": 0}
        for s, path in enumerate(files):
            samples = []
            for j in range(n):
                i = s * n + j
                im = draw_image(2000, i, spec["min_side"], spec["max_side"])
                stats[im["ext"]] += 1
                stats["pixels"] += im["width"] * im["height"]
                samples.append({"key": f"{i:08d}", "image": im["image"], "ext": im["ext"], "caption": caps[i]})
            write_wds(path, samples)
        with open(marker, "w") as f:
            json.dump(dict(spec, bytes=sum(os.path.getsize(p) for p in files), **stats), f)
    with open(marker) as f:
        info = json.load(f)
    return {
        "dir": root,
        "glob": os.path.join(root, "*.tar"),
        "files": files,
        "bytes": info["bytes"],
        "images": info["shards"] * info["images"],
        "jpg": info["jpg"],
        "png": info["png"],
        "mean_pixels": info["pixels"] / (info["shards"] * info["images"]),
        "min_side": info["min_side"],
        "max_side": info["max_side"],
    }
