"""The batch ledger and ``zephon ledger``: what a run consumed, and how two runs compare.

Ledgers are written here the way the TorchTitan loader writes them (each rank hashes only its own
lanes, one file per rank, resumed runs append); ``tests/integrations/test_titan.py`` checks the
loader itself, in-process and in real trainer processes.
"""

from __future__ import annotations

import io
import json
import os

import pytest
from text_fixtures import write_corpus, write_recipe
from warm_process import run_zephon

from zephon import Recipe
from zephon.engine.checkpoint import decode_state, encode_state
from zephon.recipe.ledger import LedgerWriter, dataset_tokens
from zephon.tools.cli import run_hashes
from zephon.tools.ledger import read_ledger, run_ledger_show
from zephon.tools.ledger_diff import diff, recipe_differences

SCHEDULE = """
[[schedule]]
step = 4
weights = {{ web = {web}, code = 0.3, books = 0.2 }}
"""


def zephon(*args, timeout=300):
    return run_zephon(*args, timeout=timeout)  # a fresh process, without the 2-4 s of imports


@pytest.fixture(scope="module")
def recipes(tmp_path_factory):
    """Two recipes that differ in one weight: web's share from step 4 on."""
    root = tmp_path_factory.mktemp("ledger")
    write_corpus(str(root))
    a = write_recipe(str(root), "a.toml", buffer=1, extra=SCHEDULE.format(web=0.5))
    b = write_recipe(str(root), "b.toml", buffer=1, extra=SCHEDULE.format(web=0.8))
    # data version 2: the weight change shows in the batches by step 8 there (the work source plans
    # ahead of the batches), inside the 10 steps these tests write; under version 3's block order it
    # shows later
    for path in (a, b):
        with open(path) as f:
            text = f.read()
        with open(path, "w") as f:
            f.write("data_version = 2\n" + text)
    return a, b


def write_run(recipe, folder, W, steps, state=None):
    """``steps`` global batches on W ranks, each rank writing its own ledger file; the merged state after."""
    rpl, names = recipe.rows_per_lane, [d.name for d in recipe.datasets]
    routers = [recipe.router(W, r, digests=True) for r in range(W)]
    writers = [
        LedgerWriter(
            folder,
            rank=r,
            world_size=W,
            lane_range=rt.owned,
            lanes=recipe.lanes,
            recipe=os.path.join(recipe.base_dir, "a.toml"),
            fingerprint=recipe.fingerprint,
            datasets=names,
        )
        for r, rt in enumerate(routers)
    ]
    try:
        for rt in routers:
            if state is not None:
                rt.reset(state)
        for _ in range(steps):
            for rt, w in zip(routers, writers):
                b = next(rt)
                w.write(rt.step - 1, rt.last_lane_digests, dataset_tokens(b["dataset"], rpl, len(names)))
        from zephon.engine.checkpoint import merge_states

        return decode_state(encode_state(merge_states(rt.state_dict() for rt in routers)))
    finally:
        for rt, w in zip(routers, writers):
            rt.close()
            w.close()


def test_ledger_digests_equal_zephon_hashes_across_world_sizes_and_a_resume(recipes, tmp_path):
    a = Recipe.from_toml(recipes[0])
    state = write_run(a, str(tmp_path / "run"), 2, 5)
    write_run(a, str(tmp_path / "run"), 4, 3, state=state)  # resumed on W=4: appends to the same folder
    led = read_ledger(str(tmp_path / "run"))
    assert led.batches() == list(range(8)) and not led.conflicts and len(led.runs) == 6
    with open(tmp_path / "run" / "rank_00003.jsonl") as f:  # written only by the W=4 run
        assert json.loads(f.readline())["start_batch"] == 5
    show = zephon("ledger", "show", tmp_path / "run")
    assert show.returncode == 0, show.stderr
    hashes = zephon("hashes", recipes[0], "--steps", 8, "--world-size", 8, "--digest", "ledger")
    assert hashes.returncode == 0, hashes.stderr
    assert show.stdout == hashes.stdout and show.stdout.count("\n") == 8
    # the ledger digest is not the global-batch sha256 (it is computed from per-lane digests)
    assert zephon("hashes", recipes[0], "--steps", 1).stdout.split()[2] != hashes.stdout.split()[2]


def test_ledger_diff_names_the_first_differing_step_and_the_dataset(recipes, tmp_path):
    a, b = Recipe.from_toml(recipes[0]), Recipe.from_toml(recipes[1])
    ha = run_hashes(a, steps=10, out=io.StringIO())
    hb = run_hashes(b, steps=10, out=io.StringIO())
    first = next(t for t in range(10) if ha[t] != hb[t])
    assert first > 0  # the recipes share their first phase
    write_run(a, str(tmp_path / "a"), 2, 10)
    out = zephon("ledger", "diff", tmp_path / "a", recipes[1])
    assert out.returncode == 1, out.stdout + out.stderr
    text = out.stdout
    assert f"first differing global batch: {first} (trainer step {first + 1})" in text
    assert "recipe difference: schedule.4.web: 0.5 -> 0.8" in text
    diff_lines = [l for l in text.splitlines() if l.startswith("datasets that differ:")]
    assert diff_lines and "web" in diff_lines[0]
    assert "only in A: " in text and "only in B: " in text and ".jsonl line " in text  # documents, by file and line
    assert f"global batches compared: 10, {sum(x != y for x, y in zip(ha, hb))} differ" in text
    # the same run against its own recipe: identical, exit 0
    same = zephon("ledger", "diff", tmp_path / "a", recipes[0])
    assert same.returncode == 0 and "global batches compared: 10, identical" in same.stdout, same.stdout
    # two recipes, compared on this machine
    two = zephon("ledger", "diff", recipes[0], recipes[1], "--steps", 10)
    assert two.returncode == 1 and f"first differing global batch: {first}" in two.stdout


def test_two_ledgers_and_the_recipe_each_names(recipes, tmp_path):
    a, b = Recipe.from_toml(recipes[0]), Recipe.from_toml(recipes[1])
    write_run(a, str(tmp_path / "a"), 4, 10)
    write_run(b, str(tmp_path / "b"), 1, 10)
    d = diff(read_ledger(str(tmp_path / "a")), read_ledger(str(tmp_path / "b")))
    assert d.first is not None and d.first > 0 and "web" in d.datasets and d.compared == 10
    # the ledger of b names a.toml in this helper, so its documents are those of the wrong recipe: the
    # fingerprint check refuses that recipe, and the diff says so instead of naming documents
    assert any("no recipe for B" in l for l in d.lines)
    d2 = diff(read_ledger(str(tmp_path / "a")), read_ledger(str(tmp_path / "b")), recipe_b=recipes[1])
    assert any(l.startswith("    only in B: ") for l in d2.lines)


def test_a_step_redone_with_other_data_is_reported(recipes, tmp_path):
    a, b = Recipe.from_toml(recipes[0]), Recipe.from_toml(recipes[1])
    write_run(a, str(tmp_path / "run"), 2, 10)
    write_run(b, str(tmp_path / "run"), 2, 10)  # "resumed" from the start with other data
    err = io.StringIO()
    run_ledger_show(str(tmp_path / "run"), out=io.StringIO(), err=err)
    assert "recorded twice with different data" in err.getvalue()
    assert "2 different recipes" in err.getvalue()


def test_errors_and_recipe_differences(recipes, tmp_path):
    out = zephon("ledger", "show", tmp_path)
    assert out.returncode == 2 and "holds no ledger" in out.stderr
    out = zephon("ledger", "diff", tmp_path / "missing.toml", recipes[0])
    assert out.returncode == 2 and "neither a ledger folder" in out.stderr
    a = Recipe.from_toml(recipes[0])
    assert recipe_differences(a, a) == []
    # split_tokens defaults to 4 x (seq_len + 1): both show
    assert recipe_differences(a, a.replace(seq_len=32)) == [
        "mixing: ['tokens', 256, 260, {'split_mode': 'text'}] -> ['tokens', 256, 132, {'split_mode': 'text'}]",
        "seq_len: 64 -> 32",
    ]


def test_the_ledger_writer_lives_on_the_runtime_side():
    """The training loader writes the ledger on every step: it imports the writer from the recipe
    layer, never from the tools (reading and diffing), so the loop does not depend on them."""
    import ast

    import zephon.integrations.torchtitan as titan

    with open(titan.__file__, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not [m for m in imported if m.startswith("zephon.tools")], imported
    assert titan.LedgerWriter is LedgerWriter and LedgerWriter.__module__ == "zephon.recipe.ledger"
