"""Drawn images with captions: image-text pairs and OBELICS-style interleaved documents."""

from __future__ import annotations

import io

from .words import _Stream, _style_key

IMAGE_FORMATS = ("jpeg", "png", "webp")
_IMG_EXT = {"jpeg": "jpg", "png": "png", "webp": "webp"}
_IMG_VERSION = 1  # bump when the generated images change on purpose


def _caption(s: _Stream, lo: int = 4, span: int = 20) -> str:
    n = lo + s.below(span)
    words = [s.word() for _ in range(n)]
    words[0] = words[0].capitalize()
    return " ".join(words) + "."


def _draw_image(s: _Stream, min_side: int, max_side: int) -> tuple[bytes, str]:
    """One small drawn image, encoded: (bytes, extension). Sizes, modes, formats and EXIF
    orientations vary; every draw comes from ``s``."""
    from PIL import Image, ImageDraw

    w = min_side + s.below(max_side - min_side + 1)
    h = min_side + s.below(max_side - min_side + 1)
    fmt = IMAGE_FORMATS[s.below(3)]
    mode = ("RGB", "RGB", "L", "RGBA", "P")[s.below(5)]
    if fmt == "jpeg" and mode in ("RGBA", "P"):
        mode = "RGB"
    bg = tuple(s.below(256) for _ in range(3))
    img = Image.new("RGB", (w, h), bg)
    d = ImageDraw.Draw(img)
    for _ in range(2 + s.below(4)):
        x0, y0 = s.below(w), s.below(h)
        x1, y1 = x0 + 1 + s.below(w), y0 + 1 + s.below(h)
        col = tuple(s.below(256) for _ in range(3))
        (d.rectangle if s.below(2) else d.ellipse)([x0, y0, x1, y1], fill=col)
    if mode == "L":
        img = img.convert("L")
    elif mode == "RGBA":
        img = img.convert("RGBA")
        img.putalpha(Image.new("L", (w, h), 128 + s.below(128)))
    elif mode == "P":
        img = img.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    buf = io.BytesIO()
    if fmt == "jpeg":
        kw: dict = {"quality": 85}
        if s.below(3) == 0:  # EXIF orientation: the pixels are stored rotated
            exif = Image.Exif()
            exif[0x0112] = (3, 6, 8)[s.below(3)]
            kw["exif"] = exif.tobytes()
        img.save(buf, format="JPEG", **kw)
    elif fmt == "png":
        img.save(buf, format="PNG", optimize=False, compress_level=6)
    else:
        img.save(buf, format="WEBP", quality=80, method=4)
    return buf.getvalue(), _IMG_EXT[fmt]


def generate_image_text(n: int, seed: int, *, min_side: int = 24, max_side: int = 96) -> list[dict]:
    """``n`` deterministic image-caption samples: ``{"key", "image" (encoded bytes), "ext",
    "caption"}``. Formats JPEG/PNG/WebP, modes RGB/L/RGBA/P, some JPEGs with an EXIF
    orientation; sample ``i`` depends only on ``(seed, i)`` (and the Pillow codecs).

    >>> s = generate_image_text(2, seed=0)[0]
    >>> s["key"], s["ext"], s["caption"]
    ('00000000', 'jpg', 'Vou zorcri to sneet at has of ress of her than in stair.')
    """
    key = _style_key("image_text")
    out = []
    for i in range(int(n)):
        s = _Stream(int(seed), key, _IMG_VERSION, i)
        data, ext = _draw_image(s, min_side, max_side)
        out.append({"key": f"{i:08d}", "image": data, "ext": ext, "caption": _caption(s)})
    return out


def generate_interleaved(
    n: int, seed: int, *, min_side: int = 24, max_side: int = 96, max_images: int = 3
) -> list[dict]:
    """``n`` OBELICS-style documents ``{"texts": [str|None], "images": [bytes|None]}``: at each
    position exactly one of the two is set; 1..max_images images among 1..4 text segments.

    >>> doc = generate_interleaved(1, seed=0)[0]
    >>> [("text" if t is not None else "image") for t in doc["texts"]]
    ['image', 'text']
    """
    key = _style_key("interleaved")
    out = []
    for i in range(int(n)):
        s = _Stream(int(seed), key, _IMG_VERSION, i)
        n_img = 1 + s.below(max_images)
        n_txt = 1 + s.below(4)
        slots = ["t"] * n_txt + ["i"] * n_img
        for j in range(len(slots) - 1, 0, -1):  # Fisher-Yates with our own draws
            k = s.below(j + 1)
            slots[j], slots[k] = slots[k], slots[j]
        texts: list = []
        images: list = []
        for kind in slots:
            if kind == "t":
                texts.append(_caption(s, 6, 30))
                images.append(None)
            else:
                texts.append(None)
                images.append(_draw_image(s, min_side, max_side)[0])
        out.append({"texts": texts, "images": images})
    return out
