"""Batch-size and sequence-length schedules (``[[batch_schedule]]``, ``global_batch_tokens``):
the same global batches on every world size and worker mode through each change, resume at
every step around a change onto another world size, exactly once across a seq_len change."""

from __future__ import annotations

import collections
import itertools
import json

import numpy as np
import pytest
from text_fixtures import write_corpus, write_recipe

from zephon import Recipe, WorkerConfig, batch_sha256
from zephon.engine import LaneContext
from zephon.engine.checkpoint import decode_state, encode_state
from zephon.engine.testing import check_node, key_shape
from zephon.recipe import RecipeError
from zephon.recipe.budget import memory_budget
from zephon.recipe.phases import phase_specs
from zephon.recipe.runtime import RankBatches

# lanes = 8, seq_len = 64, global_batch_size = 16 (text_fixtures); a ramp at 4, a seq_len change at 7,
# the batch stated in tokens at 10 (16 rows of 128: the same rows, stated otherwise)
SCHEDULE = """
[[batch_schedule]]
step = 4
global_batch_size = 32

[[batch_schedule]]
step = 7
seq_len = 128
global_batch_size = 16

[[batch_schedule]]
step = 10
global_batch_tokens = 4096
"""
STEPS = 13
SHAPES = [(16, 64)] * 4 + [(32, 64)] * 3 + [(16, 128)] * 3 + [(32, 128)] * 3


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    write_corpus(str(root))
    return root


@pytest.fixture(scope="module")
def recipe(corpus):
    return Recipe.from_toml(write_recipe(str(corpus), "ramp.toml", extra=SCHEDULE))


def run(recipe, world, steps, workers=WorkerConfig(0), state=None):
    with recipe.global_loader(world, workers=workers) as g:
        if state is not None:
            g.load_state_dict(state)
        out = []
        for _ in range(steps):
            b = next(g)
            out.append((b["input"].shape, batch_sha256(b)))
        return out, decode_state(encode_state(g.state_dict()))


@pytest.fixture(scope="module")
def reference(recipe):
    return run(recipe, 1, STEPS)[0]


def test_shapes_follow_the_schedule(recipe, reference):
    assert recipe.batch_phases == [(0, 16, 64), (4, 32, 64), (7, 16, 128), (10, 32, 128)]
    assert [shape for shape, _ in reference] == SHAPES
    assert [recipe.global_batch_size_at(t) for t in (3, 4, 7, 10)] == [16, 32, 16, 32]


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize(
    "workers",
    [WorkerConfig(0), WorkerConfig(2, "thread"), WorkerConfig(2, "process")],
    ids=["inline", "thread", "process"],
)
def test_identical_across_world_sizes_and_workers(recipe, reference, world, workers):
    assert run(recipe, world, STEPS, workers)[0] == reference


@pytest.mark.parametrize("at", [3, 4, 5, 6, 7, 8, 10])
def test_resume_around_each_change_on_another_world_size(recipe, reference, at):
    # saved at W=4 before, at and after the ramp (4), the seq_len change (7) and the last phase (10)
    first, state = run(recipe, 4, at)
    rest, _ = run(recipe, 2 if at % 2 else 8, STEPS - at, state=state)
    assert first + rest == reference


def test_resume_chain_with_workers(recipe, reference):
    a, st = run(recipe, 8, 5, WorkerConfig(2, "thread"))
    b, st = run(recipe, 1, 3, WorkerConfig(1, "process"), state=st)
    c, _ = run(recipe, 2, STEPS - 8, state=st)
    assert a + b + c == reference


def test_lane_restores_at_every_step_through_the_changes(recipe):
    r = check_node(lambda: recipe.build_lane(LaneContext(seed=recipe.seed, lane=3, lanes=recipe.lanes)), max_steps=12)
    assert r.steps == 12
    shapes = {json.dumps(key_shape(s)) for s in r.states}
    assert len(shapes) == 1  # one state shape in every segment
    assert max(len(json.dumps(s)) for s in r.states) < 4096  # a few integers, nested per segment


def test_exactly_once_across_the_seq_len_change(recipe):
    # every token of every record appears at most once, across old-length and re-packed rows
    seen: dict[tuple, list[tuple[int, int]]] = collections.defaultdict(list)
    with recipe.global_loader(2) as g:
        for _ in range(STEPS):
            for row in next(g)["provenance"]:
                for p in row:
                    seen[(p[0], p[1], p[2], p[3], *p[6:])].append((p[4], p[5]))
    for spans in seen.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), spans


def test_tokens_view_equals_rows(corpus):
    rows = Recipe.from_toml(write_recipe(str(corpus), "rows.toml"))
    path = corpus / "tokens.toml"
    path.write_text(
        open(write_recipe(str(corpus), "t.toml")).read().replace("global_batch_size = 16", "global_batch_tokens = 1024")
    )
    tokens = Recipe.from_toml(str(path))
    assert tokens.global_batch_size == 16 and tokens.fingerprint == rows.fingerprint
    assert run(tokens, 2, 3)[0] == run(rows, 2, 3)[0]


def test_no_schedule_keeps_the_lane_state(corpus):
    r = Recipe.from_toml(write_recipe(str(corpus), "plain.toml"))
    assert r.spec.batch_schedule is None and "batch_schedule" not in r.spec.data_definition()
    st = r.build_lane(LaneContext(seed=r.seed, lane=0, lanes=r.lanes)).state_dict()
    assert st["type"] == "batch" and st["extra"] == {}


def test_rank_batches_microbatches_follow_the_schedule(recipe):
    rb = RankBatches(recipe, 2, 0, local_batch_size=4, workers=WorkerConfig(0))
    try:
        assert [rb.microbatches_at(t) for t in (0, 4, 7, 10)] == [2, 4, 2, 4]
        sizes = []
        for _ in range(sum(rb.microbatches_at(t) for t in range(6))):
            batch, lo, hi = rb.next_slice()
            sizes.append((len(batch["input"]), hi - lo))
        assert sizes == [(8, 4)] * 8 + [(16, 4)] * 8 and rb.between_steps and rb.step == 6
    finally:
        rb.close()
    with pytest.raises(ValueError, match="from step 0 is 16 rows.*local_batch_size = 16"):
        RankBatches(recipe, 2, 0, local_batch_size=16, workers=WorkerConfig(0))


def test_memory_budget_checked_per_phase(corpus):
    text = open(write_recipe(str(corpus), "mem.toml", buffer=64)).read()
    lane = memory_budget(Recipe.from_toml(str(corpus / "mem.toml")).spec).lane_bytes
    text = text.replace("cache_dir", f"memory_gb = {3 * lane / 1e9}\ncache_dir", 1)  # phase 0 fits 3 times
    fits, big = corpus / "mem_fits.toml", corpus / "mem_big.toml"
    fits.write_text(text + "\n[[batch_schedule]]\nstep = 5\nseq_len = 128\n")
    assert [(s, p.seq_len) for s, p in phase_specs(Recipe.from_toml(str(fits)).spec)] == [(0, 64), (5, 128)]
    big.write_text(text + "\n[[batch_schedule]]\nstep = 5\nseq_len = 256\n")  # 4x the row: no longer fits
    with pytest.raises(RecipeError, match="memory limit"):
        Recipe.from_toml(str(big))


@pytest.mark.parametrize(
    "schedule,match",
    [
        ("step = 4\nglobal_batch_size = 20", "not a multiple of lanes = 8"),
        ("step = 4\nglobal_batch_tokens = 1000", "not a multiple of seq_len x lanes"),
        ("step = 0\nglobal_batch_size = 32", "step"),
        ("step = 4", "changes nothing"),
        ("step = 4\nglobal_batch_size = 32\nglobal_batch_tokens = 2048", "give one"),
        ("step = 4\nglobal_batch_siz = 32", "unknown key 'global_batch_siz'"),
    ],
)
def test_schedule_errors_name_the_key_and_fix(corpus, schedule, match):
    path = write_recipe(str(corpus), "bad.toml", extra=f"\n[[batch_schedule]]\n{schedule}\n")
    with pytest.raises(RecipeError, match=match):
        Recipe.from_toml(path)


def test_finite_recipe_with_a_schedule_is_refused(corpus):
    extra = 'policy = "stop"\n'
    path = write_recipe(
        str(corpus),
        "finite.toml",
        web_extra=extra,
        code_extra=extra,
        books_extra=extra,
        extra="\n[[batch_schedule]]\nstep = 4\nglobal_batch_size = 32\n",
    )
    with pytest.raises(RecipeError, match="never ends"):
        Recipe.from_toml(path)


# -- forks: a fork may change the batch size from its step on --------------------------------------
FORK_AT = 5


def test_a_fork_changes_the_batch_size_from_its_step(corpus):
    parent = Recipe.from_toml(write_recipe(str(corpus), "parent.toml"))
    fork_extra = f'\n[fork]\nparent = "parent.toml"\nstep = {FORK_AT}\n\n[[batch_schedule]]\nstep = {FORK_AT}\nglobal_batch_size = 32\n'
    fork = Recipe.from_toml(write_recipe(str(corpus), "fork.toml", extra=fork_extra))
    theirs = run(parent, 2, FORK_AT)[0]
    ref = run(fork, 1, FORK_AT + 3)[0]
    assert ref[:FORK_AT] == theirs and [s for s, _ in ref[FORK_AT:]] == [(32, 64)] * 3
    assert run(fork, 8, FORK_AT + 3, WorkerConfig(2, "thread"))[0] == ref
    for at in (FORK_AT - 1, FORK_AT, FORK_AT + 1):
        head, st = run(fork, 4, at)
        assert head + run(fork, 2, FORK_AT + 3 - at, state=st)[0] == ref
    # before the fork step the batches are the parent's: a schedule that changes them is refused
    early = fork_extra.replace(f"step = {FORK_AT}\nglobal", f"step = {FORK_AT - 2}\nglobal")
    with pytest.raises(RecipeError, match="before the fork step"):
        Recipe.from_toml(write_recipe(str(corpus), "early.toml", extra=early)).build_lane(
            LaneContext(seed=77, lane=0, lanes=8)
        )


# -- visible: inspect and the ledger ----------------------------------------------------------------
def test_inspect_prints_the_phases(recipe):
    from zephon.tools.display import describe_plan

    lines = recipe.describe_phases()
    assert len(lines) == 5 and "memory/lane" in lines[0]
    assert lines[2].split()[:6] == ["steps", "4..6", "32", "4", "64", "2048"]
    assert lines[4].split()[:6] == ["steps", "10..", "32", "4", "128", "4096"]
    assert "\n".join(lines) in describe_plan(recipe)


def test_ledger_records_each_steps_batch_size(recipe, tmp_path):
    import io

    from zephon.tools.cli import run_hashes

    run_hashes(recipe, world_size=2, steps=9, ledger=str(tmp_path), out=io.StringIO(), err=io.StringIO())
    for rank in (0, 1):
        lines = [json.loads(x) for x in open(tmp_path / f"rank_{rank:05d}.jsonl")]
        steps = [(x["batch"], x["global_batch_size"], x["seq_len"]) for x in lines if x["kind"] == "step"]
        assert steps == [(t, recipe.global_batch_size_at(t), recipe.seq_len_at(t)) for t in range(9)]
        # tokens per dataset per lane follow the step's rows: each lane's whole micro-batch is counted
        for x in lines[1:]:
            assert len(x["dataset_tokens"]) == 4


# -- plain loops: the StatefulDataLoader adapter --------------------------------------------------
def test_stateful_dataloader_per_step_batches_and_resume_across_the_change(recipe):
    from torchdata.stateful_dataloader import StatefulDataLoader

    from zephon.integrations.torch_data import ZephonIterableDataset, zephon_state

    def rows(W, rank, state=None, steps=STEPS):
        ds = ZephonIterableDataset(recipe, world_size=W, rank=rank, local_batch_size=2, workers=WorkerConfig(0))
        if state is not None:
            ds.load_state_dict(state)
        start = 0 if state is None else state["step"]
        n = sum(ds.rows_at(t) for t in range(start, steps)) // 2
        dl = StatefulDataLoader(ds, batch_size=2)
        it = iter(dl)
        out = [next(it)["input"] for _ in range(n)]
        return out, dl, ds

    whole, _, ds = rows(2, 0)
    assert [ds.rows_at(t) for t in (0, 4, 7, 10)] == [8, 16, 8, 16]
    assert ds.rows_before(5) == 4 * 8 + 16
    ds.close()
    # both ranks of W=2 stop after step 5 (inside the ramp's phase), resume as W=1 and W=4 ranks
    states = []
    for rank in (0, 1):
        _, dl, ds = rows(2, rank, steps=5)
        states.append(dl.state_dict())
        ds.close()
    merged = zephon_state(states)
    assert merged["step"] == 5
    for W in (1, 4):
        with recipe.global_loader(W) as g:
            g.load_state_dict(merged)
            want = [next(g) for _ in range(STEPS - 5)]
        for rank in range(W):
            got, _, ds = rows(W, rank, merged)
            ds.close()
            expect = []
            for b in want:  # this rank's block of each step's rows, in local batches of 2
                per = len(b["input"]) // W
                expect += np.split(b["input"][rank * per : (rank + 1) * per], per // 2)
            assert len(got) == len(expect) and all((g.numpy() == e).all() for g, e in zip(got, expect))
