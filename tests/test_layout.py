"""The package layout the client asked for: engine core never imports the operator library."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
CORE = ["node.py", "mapper.py", "accumulator.py", "lanes.py", "checkpoint.py", "workers.py", "seeding.py", "permute.py"]


def test_core_never_imports_nodes():
    for name in CORE:
        tree = ast.parse((ROOT / "zephon" / name).read_text())
        for node in ast.walk(tree):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [("." * node.level) + (node.module or "")]
            for m in mods:
                assert "nodes" not in m.replace("torchdata.nodes", ""), f"zephon/{name} imports {m}"


def test_nodes_is_only_zephon_nodes():
    code = "import importlib.util, zephon.nodes; print(importlib.util.find_spec('nodes'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    assert out.stdout.strip() == "None"


def test_import_zephon_does_not_import_torchtitan():
    code = "import sys, zephon, zephon.nodes; print('torchtitan' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    assert out.stdout.strip() == "False"


def test_regular_wheel_ships_nodes_only_as_zephon_nodes(tmp_path):
    import zipfile

    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", str(ROOT), "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path)], check=True, capture_output=True)
    (whl,) = tmp_path.glob("zephon-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    assert not [n for n in names if n.startswith("nodes/")]
    for needed in ("zephon/nodes/pack.py", "zephon/nodes/__init__.py", "zephon/assets/tokenizer/tokenizer.json",
                   "zephon/datasets/index.py"):
        assert needed in names, needed
