"""Every notebook executes top to bottom, and each .ipynb is in sync with its jupytext .py pair.

The kernel is ``python3``, run by this interpreter (``sys.executable``): the test puts a
``python3`` kernelspec naming it first on ``JUPYTER_PATH``, so a user-level spec pointing at
another Python cannot take over, and it checks by asking the kernel for ``sys.executable``.
Each notebook runs with its working directory and ``TMPDIR`` in scratch folders.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import sys
import tempfile
import time

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
jupytext = pytest.importorskip("jupytext")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
IPYNBS = sorted(NOTEBOOKS.glob("*.ipynb"))
CELL_TIMEOUT_S = 300

# prepended to the executed copy only: which interpreter runs the kernel
_PROBE = "import sys as _zephon_probe_sys; print(_zephon_probe_sys.executable)"


def test_there_are_notebooks():
    names = [p.stem for p in IPYNBS]
    for expected in (
        "01_quickstart",
        "02_writing_your_own_node",
        "03_mixtures_and_curricula",
        "04_elastic_determinism",
        "05_vision_language",
        "06_chat_sft",
    ):
        assert expected in names, f"notebooks/{expected}.ipynb is missing"


def _cells(nb):
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


@pytest.mark.parametrize("ipynb", IPYNBS, ids=[p.stem for p in IPYNBS])
def test_ipynb_is_paired_and_in_sync(ipynb):
    py = ipynb.with_suffix(".py")
    assert py.exists(), f"{ipynb.name} has no jupytext pair {py.name}"
    nb_ipynb = jupytext.read(ipynb)
    nb_py = jupytext.read(py)
    assert _cells(nb_ipynb) == _cells(nb_py), (
        f"{ipynb.name} and {py.name} differ; edit the .py and run `jupytext --sync notebooks/{py.name}`"
    )
    formats = nb_ipynb.metadata.get("jupytext", {}).get("formats", "")
    assert "ipynb" in formats and "py:percent" in formats, f"{ipynb.name} is not paired (jupytext formats: {formats!r})"
    raw = nbformat.read(ipynb, as_version=4)
    for cell in raw.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{ipynb.name}: commit it with outputs stripped"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("ipynb", IPYNBS, ids=[p.stem for p in IPYNBS])
def test_notebook_executes(ipynb, tmp_path):
    nb = nbformat.read(ipynb, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell(_PROBE))
    env_cwd = tmp_path / "cwd"  # the kernel's working directory
    env_cwd.mkdir()
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(env_cwd)}},
    )
    old = {k: os.environ.get(k) for k in ("TMPDIR", "MPLBACKEND", "ZEPHON_CACHE_DIR", "JUPYTER_PATH")}
    # what the notebook (or a library) writes to a temp dir goes to a fresh folder removed
    # afterwards; a short path, because forkserver puts a unix socket there (108-byte limit)
    scratch = tempfile.mkdtemp(prefix="znb-")
    try:
        os.environ["TMPDIR"] = scratch
        os.environ["ZEPHON_CACHE_DIR"] = os.path.join(scratch, "zephon-cache")
        # a "python3" kernelspec that runs this interpreter, found before any user-level spec
        # (JUPYTER_PATH comes first in the kernelspec search path)
        spec_dir = os.path.join(scratch, "jupyter", "kernels", "python3")
        os.makedirs(spec_dir)
        with open(os.path.join(spec_dir, "kernel.json"), "w") as f:
            json.dump(
                {
                    "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                    "display_name": "Python 3 (zephon tests)",
                    "language": "python",
                },
                f,
            )
        os.environ["JUPYTER_PATH"] = os.pathsep.join(
            p for p in (os.path.join(scratch, "jupyter"), old["JUPYTER_PATH"]) if p
        )
        os.environ.pop("MPLBACKEND", None)  # the kernel's inline backend, as a user would have
        t0 = time.monotonic()
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"{ipynb.name} failed:\n{e}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    elapsed = time.monotonic() - t0
    probe = "".join(o.get("text", "") for o in nb.cells[0].outputs).strip()
    assert os.path.abspath(probe) == os.path.abspath(sys.executable), (
        f"the python3 kernel ran {probe!r}, not this interpreter {sys.executable!r}"
    )
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            assert out.get("output_type") != "error", f"{ipynb.name} cell {i}: {out.get('ename')}: {out.get('evalue')}"
    assert elapsed < 120, f"{ipynb.name} took {elapsed:.0f} s; notebooks must run in well under two minutes"
    print(f"{ipynb.name}: {elapsed:.1f} s")
