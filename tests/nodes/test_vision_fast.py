"""The worker's fused image path gives the reference two-step path's bytes exactly."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from zephon.nodes.images import VisionConfig, patchify, preprocess_image, preprocess_patches

CLIP = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))


def _encode(arr: np.ndarray, fmt: str, mode: str) -> bytes:
    buf = io.BytesIO()
    im = Image.fromarray(arr)
    if mode != "RGB":
        im = im.convert(mode)
    im.save(buf, fmt, **({"quality": 85} if fmt == "JPEG" else {}))
    return buf.getvalue()


@pytest.mark.parametrize("mean,std", [((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)), CLIP, ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))])
@pytest.mark.parametrize("fmt,mode", [("JPEG", "RGB"), ("PNG", "RGB"), ("PNG", "RGBA"), ("PNG", "L"), ("PNG", "P")])
@pytest.mark.parametrize("patch,temporal,merge", [(16, 2, 2), (14, 2, 2), (8, 1, 1)])
def test_fused_equals_reference(mean, std, fmt, mode, patch, temporal, merge):
    rng = np.random.default_rng(hash((fmt, mode, patch)) % 2**32)
    h, w = int(rng.integers(40, 300)), int(rng.integers(40, 300))
    data = _encode(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), fmt, mode)
    cfg = VisionConfig(
        patch_size=patch,
        temporal_patch_size=temporal,
        merge_size=merge,
        min_pixels=64 * 64,
        max_pixels=256 * 256,
        mean=mean,
        std=std,
    )
    ref, grid_ref = patchify(preprocess_image(data, cfg), patch, temporal, merge)
    got, grid = preprocess_patches(data, cfg)
    assert got.dtype == np.float32 and got.flags.c_contiguous
    assert grid.tolist() == grid_ref.tolist()
    assert got.view(np.uint32).tobytes() == ref.view(np.uint32).tobytes()  # bit for bit, not just close
