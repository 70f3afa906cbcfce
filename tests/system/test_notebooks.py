"""Every notebook executes top to bottom, its committed outputs are what it prints now, and each
.ipynb is in sync with its jupytext .py pair.

Execution is ``scripts/run_notebooks.py``'s (the headless command that writes the committed
outputs): the kernel is ``python3``, run by this interpreter (a ``python3`` kernelspec naming it
first on ``JUPYTER_PATH``, checked by asking the kernel for ``sys.executable``), with its working
directory and ``TMPDIR`` in scratch folders. Outputs are compared with the volatile fields masked
(temporary paths, timings, addresses, image bytes); when they differ, rerun the script.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
jupytext = pytest.importorskip("jupytext")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
IPYNBS = sorted(NOTEBOOKS.glob("*.ipynb"))
_spec = importlib.util.spec_from_file_location("run_notebooks", ROOT / "scripts" / "run_notebooks.py")
assert _spec is not None and _spec.loader is not None
runner = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runner)


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
    code = [c for c in raw.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), (
        f"{ipynb.name} is not committed executed top to bottom: run `python scripts/run_notebooks.py {ipynb.stem}`"
    )
    assert any(c.outputs for c in code), f"{ipynb.name} has no outputs: run `python scripts/run_notebooks.py`"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("ipynb", IPYNBS, ids=[p.stem for p in IPYNBS])
def test_notebook_executes_and_its_outputs_are_committed(ipynb):
    try:
        nb, elapsed = runner.execute(ipynb)
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"{ipynb.name} failed:\n{e}")
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            assert out.get("output_type") != "error", f"{ipynb.name} cell {i}: {out.get('ename')}: {out.get('evalue')}"
            assert "IProgress not found" not in str(out.get("text", "")), (
                f"{ipynb.name} cell {i}: tqdm's IProgress warning"
            )
    diff = runner.differences(nbformat.read(ipynb, as_version=4), nb)
    assert not diff, (
        f"{ipynb.name}: the committed outputs are not what it prints now; run `python scripts/run_notebooks.py "
        f"{ipynb.stem}` and commit it:\n" + "\n".join(diff)
    )
    assert elapsed < 240, f"{ipynb.name} took {elapsed:.0f} s; notebooks must run in about two minutes"
    print(f"{ipynb.name}: {elapsed:.1f} s")


def test_volatile_fields_are_masked_and_the_rest_compared():
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("x")
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="/tmp/znb-ab12/x.toml 1.25 s\nhash 9f\n")]
    nb.cells = [cell]
    other = nbformat.from_dict(nbformat.v4.new_notebook())
    cell2 = nbformat.v4.new_code_cell("x")
    cell2.outputs = [
        nbformat.v4.new_output("stream", name="stdout", text="/tmp/znb-zz99/x.toml 3.5 s\n"),
        nbformat.v4.new_output("stream", name="stdout", text="hash 9f\n"),
    ]
    other.cells = [cell2]
    assert runner.differences(nb, other) == []
    cell2.outputs[1]["text"] = "hash 00\n"
    assert runner.differences(nb, other)


def test_machine_paths_are_scrubbed_from_outputs():
    """The scratch folder, the package and the checkout are written as placeholders, so a committed
    notebook carries no machine paths, and the committed and a fresh run still compare equal."""
    scratch = "/tmp/znb-ab12"
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("x")
    pkg = str(pathlib.Path(runner.zephon.__file__).parent)
    cell.outputs = [
        nbformat.v4.new_output("stream", name="stdout", text=f"{scratch}/demo-x1/demo.toml\n{pkg}/data/assets\n"),
        nbformat.v4.new_output("display_data", data={"text/html": f"<code>{scratch}/demo-x1/web</code>"}),
    ]
    nb.cells = [cell]
    runner.scrub(nb, runner.machine_paths(scratch))
    assert cell.outputs[0]["text"] == "<tmp>/demo-x1/demo.toml\n<zephon>/data/assets\n"
    assert cell.outputs[1]["data"]["text/html"] == "<code><tmp>/demo-x1/web</code>"
    fresh = nbformat.v4.new_notebook()
    cell2 = nbformat.v4.new_code_cell("x")
    cell2.outputs = [
        nbformat.v4.new_output("stream", name="stdout", text="/tmp/znb-zz/demo-y2/demo.toml\n<zephon>/data/assets\n"),
        nbformat.v4.new_output("display_data", data={"text/html": "<code><tmp>/demo-y2/web</code>"}),
    ]
    fresh.cells = [cell2]
    assert runner.differences(nb, fresh) == []
