"""A newcomer's install: setup stops on a failed install and names it, nothing is installed
system-wide unless asked, ``zephon --version``, and committed notebooks carry no machine paths.

The base install itself (``pip install .`` without extras, then ``import zephon`` and ``zephon
demo``) is checked by scripts/base_check.sh, a part of the test command (scripts/test.sh).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import zephon
from zephon.tools.cli import DISTRIBUTION, version_line

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def _fake_venv(tmp_path: Path, failing: str) -> Path:
    """A copy of scripts/setup.sh beside a fake .venv whose pip fails on any install naming
    ``failing`` (and torch is absent, so setup.sh tries to install it)."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    python = bin_dir / "python"
    python.write_text(
        "#!/usr/bin/env bash\n"
        '[ "$1" = -c ] && exit 1\n'  # import torch / zephon: not installed
        '[ "$3" = show ] && exit 1\n'  # pip show zephon: not there
        f'for a in "$@"; do case "$a" in *{failing}*) echo "ERROR: no matching distribution for $a" >&2; exit 1;; esac; done\n'
        "exit 0\n"
    )
    python.chmod(0o755)
    return tmp_path


def _setup(repo: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    return subprocess.run(["bash", str(repo / "scripts" / "setup.sh")], capture_output=True, text=True, env=env)


def test_setup_stops_on_a_failed_torch_install_and_says_so(tmp_path):
    run = _setup(_fake_venv(tmp_path, "torch=="))
    assert run.returncode != 0, f"setup.sh went on after torch failed to install:\n{run.stderr}"
    assert "could not install torch 2.13.0" in run.stderr
    assert "no matching distribution" in run.stderr  # pip's own words are shown


def test_setup_stops_on_a_failed_zephon_install_and_says_so(tmp_path):
    run = _setup(_fake_venv(tmp_path, "-e"))
    assert run.returncode != 0, f"setup.sh went on after zephon failed to install:\n{run.stderr}"
    assert "could not install zephon" in run.stderr


def test_the_test_command_installs_nothing_system_wide_unless_asked():
    """apt-get (Chromium for the browser test) runs only under ZEPHON_INSTALL_CHROMIUM=1."""
    lines = (ROOT / "scripts" / "test.sh").read_text().splitlines()
    guarded = False
    for line in lines:
        if "ZEPHON_INSTALL_CHROMIUM" in line and line.lstrip().startswith("elif"):
            guarded = True
        elif re.match(r"\s*(elif|else|fi)\b", line):
            guarded = False
        if "apt-get install" in line and not line.lstrip().startswith("#"):
            assert guarded, f"scripts/test.sh runs apt-get without ZEPHON_INSTALL_CHROMIUM=1: {line.strip()}"
    runs_apt = re.compile(r"(^\s*|[;&|(]\s*)(sudo\s+)?apt-get\s", re.M)
    for script in sorted((ROOT / "scripts").glob("*.sh")):
        if script.name != "test.sh":
            assert not runs_apt.search(script.read_text()), f"{script.name} installs system packages"


def test_version_flag_prints_the_installed_version():
    run = subprocess.run([sys.executable, "-m", "zephon", "--version"], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"zephon {zephon.__version__}" == version_line()


def test_the_distribution_name_is_ours():
    """``zephon`` on the package index is another project: ours is published under another name,
    no code asks for the other one's metadata, and no documented command installs it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == DISTRIBUTION != "zephon"
    asks = re.compile(r"""(version|distribution|metadata|files|requires)\(\s*["']zephon["']""")
    for path in sorted([*(ROOT / "zephon").rglob("*.py"), *(ROOT / "nodes").rglob("*.py")]):
        assert not asks.search(path.read_text()), (
            f"{path.relative_to(ROOT)} reads the metadata of distribution 'zephon'"
        )
    pattern = re.compile(r"pip install[^\n`#]*?(?<![\w./-])[\"']?zephon(\[[^\]]*\])?[\"']?(?=[\s`]|$)", re.M)
    bad = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "notebooks").glob("*"))]:
        if path.is_file():
            text = path.read_text(errors="replace")
            for m in pattern.finditer(text):
                before = text[text.rfind("\n", 0, m.start()) + 1 : m.start()]
                if not re.search(r"\bnever\b|\bnot\b", before):  # "never `pip install zephon`" warns
                    bad.append(f"{path.relative_to(ROOT)}: {m.group(0)}")
    assert not bad, "documented commands install the other project named zephon:\n" + "\n".join(bad)


#: the roots of machine paths (absolute folders of a developer's or CI's machine)
MACHINE_PATH = re.compile(r"(?<![\w.~<>-])/(home|root|work|tmp|Users|private|var|opt|mnt|srv|scratch|nfs)/[\w.-]")


def test_committed_notebook_outputs_carry_no_machine_paths():
    bad = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            for out in cell.get("outputs", []):
                texts = [out.get("text", "")] + [
                    v for k, v in out.get("data", {}).items() if not k.startswith("image/")
                ]
                texts += [out.get("evalue", ""), out.get("traceback", "")]
                text = "".join("".join(t) if isinstance(t, list) else str(t) for t in texts)
                bad += [
                    f"{path.name} cell {i}: ...{text[max(0, m.start() - 40) : m.end() + 40]}..."
                    for m in MACHINE_PATH.finditer(text)
                ]
    assert not bad, (
        "committed notebook outputs show machine paths; rerun `python scripts/run_notebooks.py` (it scrubs them):\n"
        + "\n".join(bad[:20])
    )


def test_every_package_folder_is_in_the_distribution():
    """A folder with an ``__init__.py`` under zephon/ or nodes/ that pyproject.toml does not list is
    left out of a (non-editable) install: the base check would fail on a fresh clone."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = set()
    for name, folder in cfg["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *rel)))
    assert found - listed == set(), f"packages missing from pyproject.toml [tool.setuptools] packages: {found - listed}"
