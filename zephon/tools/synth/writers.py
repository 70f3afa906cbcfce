"""Writers: corpora on disk in every format zephon reads (JSONL, Parquet, text, WebDataset
tar), with reproducible bytes and atomic renames."""

from __future__ import annotations

import gzip
import io
import json
import os


def _atomic_target(path: str | os.PathLike) -> tuple[str, str]:
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    return path, path + f".tmp{os.getpid()}"


def write_jsonl(
    path: str | os.PathLike, docs: list[str], text_field: str = "text", compression: str | None = None
) -> str:
    """One JSON object per line: ``{text_field: doc, "id": i}``. ``compression``: None, "gz"
    (gzip, mtime 0 so the bytes are reproducible) or "zst" (zstandard).

    >>> import os, tempfile
    >>> path = write_jsonl(os.path.join(tempfile.mkdtemp(), "a.jsonl"), ["one", "two"])
    >>> open(path).read().splitlines()[1]
    '{"text": "two", "id": 1}'
    """
    path, tmp = _atomic_target(path)
    payload = "".join(
        json.dumps({text_field: d, "id": i}, ensure_ascii=False) + "\n" for i, d in enumerate(docs)
    ).encode("utf-8")
    if compression is None:
        data = payload
    elif compression in ("gz", "gzip"):
        buf = io.BytesIO()
        with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0) as g:
            g.write(payload)
        data = buf.getvalue()
    elif compression in ("zst", "zstd"):
        try:
            import zstandard
        except ImportError as e:  # pragma: no cover - zstandard is installed here
            raise ImportError("write_jsonl(compression='zst') needs the 'zstandard' package") from e
        data = zstandard.ZstdCompressor(level=3).compress(payload)
    else:
        raise ValueError(f"compression must be None, 'gz' or 'zst', got {compression!r}")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return path


def write_parquet(
    path: str | os.PathLike, docs: list[str], text_field: str = "text", row_group_size: int = 1000
) -> str:
    """A Parquet file with columns ``text_field`` (string) and ``id`` (int64), split into row
    groups of ``row_group_size`` rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path, tmp = _atomic_target(path)
    table = pa.table({text_field: pa.array(docs, type=pa.string()), "id": pa.array(range(len(docs)), type=pa.int64())})
    # page checksums: zephon verifies them on read, so a corrupted page is refused, not trained on
    pq.write_table(table, tmp, row_group_size=max(1, int(row_group_size)), write_page_checksum=True)
    os.replace(tmp, path)
    return path


def write_text_lines(path: str | os.PathLike, docs: list[str]) -> str:
    """One document per line; newlines (and carriage returns) inside a document become spaces."""
    path, tmp = _atomic_target(path)
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for d in docs:
            f.write(d.replace("\r\n", " ").replace("\n", " ").replace("\r", " "))
            f.write("\n")
    os.replace(tmp, path)
    return path


def write_text_files(directory: str | os.PathLike, docs: list[str], prefix: str = "doc") -> list[str]:
    """One UTF-8 file per document: ``{prefix}_{i:06d}.txt``. Returns the paths."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    paths = []
    for i, d in enumerate(docs):
        p = os.path.join(directory, f"{prefix}_{i:06d}.txt")
        with open(p, "w", encoding="utf-8", newline="") as f:
            f.write(d)
        paths.append(p)
    return paths


def write_wds(path: str | os.PathLike, samples: list[dict], caption: str = "txt", text_field: str = "caption") -> str:
    """A WebDataset-style tar: per sample ``{key}.{ext}`` (the image, if not None) and
    ``{key}.txt`` (or ``{key}.json`` with ``{text_field: caption}``; omitted if None).
    Reproducible bytes (mtime 0, uid 0)."""
    import tarfile

    path, tmp = _atomic_target(path)

    def add(tf, name: str, data: bytes) -> None:
        ti = tarfile.TarInfo(name)
        ti.size, ti.mtime, ti.mode, ti.uid, ti.gid, ti.uname, ti.gname = len(data), 0, 0o644, 0, 0, "", ""
        tf.addfile(ti, io.BytesIO(data))

    with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tf:
        for smp in samples:
            if smp.get("image") is not None:
                add(tf, f"{smp['key']}.{smp.get('ext', 'jpg')}", smp["image"])
            if smp.get("caption") is not None:
                if caption == "json":
                    add(tf, f"{smp['key']}.json", json.dumps({text_field: smp["caption"]}).encode())
                else:
                    add(tf, f"{smp['key']}.txt", smp["caption"].encode("utf-8"))
    os.replace(tmp, path)
    return path


def write_image_parquet(
    path: str | os.PathLike,
    samples: list[dict],
    image_field: str = "image",
    text_field: str = "caption",
    row_group_size: int = 64,
    hf_struct: bool = False,
) -> str:
    """Parquet with an image column (binary, or Hugging Face's ``{bytes, path}`` struct with
    ``hf_struct``) and a caption column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path, tmp = _atomic_target(path)
    imgs = [smp.get("image") for smp in samples]
    if hf_struct:
        col = pa.array(
            [None if b is None else {"bytes": b, "path": None} for b in imgs],
            type=pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
        )
    else:
        col = pa.array(imgs, type=pa.binary())
    table = pa.table(
        {image_field: col, text_field: pa.array([smp.get("caption") for smp in samples], type=pa.string())}
    )
    # page checksums: zephon verifies them on read, so a corrupted page is refused, not trained on
    pq.write_table(table, tmp, row_group_size=max(1, int(row_group_size)), write_page_checksum=True)
    os.replace(tmp, path)
    return path


def write_interleaved_parquet(path: str | os.PathLike, docs: list[dict], row_group_size: int = 32) -> str:
    """OBELICS-style Parquet: columns ``texts`` (list<string>) and ``images`` (list<binary>)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path, tmp = _atomic_target(path)
    table = pa.table(
        {
            "texts": pa.array([d["texts"] for d in docs], type=pa.list_(pa.string())),
            "images": pa.array([d["images"] for d in docs], type=pa.list_(pa.binary())),
        }
    )
    # page checksums: zephon verifies them on read, so a corrupted page is refused, not trained on
    pq.write_table(table, tmp, row_group_size=max(1, int(row_group_size)), write_page_checksum=True)
    os.replace(tmp, path)
    return path
