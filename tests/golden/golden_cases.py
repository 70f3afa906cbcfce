"""The golden cases: recipes whose batches must never change silently.

``python tests/golden/golden_cases.py --write N`` records data version N's goldens
(``golden.json`` for version 1, ``golden_vN.json`` after) and its checkpoints (under
``tests/golden/checkpoints/``, ``checkpoints/vN/`` after version 1); run it once, when version N
is declared: a version's goldens are never rewritten (a change that alters batches declares a
new data version, see ``zephon.recipe.DATA_VERSION``).
``tests/system/test_golden.py`` compares every case against what was recorded.

Each case is a corpus made by the synthetic generators (their files are hashed too, so a change of
the generators shows up as a corpus change, not as a batch change) and a recipe over it.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "support"))

from text_fixtures import write_corpus, write_recipe  # noqa: E402
from toml_writer import to_toml as toml_dumps  # noqa: E402
from vl_fixtures import vl_config, write_vl_root  # noqa: E402

from zephon.engine import WorkerConfig  # noqa: E402
from zephon.engine.checkpoint import decode_state, encode_state  # noqa: E402
from zephon.engine.digest import batch_sha256  # noqa: E402
from zephon.recipe import Recipe  # noqa: E402

GOLDEN = os.path.join(HERE, "golden.json")
CHECKPOINTS = os.path.join(HERE, "checkpoints")


def golden_path(version: int) -> str:
    """Where the goldens of a data version live: ``golden.json`` for version 1 (recorded at
    e426d1f, before data versions existed), ``golden_v2.json`` for version 2, ..."""
    return GOLDEN if version == 1 else os.path.join(HERE, f"golden_v{version}.json")


def checkpoints_dir(version: int) -> str:
    return CHECKPOINTS if version == 1 else os.path.join(CHECKPOINTS, f"v{version}")


def _demo(root: str) -> Recipe:
    from zephon.tools.demo import demo_recipe

    return demo_recipe(root, scale=0.02)


def _text_greedy(root: str) -> Recipe:
    write_corpus(root, scale=0.05)
    return Recipe.from_toml(write_recipe(root, buffer=8))


def _text_best_fit(root: str) -> Recipe:
    write_corpus(root, scale=0.05)
    extra = "[[schedule]]\nstep = 4\nweights = { web = 0.2, code = 0.6, books = 0.2 }\n"
    return Recipe.from_toml(write_recipe(root, algorithm="best_fit", buffer=16, extra=extra))


def _text_finite(root: str) -> Recipe:
    write_corpus(root, scale=0.02)
    stop = 'policy = "stop"\n'
    path = write_recipe(root, buffer=4, web_extra=stop, code_extra=stop, books_extra=stop)
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write('end = "pad"\n' + text)
    return Recipe.from_toml(path)


def _text_skips(root: str) -> Recipe:
    """Every third line of "web" lacks its text field (a bad record), skipped: from data version 5
    the estimate weighs those records' bytes with no tokens (the plan makes up for the skips)."""
    write_corpus(root, scale=0.05)
    for path in sorted(glob.glob(os.path.join(root, "web", "*.jsonl"))):
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
        for i in range(0, len(lines), 3):
            lines[i] = json.dumps({"body": json.loads(lines[i])["text"]})
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    return Recipe.from_toml(write_recipe(root, buffer=8, web_extra='on_error = "skip"\n'))


def _vl(root: str) -> Recipe:
    from pathlib import Path

    write_vl_root(Path(root), seed=11)
    path = os.path.join(root, "vl.toml")
    with open(path, "w") as f:
        f.write(toml_dumps(vl_config(root)))
    return Recipe.from_toml(path)


def _vl_chat(root: str) -> Recipe:
    """Conversations with images in three forms mixed with image-text, text chat and text, by the
    tokens trained on (data version 6: image tokens never count)."""
    from zephon.tools.vlchat_demo import write_vl_chat_recipe

    return Recipe.from_toml(write_vl_chat_recipe(root, conversations=24, count="loss"))


#: name -> (builder, steps, checkpoint step, world size the checkpoint is written on)
CASES: dict[str, tuple[Callable[[str], Recipe], int, int, int]] = {
    "demo": (_demo, 8, 3, 4),
    "text_greedy": (_text_greedy, 10, 4, 2),
    "text_best_fit_schedule": (_text_best_fit, 10, 5, 4),
    "text_finite_pad": (_text_finite, 400, 3, 2),
    "vl": (_vl, 6, 2, 2),
    "text_skips": (_text_skips, 10, 4, 2),
    "vl_chat": (_vl_chat, 8, 3, 4),
}

#: the first data version of a case added after version 1 (its goldens exist from that version on)
SINCE = {"text_skips": 5, "vl_chat": 6}


def cases(version: int) -> list[str]:
    """The cases recorded for ``version``, sorted."""
    return sorted(n for n in CASES if SINCE.get(n, 1) <= version)


FIXED_MTIME = 1_700_000_000  # every data file gets this mtime: the checkpoints record files by size and mtime


def settle(root: str) -> None:
    """Give every file under root one fixed mtime, so a checkpoint recorded once resumes on a fresh corpus."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            os.utime(os.path.join(dirpath, name), (FIXED_MTIME, FIXED_MTIME))


def build_case(name: str, root: str, data_version: int | None = 1) -> Recipe:
    """The case's corpus under root (mtimes settled) and its recipe, pinned to the data version
    the goldens were recorded under (``None``: the recipe as written, i.e. the newest version)."""
    recipe = CASES[name][0](root)
    settle(root)
    return recipe if data_version is None else recipe.replace(data_version=data_version)


def corpus_digest(root: str) -> str:
    """SHA-256 over every data file under root (caches, recipes and tokenizer folders excluded)."""
    h = hashlib.sha256()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("cache", "tok")]
        files += [os.path.join(dirpath, n) for n in filenames if not n.endswith((".toml", ".lock")) and n[0] != "."]
    for path in sorted(files):
        h.update(os.path.relpath(path, root).encode() + b"\0")
        with open(path, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def hashes(
    recipe: Recipe, steps: int, world: int = 1, workers: WorkerConfig | None = None, state: Any = None
) -> list[str]:
    """Global-batch SHA-256 of up to ``steps`` steps (fewer where a finite recipe ends)."""
    out = []
    with recipe.global_loader(world, workers=workers) as g:
        if state is not None:
            g.load_state_dict(state)
        for _ in range(steps):
            try:
                out.append(batch_sha256(next(g)))
            except StopIteration:
                break
    return out


def checkpoint(recipe: Recipe, at: int, world: int) -> dict[str, Any]:
    """The DCP-encoded state after ``at`` steps on ``world`` ranks (bytes as latin-1 text for JSON)."""
    with recipe.global_loader(world, workers=WorkerConfig(0)) as g:
        for _ in range(at):
            next(g)
        enc = encode_state(g.state_dict())
    return {k: v.decode("latin-1") for k, v in enc.items()}


def load_checkpoint(name: str, version: int = 1) -> dict[str, Any]:
    with open(os.path.join(checkpoints_dir(version), f"{name}.json")) as f:
        enc = json.load(f)
    return decode_state({k: v.encode("latin-1") for k, v in enc.items()})


#: the corpora live at one fixed place: a checkpoint names its shards by absolute path
ROOT = os.path.join("/tmp", f"zephon-golden-{os.getuid()}")


def case_root(name: str) -> str:
    """A fresh folder for the case's corpus (at the fixed place the checkpoints were written from)."""
    import shutil

    root = os.path.join(ROOT, name)
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    return root


def record(version: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    folder = checkpoints_dir(version)
    os.makedirs(folder, exist_ok=True)
    for name in cases(version):
        _build, steps, at, world = CASES[name]
        root = case_root(name)
        recipe = build_case(name, root, data_version=version)
        hs = hashes(recipe, steps, 1, WorkerConfig(0))
        out[name] = {"corpus": corpus_digest(root), "fingerprint": recipe.fingerprint, "hashes": hs}
        with open(os.path.join(folder, f"{name}.json"), "w") as f:
            json.dump(checkpoint(recipe, at, world), f, indent=1, sort_keys=True)
            f.write("\n")
        print(name, len(hs), "steps", hs[0][:12], file=sys.stderr)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--write" or not sys.argv[2].isdigit():
        sys.exit(
            "usage: python tests/golden/golden_cases.py --write VERSION  (a data version; never rewrite an old one)"
        )
    version = int(sys.argv[2])
    golden = record(version)
    with open(golden_path(version), "w") as f:
        json.dump(golden, f, indent=1, sort_keys=True)
        f.write("\n")
