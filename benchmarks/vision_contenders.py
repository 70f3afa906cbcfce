"""The vision-language contenders: the same work built with each loader.

The work: read image-caption pairs from WebDataset ``.tar`` shards, decode the image (JPEG or
PNG) to RGB, resize it bicubically to the Qwen-VL pixel budget (sides multiples of
``patch_size * merge_size``, ``min_pixels <= h * w <= max_pixels``), normalise to float32,
cut it into ``temporal_patch_size x patch x patch`` patches in TorchTitan's block order,
tokenize the caption, lay the sample out as ``[BOS] <|vision_start|> <|image_pad|> x N
<|vision_end|> caption [EOS]`` (N = patches / merge_size**2), pack whole samples (never split)
into rows of ``seq_len`` tokens and deliver batches of ``batch_rows`` rows plus the batch's
``pixel_values`` and ``grid_thw`` to a consumer that does nothing.

Every builder returns a :class:`Built` (iterator, checkpoint size, close, notes);
:func:`batch_stats` normalises any contender's batch to (input, labels, images).

The limit (:func:`limit_images_per_s`, ``what="decode"``) is Pillow's decode + convert to RGB
alone on N threads over the same image bytes, already in memory: no loader can beat it. A second
reference (``what="work"``) runs the whole per-image work (decode, resize, normalise, patchify,
tokenize) on N threads with no packing or batching: the ceiling for *this* work.
"""

from __future__ import annotations

import io
import json
import mmap
import os
import pickle
import sys
import tarfile
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

#: how reports and logs name each contender
VLABELS = {
    "zephon": "zephon (thread workers)",
    "zephon_proc": "zephon (process workers)",
    "zephon_proc_noshm": "zephon (process workers, shm off)",
    "grain_threads": "Grain (threads)",
    "grain_mp": "Grain (mp_prefetch)",
    "titan": "TorchTitan MMDataLoader",
    "limit": "limit: Pillow decode alone",
    "work": "reference: per-image work alone",
}

os.environ["TOKENIZERS_PARALLELISM"] = "false"

SEED = 1
IGNORE_INDEX = -100
VISION_TOKENS = {
    "vision_start": "<|vision_start|>",
    "vision_end": "<|vision_end|>",
    "image": "<|image_pad|>",
    "video": "<|video_pad|>",
}


@dataclass
class VSettings:
    files: list[str]
    glob: str
    corpus_dir: str
    cache_dir: str
    tokenizer_dir: str  # zephon's bundled BPE + the four Qwen-VL vision tokens
    seq_len: int = 2048
    batch_rows: int = 4
    lanes: int = 4  # zephon: 1 row per lane
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536  # 256 x 256
    max_pixels: int = 262144  # 512 x 512
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    chunk: int = 8  # samples per worker task (zephon's [vision].chunk_size default)
    max_images_per_batch: int = 128
    grain_prefetch: int = 64  # Grain ReadOptions.prefetch_buffer_size (samples)
    # TorchTitan MMDataLoader packing_buffer_size (samples). 0 = its packer off: one sample per row.
    # Its MMSamplePacker only emits a row that is filled *exactly* (``current_length <
    # max_seq_length`` keeps the row in the buffer), so with ~190-token image samples the buffer
    # grows until subset sums hit seq_len: measured on the small corpus with 32 and 2 workers,
    # 49 s to the first batch, 9 GB RSS and a 5.9 GB checkpoint (the buffered pixel tensors).
    titan_packing_buffer: int = 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VSettings:
        d = dict(d)
        for k in ("mean", "std"):
            if k in d:
                d[k] = tuple(d[k])
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size


@dataclass
class Built:
    it: Iterator[Any]
    state_bytes: Callable[[], dict[str, Any]]
    close: Callable[[], None] = lambda: None
    notes: list[str] = field(default_factory=list)
    loader: Any = None  # zephon: the GlobalLoader (pool metrics)


def batch_stats(batch: Any) -> tuple[np.ndarray, np.ndarray | None, int]:
    """(input [rows, seq_len], labels or None, images in the batch) of any contender's batch."""
    labels = None
    if isinstance(batch, (tuple, list)):  # TorchTitan: (input_dict, labels)
        batch, labels = batch
    else:
        labels = batch.get("labels")
    x = batch["input"]
    g = batch.get("grid_thw")
    n = 0 if g is None else int(g.shape[0])
    x = x.numpy() if hasattr(x, "numpy") else np.asarray(x)
    if labels is not None:
        labels = labels.numpy() if hasattr(labels, "numpy") else np.asarray(labels)
    return x, labels, n


# --------------------------------------------------------------------------- shared pieces
def preprocess(data: bytes, s: VSettings) -> tuple[np.ndarray, np.ndarray]:
    """Decode, resize, normalise, patchify one image: (patches float32 [N, patch_dim] in block
    order, grid_thw int64 [3]).

    Grain's map and the work reference call the very function zephon's workers call
    (:func:`zephon.nodes.images.preprocess_patches`, a plain function any Grain user can import),
    so the ratios measure the loaders, not two implementations of the image work. (The plain
    numpy way, float32 normalise then patchify, gives the same bytes at about twice the cost of
    those two steps; TorchTitan runs its own code.)"""
    from zephon.nodes.images import preprocess_patches

    return preprocess_patches(data, _vision_config(s))


_CONFIGS: dict[Any, Any] = {}


def _vision_config(s: VSettings):
    from zephon.nodes.images import VisionConfig

    key = (s.patch_size, s.temporal_patch_size, s.merge_size, s.min_pixels, s.max_pixels, tuple(s.mean), tuple(s.std))
    cfg = _CONFIGS.get(key)
    if cfg is None:
        cfg = _CONFIGS[key] = VisionConfig(
            patch_size=s.patch_size,
            temporal_patch_size=s.temporal_patch_size,
            merge_size=s.merge_size,
            min_pixels=s.min_pixels,
            max_pixels=s.max_pixels,
            mean=tuple(s.mean),
            std=tuple(s.std),
            mrope=False,
        )
    return cfg


class WdsSource:
    """Random access to the (image bytes, caption) pairs of WebDataset tar shards: a member-offset
    index over mmapped files; picklable. Grain 0.2.18 has no tar source, and any object with
    ``__len__``/``__getitem__`` is a Grain ``RandomAccessDataSource``: this is that object."""

    IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")

    def __init__(self, files: Sequence[str]) -> None:
        self.files = list(files)
        rows = []
        for fi, f in enumerate(self.files):
            members: dict[str, dict[str, tuple[int, int]]] = {}
            order: list[str] = []
            with tarfile.open(f, "r:") as tf:
                for m in tf:
                    if not m.isfile():
                        continue
                    key, _, ext = os.path.basename(m.name).partition(".")
                    if key not in members:
                        members[key] = {}
                        order.append(key)
                    slot = "img" if ext.lower() in self.IMAGE_EXTS else "txt" if ext.lower() == "txt" else None
                    if slot:
                        members[key][slot] = (m.offset_data, m.size)
            for key in order:
                mm = members[key]
                if "img" in mm and "txt" in mm:
                    rows.append((fi, *mm["img"], *mm["txt"]))
        self.index = np.array(rows, dtype=np.int64).reshape(-1, 5)
        self._maps: list[mmap.mmap] | None = None

    def __getstate__(self):
        d = dict(self.__dict__)
        d["_maps"] = None
        return d

    def _m(self) -> list[mmap.mmap]:
        if self._maps is None:
            maps = []
            for f in self.files:
                with open(f, "rb") as fh:
                    maps.append(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ))
            self._maps = maps
        return self._maps

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> tuple[bytes, str]:
        fi, io_, il, to, tl = (int(v) for v in self.index[int(i)])
        m = self._m()[fi]
        return m[io_ : io_ + il], m[to : to + tl].decode("utf-8")


class _Tok:
    """The VL tokenizer, loaded lazily (picklable), with the special ids."""

    def __init__(self, tokenizer_dir: str) -> None:
        self.tokenizer_dir = tokenizer_dir
        self._tok = None

    def __getstate__(self):
        return {"tokenizer_dir": self.tokenizer_dir, "_tok": None}

    def load(self):
        if self._tok is None:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(os.path.join(self.tokenizer_dir, "tokenizer.json"))
            self.bos, self.eos, self.pad = (tok.token_to_id(t) for t in ("<|bos|>", "<|eos|>", "<|pad|>"))
            self.ids = {k: tok.token_to_id(v) for k, v in VISION_TOKENS.items()}
            self._tok = tok
        return self._tok


def layout(ids: Sequence[int], grid: np.ndarray, t: _Tok, merge: int) -> np.ndarray:
    """``[BOS] <vs> <img> x N <ve> caption [EOS]`` as int32."""
    n = int(grid.prod()) // (merge * merge)
    out = np.empty(n + len(ids) + 4, dtype=np.int32)
    out[0], out[1] = t.bos, t.ids["vision_start"]
    out[2 : 2 + n] = t.ids["image"]
    out[2 + n] = t.ids["vision_end"]
    out[3 + n : -1] = ids
    out[-1] = t.eos
    return out


# --------------------------------------------------------------------------- zephon
def zephon_recipe(s: VSettings):
    from zephon import Recipe

    return Recipe.from_dict(
        {
            "seed": SEED,
            "lanes": s.lanes,
            "seq_len": s.seq_len,
            "global_batch_size": s.batch_rows,
            "cache_dir": s.cache_dir,
            "tokenizer": {"path": s.tokenizer_dir},
            "datasets": [{"name": "pairs", "kind": "image_text", "path": s.glob}],
            "vision": {
                "patch_size": s.patch_size,
                "temporal_patch_size": s.temporal_patch_size,
                "merge_size": s.merge_size,
                "min_pixels": s.min_pixels,
                "max_pixels": s.max_pixels,
                "mean": list(s.mean),
                "std": list(s.std),
                "mrope": False,
                "max_images_per_batch": s.max_images_per_batch,
                "chunk_size": s.chunk,
            },
            "shuffle": {"buffer": 1},
        },
        s.corpus_dir,
    )


def build_zephon(s: VSettings, threads: int, backend: str = "thread", shm_mb: int | None = None) -> Built:
    from zephon import WorkerConfig

    r = zephon_recipe(s)
    r.prepare()
    g = r.global_loader(world_size=1, workers=WorkerConfig(threads, backend, shm_mb=shm_mb))

    def state_bytes():
        st = g.state_dict()
        per_lane = [len(json.dumps(v).encode()) for k, v in st.items() if k.startswith("lane_")]
        return {
            "bytes_per_rank": len(json.dumps(st).encode()),
            "max_bytes_per_lane": max(per_lane),
            "lanes": len(per_lane),
            "format": "JSON",
        }

    return Built(iter(g), state_bytes, g.close, loader=g)


# --------------------------------------------------------------------------- Grain
class GrainSample:
    """Grain map: (image bytes, caption) -> {tokens, pixel_values, grid_thw} (one sample)."""

    def __init__(self, s: VSettings) -> None:
        self.s = s
        self.t = _Tok(s.tokenizer_dir)

    def __call__(self, pair):
        data, caption = pair
        patches, grid = preprocess(data, self.s)
        ids = self.t.load().encode(caption, add_special_tokens=False).ids
        return {"tokens": layout(ids, grid, self.t, self.s.merge_size), "pixel_values": patches, "grid_thw": grid[None]}


class GrainBatch:
    """Grain ``batch_fn`` after FirstFitPack (which emits one packed row at a time): rows ->
    zephon's batch fields (pixel_values of the rows concatenated in token order)."""

    def __init__(self, s: VSettings) -> None:
        self.s = s
        self.t = _Tok(s.tokenizer_dir)

    def __call__(self, rows):
        t = self.t
        t.load()
        tok = np.stack([r["tokens"] for r in rows]).astype(np.int64)
        seg = np.stack([r["tokens_segment_ids"] for r in rows])
        pos = np.stack([r["tokens_positions"] for r in rows]).astype(np.int64)
        lab = tok[:, 1:].copy()
        lab[np.isin(lab, list(t.ids.values())) | (seg[:, 1:] == 0)] = IGNORE_INDEX
        pix = [x for r in rows for x in r["pixel_values"]]
        grids = [g for r in rows for g in r["grid_thw"]]
        return {
            "input": tok[:, :-1],
            "labels": lab,
            "positions": pos[:, :-1],
            "document_ids": seg[:, :-1] - 1,
            "pixel_values": np.concatenate(pix) if pix else np.zeros((0, self.s.patch_dim), np.float32),
            "grid_thw": np.concatenate(grids) if grids else np.zeros((0, 3), np.int64),
        }


def _grain_pipeline(s: VSettings, read_threads: int):
    import grain
    import grain.experimental as ge

    tk = _Tok(s.tokenizer_dir)
    tk.load()
    ds = grain.MapDataset.source(WdsSource(s.files)).shuffle(seed=SEED).repeat().map(GrainSample(s))
    it = ds.to_iter_dataset(grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=s.grain_prefetch))
    it = ge.FirstFitPackIterDataset(
        it,
        length_struct={"tokens": s.seq_len + 1},
        num_packing_bins=s.batch_rows,
        shuffle_bins=False,
        meta_features=("pixel_values", "grid_thw"),
        padding_struct={"tokens": tk.pad},
    )
    return it.batch(s.batch_rows, drop_remainder=True, batch_fn=GrainBatch(s))


def build_grain_threads(s: VSettings, threads: int) -> Built:
    it = iter(_grain_pipeline(s, threads))
    return Built(
        it, lambda: {"bytes_per_rank": len(json.dumps(it.get_state(), default=str).encode()), "format": "JSON"}
    )


def build_grain_mp(s: VSettings, threads: int) -> Built:
    import grain

    ds = _grain_pipeline(s, 1).mp_prefetch(grain.MultiprocessingOptions(num_workers=threads))
    it = iter(ds)

    def close():
        c = getattr(it, "close", None)
        if c:
            c()

    return Built(
        it, lambda: {"bytes_per_rank": len(json.dumps(it.get_state(), default=str).encode()), "format": "JSON"}, close
    )


# --------------------------------------------------------------------------- TorchTitan
def install_torchvision_shim() -> bool:
    """TorchTitan's image code imports torchvision. The only torchvision wheel for torch 2.13 on
    PyPI is a CUDA build that does not load with the CPU torch here, so, if torchvision is
    missing, the five functions TorchTitan calls are provided the way torchvision implements them
    on CPU: ``pil_to_tensor`` (the same copy and permute), ``resize`` on uint8 (torch's native
    uint8 bicubic antialiased ``interpolate``, as torchvision's ``resize_image`` calls it, with
    its channels-last stride fix), ``to_dtype`` (scale by 1/255), ``normalize`` (in-place
    ``sub_``/``div_``), ``pad``; ``io.decode_image`` decodes with Pillow (unused on this path:
    ``datasets`` hands TorchTitan PIL images). Returns True if the shim was installed."""
    try:
        import torchvision.transforms.v2.functional  # noqa: F401

        return False
    except Exception:
        pass
    import enum

    import datasets  # noqa: F401  (before the shim: it records whether torchvision is installed)
    import torch

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"

    class ImageReadMode(enum.Enum):
        UNCHANGED = 0
        RGB = 3

    def pil_to_tensor(pic):
        img = torch.as_tensor(np.array(pic, copy=True))
        img = img.view(pic.size[1], pic.size[0], len(pic.getbands()))
        return img.permute((2, 0, 1))

    def resize(image, size, interpolation=InterpolationMode.BILINEAR, max_size=None, antialias=True):
        shape = image.shape
        c, oh, ow = shape[-3:]
        nh, nw = size
        if (nh, nw) == (oh, ow):
            return image
        image = image.reshape(-1, c, oh, ow)
        strides = image.stride()
        if (
            image.is_contiguous(memory_format=torch.channels_last)
            and image.shape[0] == 1
            and image.numel() != strides[0]
        ):
            image = image.as_strided((1, c, oh, ow), strides)
        out = torch.nn.functional.interpolate(
            image, size=[nh, nw], mode=interpolation.value, align_corners=False, antialias=antialias
        )
        return out.reshape(shape[:-3] + (c, nh, nw))

    def to_dtype(image, dtype=torch.float32, scale=False):
        out = image.to(dtype)
        return out.mul_(1.0 / 255) if scale and image.dtype == torch.uint8 else out

    def normalize(image, mean, std, inplace=False):
        if not inplace:
            image = image.clone()
        m = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
        sd = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
        return image.sub_(m).div_(sd)

    def pad(image, padding, fill=0):
        left, top, right, bottom = padding
        return torch.nn.functional.pad(image, (left, right, top, bottom), value=fill)

    def decode_image(data, mode=ImageReadMode.RGB):
        from PIL import Image

        im = Image.open(io.BytesIO(data.numpy().tobytes())).convert("RGB")
        return pil_to_tensor(im)

    mods = {
        name: types.ModuleType(name)
        for name in (
            "torchvision",
            "torchvision.io",
            "torchvision.transforms",
            "torchvision.transforms.v2",
            "torchvision.transforms.v2.functional",
        )
    }
    F = mods["torchvision.transforms.v2.functional"]
    for fn in (pil_to_tensor, resize, to_dtype, normalize, pad):
        setattr(F, fn.__name__, fn)
    F.InterpolationMode = InterpolationMode
    mods["torchvision.io"].decode_image = decode_image
    mods["torchvision.io"].ImageReadMode = ImageReadMode
    mods["torchvision"].io = mods["torchvision.io"]
    mods["torchvision"].transforms = mods["torchvision.transforms"]
    mods["torchvision.transforms"].v2 = mods["torchvision.transforms.v2"]
    mods["torchvision.transforms.v2"].functional = F
    import importlib.machinery

    for name, mod in mods.items():
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
        mod.__zephon_bench_shim__ = True
    sys.modules.update(mods)
    return True


def _titan_sample(sample: dict[str, Any], **kw: Any):
    """TorchTitan's ``_process_cc12_wd_sample`` with the image taken from ``.jpg`` or ``.png``
    (its own reads ``.jpg`` only); the rest is its ``_process_mm_sample``, unchanged."""
    from torchtitan.hf_datasets.multimodal.mm_datasets import _process_mm_sample

    image = sample.get("jpg")
    if image is None:
        image = sample.get("png")
    return _process_mm_sample(texts=[None, sample.get("txt", "")], images=[image, None], **kw)


class _TitanLoader:
    """``load_dataset`` of the tar shards, streaming, with the features given (the webdataset
    builder infers them from the first 5 samples, which cannot have both .jpg and .png)."""

    def __init__(self, files: Sequence[str]) -> None:
        self.files = list(files)

    def __call__(self, path: str):
        from datasets import Features, Image, Value, load_dataset

        feats = Features(
            {
                "__key__": Value("string"),
                "__url__": Value("string"),
                "jpg": Image(),
                "png": Image(),
                "txt": Value("string"),
            }
        )
        return load_dataset(
            "webdataset", data_files={"train": self.files}, split="train", streaming=True, features=feats
        )


def build_titan(s: VSettings, num_workers: int) -> Built:
    install_torchvision_shim()
    import torch
    from torchtitan.components.tokenizer import MultiModalTokenizer
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.multimodal import mm_datasets as mm

    mm.MM_DATASETS["zephon-bench"] = DatasetConfig(
        path=s.corpus_dir, loader=_TitanLoader(s.files), sample_processor=_titan_sample
    )
    tok = MultiModalTokenizer(
        MultiModalTokenizer.Config(
            image_token=VISION_TOKENS["image"],
            video_token=VISION_TOKENS["video"],
            vision_start_token=VISION_TOKENS["vision_start"],
            vision_end_token=VISION_TOKENS["vision_end"],
            pad_token="<|pad|>",
        ),
        tokenizer_path=s.tokenizer_dir,
    )
    cfg = mm.MMDataLoader.Config(
        dataset="zephon-bench",
        dataset_path=s.corpus_dir,
        infinite=True,
        num_workers=num_workers,
        packing_buffer_size=s.titan_packing_buffer,
        max_images_per_batch=s.max_images_per_batch,
        patch_size=s.patch_size,
        temporal_patch_size=s.temporal_patch_size,
        spatial_merge_size=s.merge_size,
        min_pixels=s.min_pixels,
        max_pixels=s.max_pixels,
        image_mean=tuple(s.mean),
        image_std=tuple(s.std),
        build_mrope_positions=False,
    )
    if num_workers == 0:
        torch.set_num_threads(1)  # the main process alone: 1 thread, like the others' "1"
    dl = mm.MMDataLoader(
        cfg, dp_world_size=1, dp_rank=0, tokenizer=tok, seq_len=s.seq_len, local_batch_size=s.batch_rows
    )
    it = iter(dl)

    def state_bytes():
        return {"bytes_per_rank": len(pickle.dumps(dl.state_dict())), "format": "pickle"}

    def close():
        c = getattr(it, "_shutdown_workers", None)
        if c:
            c()

    notes = []
    if s.titan_packing_buffer == 0:
        notes.append(
            "TorchTitan MMDataLoader ran with packing_buffer_size = 0 (its packer off: one sample per "
            "row, padded), because its MMSamplePacker only emits exactly filled rows and its buffer grows "
            "without bound on image samples (see benchmarks/README.md)"
        )
    return Built(it, state_bytes, close, notes)


# --------------------------------------------------------------------------- the limit
def load_pairs(files: Sequence[str]) -> list[tuple[bytes, str]]:
    src = WdsSource(files)
    return [src[i] for i in range(len(src))]


def limit_images_per_s(
    s: VSettings, threads: int, target_images: int, what: str = "decode", cpu: Callable[[], float] | None = None
) -> dict[str, Any]:
    """``what="decode"``: ``Image.open(bytes).convert("RGB")`` (decode + convert; a no-op copy
    for RGB images) alone; ``what="work"``: decode, resize, normalise, patchify and the
    caption's tokens (one ``encode_batch_fast`` per chunk) with no packing or batching.
    Chunks of ``s.chunk`` images on ``threads`` threads (4 chunks per thread in flight, in order),
    images already in memory, until ``target_images``."""

    from PIL import Image

    pairs = load_pairs(s.files)
    t = _Tok(s.tokenizer_dir)
    t.load()

    def decode(chunk):
        n = 0
        for data, _ in chunk:
            im = Image.open(io.BytesIO(data)).convert("RGB")
            n += im.width > 0
        return n

    def work(chunk):
        enc = t._tok.encode_batch_fast([c for _, c in chunk], add_special_tokens=False)
        n = 0
        for (data, _), e in zip(chunk, enc):
            patches, grid = preprocess(data, s)
            layout(e.ids, grid, t, s.merge_size)
            n += 1
        return n

    fn = decode if what == "decode" else work
    chunks = [pairs[i : i + s.chunk] for i in range(0, len(pairs), s.chunk)]
    fn(chunks[0])  # warm
    from benchmarks.common import run_chunks

    total, dt, cpu_s = run_chunks(fn, chunks, threads, target_images, cpu)
    return {
        "images": total,
        "seconds": dt,
        "images_per_s": total / dt,
        "cpu_ms_per_image": 1000 * cpu_s / total if cpu_s is not None else None,
    }
