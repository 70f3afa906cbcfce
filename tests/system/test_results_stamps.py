"""Every results file says which commit, machine and command made it (issue #34: the headline
tables were made at an old commit and nothing said so).

A JSON results file carries a ``"stamp"`` (benchmarks/stamp.py: commit, machine with its cores and
load, command), a Markdown report a stamp line under its title, and a plot the stamp of the JSON
beside it. Files made before stamps carry the commit that added them, marked ``from: git history``.
The check covers every file under benchmarks/results/ and docs/img/, and every results file that the
README, benchmarks/README.md or a docs page cites (a cited file that does not exist fails too).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("stamp", ROOT / "benchmarks" / "stamp.py")
assert _spec is not None and _spec.loader is not None
stamps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stamps)

RESULTS = (ROOT / "benchmarks" / "results", ROOT / "docs" / "img")
CITED = re.compile(r"(?:benchmarks/results|docs/img|(?<![\w/])img)/[\w.{},*-]+\.(?:json|md|png|\{[\w,]+\})")
COMMIT = re.compile(r"^[0-9a-f]{7,40}$")


def json_problems(path: Path) -> list[str]:
    """What a results JSON's stamp lacks (empty: it is complete)."""
    try:
        st = json.loads(path.read_text(encoding="utf-8")).get("stamp")
    except (ValueError, AttributeError) as e:
        return [f"not a JSON object ({e})"]
    if not isinstance(st, dict):
        return ['no "stamp" (run it through benchmarks/stamp.py: stamp_files, or --from-history)']
    out = []
    if not COMMIT.match(str(st.get("commit", ""))):
        out.append(f"stamp.commit is not a commit: {st.get('commit')!r}")
    if not isinstance(st.get("command"), str) or not st["command"].strip():
        out.append("stamp.command is missing")
    machine = st.get("machine")
    if not isinstance(machine, dict) or not {"cores", "loadavg_start"} <= set(machine):
        out.append("stamp.machine lacks cores or loadavg_start")
    if st.get("from") != "run" and not str(st.get("from", "")).startswith("git history"):
        out.append(f"stamp.from must be 'run' or 'git history: ...', got {st.get('from')!r}")
    return out


def file_problems(path: Path) -> list[str]:
    if path.suffix == ".json":
        return json_problems(path)
    if path.suffix == ".md":
        if any(stamps.STAMP_LINE.match(line) for line in path.read_text(encoding="utf-8").splitlines()[:5]):
            return []
        return ["no stamp line under its title (benchmarks/stamp.py: stamp_files)"]
    twin = path.with_suffix(".json")
    if not twin.exists():
        return [f"a {path.suffix} with no {twin.name} beside it to carry its stamp"]
    return [f"{twin.name}: {p}" for p in json_problems(twin)]


def _expand(cited: str) -> list[str]:
    """``a/{x,y}_s.{md,png}`` -> the four paths (the README's shorthand)."""
    parts = re.split(r"(\{[^}]*\})", cited)
    choices = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
    return ["".join(c) for c in itertools.product(*choices)]


def cited_files() -> dict[Path, str]:
    """Results files cited by the README, benchmarks/README.md and the docs pages: path -> where."""
    pages = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    out: dict[Path, str] = {}
    for page in pages:
        if not page.exists():
            continue
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for m in CITED.finditer(line):
                for cited in _expand(m.group(0)):
                    if "*" in cited:
                        continue
                    base = page.parent if cited.startswith("img/") else ROOT
                    out.setdefault((base / cited).resolve(), f"{page.relative_to(ROOT)}:{n}")
    return out


def test_every_results_file_is_stamped():
    bad = [
        f"{path.relative_to(ROOT)}: {p}"
        for folder in RESULTS
        for path in sorted(folder.glob("*"))
        if path.suffix in (".json", ".md") or (path.suffix == ".png" and folder.name == "img")
        for p in file_problems(path)
    ]
    assert not bad, "results files without the commit, machine and command that made them:\n" + "\n".join(bad)


def test_every_cited_results_file_exists_and_is_stamped():
    cited = cited_files()
    assert cited, "the README cites no results file: has the pattern changed?"
    bad = []
    for path, where in sorted(cited.items()):
        if not path.exists():
            bad.append(f"{where} cites {path.relative_to(ROOT)}, which does not exist")
        else:
            bad += [f"{where} cites {path.relative_to(ROOT)}: {p}" for p in file_problems(path)]
    assert not bad, "\n".join(bad)


def test_the_check_fails_on_an_unstamped_file(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps({"rows": []}))
    (tmp_path / "r.md").write_text("# Results\n\n| a |\n")
    assert json_problems(tmp_path / "r.json") and file_problems(tmp_path / "r.md")
    assert file_problems(tmp_path / "q.png") == ["a .png with no q.json beside it to carry its stamp"]
    stamps.stamp_files(str(tmp_path / "r.json"), str(tmp_path / "r.md"), command="python bench.py --x")
    assert json_problems(tmp_path / "r.json") == [] and file_problems(tmp_path / "r.md") == []
    st = json.loads((tmp_path / "r.json").read_text())["stamp"]
    assert st["command"] == "python bench.py --x" and st["from"] == "run" and st["machine"]["cores"]
    assert (tmp_path / "r.md").read_text().splitlines()[0] == "# Results"  # the stamp goes under the title
    assert file_problems(tmp_path / "r.png") == []  # a plot is stamped by its JSON
    assert _expand("benchmarks/results/{text,vision}_small.{md,png}")[1] == "benchmarks/results/text_small.png"
