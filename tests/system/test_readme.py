"""The README's Python examples run as written."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_python_examples_run(tmp_path, monkeypatch):
    code = blocks()
    assert len(code) >= 2
    monkeypatch.chdir(tmp_path)
    for src in code:
        src = src.replace("/tmp/zephon-demo", str(tmp_path / "demo"))
        exec(compile(src, str(README), "exec"), {"__name__": "readme"})
