"""Run the notebooks headless, top to bottom, and write their outputs into the committed .ipynb files.

    .venv/bin/python scripts/run_notebooks.py                  # every notebook, outputs written in place
    .venv/bin/python scripts/run_notebooks.py 01_quickstart    # one (or a few) by name
    .venv/bin/python scripts/run_notebooks.py --check          # execute, compare with the committed outputs

Needs the notebook extra (``pip install -e ".[notebook]"``, or ``.[dev]``). Each notebook runs on a
``python3`` kernel that is this interpreter, in a scratch working directory and ``TMPDIR`` (removed
afterwards). ``tests/system/test_notebooks.py`` executes them the same way and fails when the
outputs differ from the committed ones beyond volatile fields (temporary paths, timings, object
addresses, image bytes): rerun this script and commit the notebooks when it does. The outputs
carry no machine paths: the scratch folder, the package, the checkout, the venv and the home
folder are written ``<tmp>``, ``<zephon>``, ``<repo>``, ``<venv>`` and ``~`` (``scrub``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import sys
import tempfile
import time
from typing import Any

import nbclient
import nbformat

import zephon

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
CELL_TIMEOUT_S = 300
_PROBE = "import sys as _zephon_probe_sys; print(_zephon_probe_sys.executable)"

#: what changes from run to run and is masked before outputs are compared
VOLATILE = [
    # where the checkout (or the installed package) lives: the bundled tokenizer's path is printed
    (re.compile(r"[^\s'\"]*/zephon/data/assets"), "<zephon>/data/assets"),
    # a recipe's fingerprint names its files (under the run's temporary folder), and a state digest binds it
    (re.compile(r"((fingerprint|digest)[\"']?\s*[:=]?\s*[\"']?)[0-9a-f]{8,}"), r"\1<hex>"),
    (re.compile(r"((/private)?/(tmp|var/folders)|<tmp>)/[^\s'\"),\]}]*"), "<tmp>"),
    (re.compile(r"0x[0-9a-fA-F]{6,}"), "0x<addr>"),
    (re.compile(r"\d[\d,]*\.\d+"), "<float>"),
    (re.compile(r"\d[\d,]*(?= ?(s|ms|µs|items/s|/s|rows/s|docs/s|MB/s|GB/s)\b)"), "<int>"),
    # items a node produced by the time metrics are read: prefetch threads may have run further
    (re.compile(r"(\bitems +)\d+"), r"\1<n>"),
    (re.compile(r"(\(prefetch included\): .*?: )\d+"), r"\1<n>"),
    (re.compile(r" {2,}"), " "),  # the padding of masked numbers in aligned columns
]
_IMAGES = ("image/png", "image/jpeg", "image/svg+xml")
_REPO = pathlib.Path(__file__).resolve().parents[1]


def machine_paths(scratch: str) -> list[tuple[str, str]]:
    """This machine's folders as they may appear in outputs, longest first, and what stands for
    them in the committed notebooks (which carry no machine paths)."""
    pairs = {
        scratch: "<tmp>",
        os.path.realpath(scratch): "<tmp>",
        os.path.dirname(os.path.abspath(zephon.__file__)): "<zephon>",
        str(_REPO): "<repo>",
        sys.prefix: "<venv>",
        os.path.expanduser("~"): "~",
    }
    return sorted(((k, v) for k, v in pairs.items() if len(k) > 1), key=lambda kv: -len(kv[0]))


def scrub(nb: Any, paths: list[tuple[str, str]]) -> None:
    """Replace this machine's folders in every text output by their placeholders (in place)."""

    def clean(text: str) -> str:
        for path, name in paths:
            text = text.replace(path, name)
        return text

    def clean_any(value: Any) -> Any:
        return (
            clean(value) if isinstance(value, str) else [clean(v) for v in value] if isinstance(value, list) else value
        )

    for cell in nb.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            for key in ("text", "evalue", "traceback"):
                if key in out:
                    out[key] = clean_any(out[key])
            for mime, body in out.get("data", {}).items():
                if mime not in _IMAGES:
                    out["data"][mime] = clean_any(body)


def _kernel_env(scratch: str) -> dict[str, str | None]:
    """Point TMPDIR, the zephon cache and a ``python3`` kernelspec (this interpreter) into scratch."""
    old = {k: os.environ.get(k) for k in ("TMPDIR", "MPLBACKEND", "ZEPHON_CACHE_DIR", "JUPYTER_PATH")}
    os.environ["TMPDIR"] = scratch
    os.environ["ZEPHON_CACHE_DIR"] = os.path.join(scratch, "zephon-cache")
    spec_dir = os.path.join(scratch, "jupyter", "kernels", "python3")
    os.makedirs(spec_dir)
    with open(os.path.join(spec_dir, "kernel.json"), "w") as f:
        json.dump(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "Python 3 (ipykernel)",
                "language": "python",
            },
            f,
        )
    os.environ["JUPYTER_PATH"] = os.pathsep.join(
        p for p in (os.path.join(scratch, "jupyter"), old["JUPYTER_PATH"]) if p
    )
    os.environ.pop("MPLBACKEND", None)  # the kernel's inline backend, as a user would have
    return old


def execute(ipynb: pathlib.Path) -> tuple[Any, float]:
    """The notebook executed (outputs, execution counts from 1) and the seconds it took.

    Raises ``nbclient.exceptions.CellExecutionError`` on a failing cell, ``RuntimeError`` when the
    kernel ran another interpreter than this one."""
    nb = nbformat.read(ipynb, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell(_PROBE))
    # a short path: forkserver puts a unix socket under TMPDIR (108-byte limit)
    scratch = tempfile.mkdtemp(prefix="znb-")
    cwd = os.path.join(scratch, "cwd")
    os.makedirs(cwd)
    old = _kernel_env(scratch)
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=CELL_TIMEOUT_S, record_timing=False, resources={"metadata": {"path": cwd}}
    )
    t0 = time.monotonic()
    try:
        client.execute()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    elapsed = time.monotonic() - t0
    scrub(nb, machine_paths(scratch))
    probe = "".join(o.get("text", "") for o in nb.cells.pop(0).outputs).strip()
    probe = probe.replace("<venv>", sys.prefix).replace("<repo>", str(_REPO))
    if os.path.abspath(probe) != os.path.abspath(sys.executable):
        raise RuntimeError(f"the python3 kernel ran {probe!r}, not this interpreter {sys.executable!r}")
    count = 0
    for cell in nb.cells:
        if cell.cell_type == "code":
            count += 1
            cell.execution_count = count
            for out in cell.outputs:
                if "execution_count" in out:
                    out["execution_count"] = count
    return nb, elapsed


def _mask(text: str) -> str:
    for pattern, repl in VOLATILE:
        text = pattern.sub(repl, text)
    return text


def normalized(nb: Any) -> list[list[tuple[str, str]]]:
    """Per code cell, its outputs as (kind, text) with the volatile fields masked; images by kind only."""
    out = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        items: list[tuple[str, str]] = []
        for o in cell.get("outputs", []):
            kind = o.get("output_type", "")
            if kind == "stream":  # how a stream is cut into outputs depends on timing: join them
                name = f"stream:{o.get('name')}"
                if items and items[-1][0] == name:
                    items[-1] = (name, items[-1][1] + o.get("text", ""))
                else:
                    items.append((name, o.get("text", "")))
            elif kind == "error":
                items.append(("error", f"{o.get('ename')}: {o.get('evalue')}"))
            else:
                data = o.get("data", {})
                for mime in sorted(data):
                    body = data[mime]
                    text = "" if mime in _IMAGES else body if isinstance(body, str) else "".join(body)
                    items.append((mime, text))
        out.append([(k, _mask(t)) for k, t in items])
    return out


def differences(committed: Any, fresh: Any) -> list[str]:
    """Where the fresh outputs differ from the committed ones (volatile fields masked)."""
    a, b = normalized(committed), normalized(fresh)
    if len(a) != len(b):
        return [f"{len(a)} code cells committed, {len(b)} executed"]
    out = []
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            out.append(f"code cell {i + 1}: committed {x!r:.300} != executed {y!r:.300}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="notebooks to run (e.g. 01_quickstart); default: all of notebooks/")
    ap.add_argument("--check", action="store_true", help="compare with the committed outputs instead of writing them")
    args = ap.parse_args(argv)
    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    if args.names:
        paths = [p for p in paths if p.stem in args.names or p.name in args.names]
        if not paths:
            ap.error(f"no notebook named {args.names} in {NOTEBOOKS}")
    failed = 0
    for path in paths:
        print(f"{path.name}: running ...", end=" ", flush=True)
        nb, seconds = execute(path)
        if args.check:
            diff = differences(nbformat.read(path, as_version=4), nb)
            failed += bool(diff)
            print(f"{seconds:.0f} s, " + ("outputs as committed" if not diff else "DIFFERENT:\n  " + "\n  ".join(diff)))
        else:
            nbformat.write(nb, path)
            print(f"{seconds:.0f} s, outputs written to {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
