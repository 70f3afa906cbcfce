"""The text pipeline end to end: elastic identity, exactly once, mixture accuracy, packing, recipes."""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest
from state_edits import resealed
from text_fixtures import write_corpus, write_recipe

from zephon import Recipe, StateError, WorkerConfig, batch_sha256
from zephon.engine import LaneContext
from zephon.engine import mapper as mapper_module
from zephon.engine.checkpoint import decode_state, encode_state
from zephon.engine.testing import check_node


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    write_corpus(str(root))
    return root


@pytest.fixture(scope="module")
def recipe(corpus):
    return Recipe.from_toml(write_recipe(str(corpus)))


def hashes(recipe, world, steps, workers=WorkerConfig(0), state=None):
    with recipe.global_loader(world, workers=workers) as g:
        if state is not None:
            g.load_state_dict(state)
        out = [batch_sha256(next(g)) for _ in range(steps)]
        return out, decode_state(encode_state(g.state_dict()))


STEPS = 24


@pytest.fixture(scope="module")
def reference(recipe):
    return hashes(recipe, 1, STEPS)[0]


@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize(
    "workers",
    [WorkerConfig(0), WorkerConfig(1, "thread"), WorkerConfig(4, "thread")],
    ids=["inline", "thread1", "thread4"],
)
def test_identical_across_world_sizes_and_threads(recipe, reference, world, workers):
    assert hashes(recipe, world, STEPS, workers)[0] == reference


@pytest.mark.parametrize(
    "world,count",
    # more processes than cores: the slow tier (the quick tier keeps one process-worker case)
    [(2, 1), pytest.param(4, 4, marks=pytest.mark.slow), pytest.param(8, 2, marks=pytest.mark.slow)],
)
def test_identical_with_process_workers(recipe, reference, world, count):
    assert hashes(recipe, world, STEPS, WorkerConfig(count, "process"))[0] == reference


@pytest.mark.parametrize("shm_mb", [None, 0], ids=["shm_on", "shm_off"])
def test_identical_with_process_workers_shm_on_and_off(recipe, reference, shm_mb):
    # token ids and per-document arrays through the workers' shared-memory arenas (or pickled)
    with recipe.global_loader(2, workers=WorkerConfig(2, "process", shm_mb=shm_mb)) as g:
        got = [batch_sha256(next(g)) for _ in range(STEPS)]
        pools = [m for r in g.routers for m in r.pools.metrics()]
    assert got == reference
    if shm_mb is None:
        assert pools and all(m["shm"] == "on" and m["shm_results"] > 0 for m in pools)
    else:
        assert pools and all(m["shm"] == "off (shm_mb = 0)" for m in pools)


@pytest.mark.parametrize("resume_world", [2, 8])
def test_save_at_w4_resume_elsewhere(recipe, reference, resume_world):
    first, state = hashes(recipe, 4, 9)
    rest, _ = hashes(recipe, resume_world, STEPS - 9, state=state)
    assert first + rest == reference


def test_resume_chain_with_workers(recipe, reference):
    a, st = hashes(recipe, 8, 5, WorkerConfig(2, "thread"))
    b, st = hashes(recipe, 1, 6, state=st)
    c, st = hashes(recipe, 2, 13, WorkerConfig(1, "process"), state=st)
    assert a + b + c == reference


def test_fields_and_shapes(recipe):
    with recipe.global_loader(2) as g:
        b = next(g)
    assert set(b) == {"input", "labels", "positions", "document_ids", "dataset", "provenance"}
    for k, v in b.items():
        if k != "provenance":
            assert v.shape == (16, 64), k
    # one provenance entry per row, one (dataset, shard, record, epoch, tok_start, tok_end) per segment
    assert len(b["provenance"]) == 16
    for row, prov in enumerate(b["provenance"]):
        segs = np.unique(b["document_ids"][row][b["document_ids"][row] >= 0])
        assert len(prov) in (len(segs), len(segs) + 1)  # + a segment that is only the row's last label
        # 8 for a part of a long document cut from its text: (..., part, parts)
        assert all((len(p) == 6 or (len(p) == 8 and 0 <= p[6] < p[7])) and p[5] > p[4] >= 0 for p in prov)
    assert b["input"].dtype == np.int64 and b["labels"].dtype == np.int64 and b["positions"].dtype == np.int64


def test_lane_state_is_small_and_stable(recipe):
    with recipe.global_loader(1) as g:
        sizes, shapes = [], set()
        for _ in range(10):
            next(g)
            st = g.state_dict()
            sizes.append(max(len(json.dumps(st[k])) for k in st if k.startswith("lane_")))
            from zephon.engine.testing import key_shape

            shapes.add(json.dumps(key_shape(st["lane_00003"])))
    assert max(sizes) < 1024, sizes
    assert len(shapes) == 1


def test_lane_restores_at_every_step(recipe):
    r = check_node(
        lambda: recipe.build_lane(LaneContext(seed=recipe.seed, lane=5, lanes=recipe.lanes)),
        max_steps=30,
        every=3,
        compare_steps=6,
    )
    assert r.steps == 30


# -- exactly once --------------------------------------------------------------------------------
def test_exactly_once_over_one_epoch(corpus):
    path = write_recipe(
        str(corpus),
        "once.toml",
        buffer=4,
        web_extra='policy = "stop"\n',
        code_extra='policy = "stop"\n',
        books_extra='policy = "stop"\n',
        extra="",
    )
    r = Recipe.from_toml(path).replace(global_batch_size=8)  # one row per lane per step: nothing dropped at the end
    r = r.replace(pack={**vars(r.spec.pack), "labels": "row"})  # a row's last token is read from its last label
    p = r.prepare()
    # every record is read by exactly one lane, once (long ones as all of their parts, once each)
    seen = collections.Counter()
    parts = collections.defaultdict(set)
    for lane in range(r.lanes):
        for it in p.plan.lane(lane):
            seen[(it.dataset, it.shard, it.record, it.part)] += 1
            parts[(it.dataset, it.shard, it.record)].add((it.part, it.parts))
    total = sum(ix.num_records for ix in p.indexes)
    assert len(parts) == total and set(seen.values()) == {1}
    assert all(sorted(ps) == [(i, len(ps)) for i in range(len(ps))] for ps in parts.values())
    assert any(len(ps) > 1 for ps in parts.values())  # the corpus does have long documents
    # and every document's tokens come out exactly once across all lanes (multiset of tokens per dataset)
    expected = [collections.Counter() for _ in r.datasets]
    for d, ix in enumerate(p.indexes):
        for s in range(len(ix.shards)):
            texts = ix.read(s, list(range(ix.shards[s].num_records)))
            for toks in p.tokenizer.encode_batch(texts):
                expected[d].update(toks.tolist())
    got = [collections.Counter() for _ in r.datasets]
    last_labels = collections.Counter()
    for lane in range(r.lanes):
        node = r.build_lane(LaneContext(seed=r.seed, lane=lane, lanes=r.lanes))
        for b in node:
            m = b["document_ids"] >= 0
            for d in range(len(r.datasets)):
                got[d].update(b["input"][m & (b["dataset"] == d)].tolist())
            # a full row's last token is only a label (rows are seq_len + 1 tokens)
            for i in range(len(b["input"])):
                if m[i, -1] and b["labels"][i, -1] != -100:
                    last_labels[int(b["labels"][i, -1])] += 1
        node.close()
    for d in range(len(r.datasets)):
        assert not got[d] - expected[d], f"dataset {d}: tokens delivered that its documents do not have"
    total_expected = sum(expected, collections.Counter())
    total_got = sum(got, collections.Counter()) + last_labels
    assert total_got == total_expected, (
        f"{sum((total_expected - total_got).values())} tokens lost, {sum((total_got - total_expected).values())} duplicated"
    )


# -- mixing ----------------------------------------------------------------------------------------
def realized_shares(recipe, steps, world=2):
    counts = np.zeros(len(recipe.datasets))
    with recipe.global_loader(world) as g:
        for _ in range(steps):
            b = next(g)
            for d in range(len(counts)):
                counts[d] += int((b["dataset"] == d).sum())
    return counts / counts.sum()


def test_mixture_accuracy_by_tokens(recipe):
    shares = realized_shares(recipe, 200)
    target = np.array([0.5, 0.3, 0.2])
    assert np.abs(shares - target).max() < 0.01, shares


def test_mixing_by_samples_differs(corpus):
    r = Recipe.from_toml(write_recipe(str(corpus), "samples.toml", extra='[mixing]\nby = "samples"\n'))
    p = r.prepare()
    counts = collections.Counter()
    src = p.plan.lane(0)
    for _ in range(1000):
        counts[next(src).dataset] += 1
    assert [round(counts[d] / 1000, 2) for d in range(3)] == [0.5, 0.3, 0.2]
    # by samples, the long books documents take far more than 20% of the tokens
    assert realized_shares(r, 40)[2] > 0.3


def test_weight_schedule_changes_mix_at_the_step(corpus):
    extra = "[[schedule]]\nstep = 60\nweights = { web = 0.1, code = 0.1, books = 0.8 }\n"
    r = Recipe.from_toml(write_recipe(str(corpus), "sched.toml", extra=extra))
    early = realized_shares(r, 50)
    assert abs(early[0] - 0.5) < 0.02
    counts = np.zeros(3)
    with r.global_loader(4) as g:
        for t in range(140):
            b = next(g)
            if t >= 70:
                for d in range(3):
                    counts[d] += int((b["dataset"] == d).sum())
    late = counts / counts.sum()
    assert abs(late[2] - 0.8) < 0.03, late
    # deterministic on every world size
    assert hashes(r, 1, 70)[0][-5:] == hashes(r, 8, 70)[0][-5:]


def test_token_estimates_come_from_the_checkpoint(corpus):
    r1 = Recipe.from_toml(write_recipe(str(corpus), "est.toml"))
    _, state = hashes(r1, 2, 3)
    assert set(state["shared"]["token_estimates"]) == {"web", "code", "books"}

    # pretend the run started with other estimates (a consistent checkpoint: digests recomputed)
    def triple_web(raw):
        raw["shared"]["token_estimates"]["web"][0] *= 3

    forged = resealed(json.loads(json.dumps(state)), triple_web)
    r2 = Recipe.from_toml(write_recipe(str(corpus), "est.toml"))
    with r2.global_loader(2) as g:
        g.load_state_dict(forged)
        next(g)
        assert g.state_dict()["shared"] == forged["shared"]
        # every rank plans with the checkpoint's estimates; the recipe itself is left as it was
        for router in g.routers:
            plan = router.lane_set.prepared.plan
            assert plan.datasets[0].tokens_per_byte == forged["shared"]["token_estimates"]["web"][0]
    assert r2.prepare().plan.datasets[0].tokens_per_byte == state["shared"]["token_estimates"]["web"][0]


# -- packing -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ["greedy", "first_fit", "best_fit"])
def test_packing_invariants(corpus, algorithm):
    r = Recipe.from_toml(write_recipe(str(corpus), f"pack_{algorithm}.toml", algorithm=algorithm))
    tok = r.prepare().tokenizer
    with r.global_loader(1) as g:
        batches = [next(g) for _ in range(6)]
    for b in batches:
        for i in range(len(b["input"])):
            inp, lab, pos, doc = b["input"][i], b["labels"][i], b["positions"][i], b["document_ids"][i]
            valid = doc >= 0
            n = int(valid.sum())
            # labels are the inputs shifted by one inside each document, -100 where the target is
            # padding or another document (labels = "document")
            same = doc[: n - 1] == doc[1:n]
            assert (lab[: n - 1][same] == inp[1:n][same]).all() and (lab[: n - 1][~same] == -100).all()
            assert (lab[n:] == -100).all()
            # positions restart at 0 at every document start and count up inside it
            starts = np.r_[True, doc[1:] != doc[:-1]] & valid
            assert (pos[starts] == 0).all()
            assert (pos[valid & ~starts] == pos[np.nonzero(valid & ~starts)[0] - 1] + 1).all()
            if algorithm != "greedy":
                # a segment that starts a document either holds all of it (ends with EOS, or
                # its EOS is the row's last label) or is the first row-sized chunk of a longer one
                for j in np.unique(doc[valid]):
                    where = np.nonzero(doc == j)[0]
                    seg = inp[where]
                    if seg[0] == tok.bos_id:
                        complete = seg[-1] == tok.eos_id or (where[-1] == len(inp) - 1 and lab[-1] == tok.eos_id)
                        assert complete or len(seg) + 1 == r.seq_len + 1, (len(seg), seg[-3:])


def test_first_fit_pads_greedy_does_not(corpus):
    def eff(alg):
        # long rows, so that whole documents (not row-sized chunks) are what gets packed
        r = Recipe.from_toml(write_recipe(str(corpus), f"eff_{alg}.toml", algorithm=alg)).replace(seq_len=512)
        with r.global_loader(1) as g:
            bs = [next(g) for _ in range(10)]
        return float(np.mean([(b["document_ids"] >= 0).mean() for b in bs]))

    greedy, first, best = eff("greedy"), eff("first_fit"), eff("best_fit")
    assert greedy > 0.99
    assert 0.9 < first < greedy and 0.9 < best < greedy


# -- recipe errors -------------------------------------------------------------------------------------
BASE = {"seed": 1, "lanes": 4, "seq_len": 32, "global_batch_size": 8, "datasets": [{"name": "a", "path": "x/*.jsonl"}]}


def rec(tmp_path, **changes):
    from zephon.tools.demo import TOKENIZER_DIR

    cfg = json.loads(json.dumps(BASE))
    cfg["tokenizer"] = {"path": TOKENIZER_DIR}
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    return Recipe.from_dict(cfg, str(tmp_path))


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"sede": 1}, r"unknown key 'sede'.*Did you mean 'seed'"),
        (
            {"global_batch_size": 10},
            r"global_batch_size = 10 is not a multiple of lanes = 4.*Use global_batch_size = 8 or 12",
        ),
        ({"seq_len": 4}, r"seq_len must be >= 8"),
        ({"lanes": 0}, r"lanes must be >= 1"),
        ({"seed": "x"}, r"seed must be an integer"),
        ({"tokenizer": None}, r"missing required key 'tokenizer'"),
        ({"tokenizer": {"path": "/nonexistent/tok"}}, r"\[tokenizer\].path '/nonexistent/tok' does not exist"),
        ({"datasets": []}, r"at least one dataset"),
        ({"datasets": [{"name": "a"}]}, r"needs path"),
        ({"datasets": [{"name": "a", "path": "x", "weight": -1}]}, r"weight must be a finite number"),
        ({"datasets": [{"name": "a", "path": "x", "format": "csv"}]}, r"format = 'csv' is not valid"),
        ({"datasets": [{"name": "a", "path": "x", "fromat": "csv"}]}, r"unknown key 'fromat'.*Did you mean 'format'"),
        ({"datasets": [{"name": "a", "path": "x"}, {"name": "a", "path": "y"}]}, r"'a' appears more than once"),
        ({"datasets": [{"name": "a", "path": "x", "epochs": 2}]}, r"epochs only applies with policy = \"stop\""),
        ({"datasets": [{"name": "a", "path": "x", "on_error": "ignore"}]}, r"on_error = 'ignore' is not valid"),
        ({"pack": {"algorithm": "tetris"}}, r"algorithm = 'tetris' is not valid"),
        ({"shuffle": {"buffer": 0}}, r"buffer must be >= 1"),
        ({"workers": {"count": -1}}, r"count must be >= 0"),
        ({"workers": {"backend": "gpu"}}, r"backend = 'gpu' is not valid"),
        ({"schedule": [{"step": 10, "weights": {"b": 1.0}}]}, r"unknown dataset 'b'"),
        ({"schedule": [{"weights": {"a": 1.0}}]}, r"needs step = N"),
        ({"mixing": {"by": "bytes"}}, r"by = 'bytes' is not valid"),
    ],
)
def test_recipe_errors_name_the_key_and_fix(tmp_path, changes, match):
    from zephon import RecipeError

    with pytest.raises(RecipeError, match=match):
        rec(tmp_path, **changes)


def test_world_size_not_dividing_lanes(recipe):
    with pytest.raises(ValueError, match=r"Valid world sizes for lanes = 8: \[1, 2, 4, 8\]"):
        recipe.router(world_size=3)


def test_missing_data_names_the_dataset(tmp_path):
    from zephon.data.datasets import DataError

    with pytest.raises(DataError, match="'a'"):
        rec(tmp_path).prepare()


def test_checkpoint_of_another_recipe_is_refused(corpus, recipe):
    _, state = hashes(recipe, 2, 2)
    other = Recipe.from_toml(write_recipe(str(corpus), "other.toml", buffer=4))
    with pytest.raises(StateError, match="recipe changed"):
        hashes(other, 2, 1, state=state)


def test_vectorised_planning_equals_the_scalar_reference(recipe):
    from zephon.nodes.worksource import LaneWorkSource

    plan = recipe.prepare().plan
    for lane in (0, 5):
        src = LaneWorkSource(plan, lane)
        for d, ds in enumerate(plan.datasets):
            for k in list(range(0, 3 * ds.num_records // plan.lanes + 70, 7)):
                q, epoch, shard, record = src._locate_count(d, k)
                assert (epoch, shard, record) == src._locate(d, q)


def test_lanes_far_above_the_records_map_only_what_the_first_batch_needs(recipe, monkeypatch):
    """512 lanes over 256 records, one row each: before the first batch each lane tokenized a
    whole first chunk (32 records, 16,384 in all, where about one a lane is used: a cold start
    in time lanes x chunk). The first tasks ramp up from one record, so the records mapped are
    about the records the first batch holds; the batches are the ones whole chunks give."""
    many = recipe.replace(lanes=512, global_batch_size=512, shuffle={"buffer": 1})
    mapped = []
    real = mapper_module._run_chunk
    monkeypatch.setattr(
        mapper_module, "_run_chunk", lambda fn, is_batch, items: mapped.append(len(items)) or real(fn, is_batch, items)
    )
    with many.global_loader(1, workers=WorkerConfig(0)) as g:
        first = batch_sha256(next(g))
    assert sum(mapped) <= 2 * many.lanes, f"{sum(mapped)} records mapped for the first batch of {many.lanes} rows"
    monkeypatch.setattr(mapper_module, "_run_chunk", real)
    with many.global_loader(2, workers=WorkerConfig(2, "thread")) as g:
        assert batch_sha256(next(g)) == first


@pytest.mark.parametrize("lanes", [64, pytest.param(1024, marks=pytest.mark.slow)])
def test_many_lanes_start_and_restore(recipe, lanes):
    """Many lanes on one rank: the first batch (lanes primed, pulled on a few threads) and a
    restore (replayed on a few threads) give the bytes of one lane at a time, inline."""
    many = recipe.replace(lanes=lanes, global_batch_size=lanes, shuffle={"buffer": 1})
    ref, _ = hashes(many, 1, 3)  # inline: one lane after the other
    with many.global_loader(1, workers=WorkerConfig(2, "thread")) as g:
        router = g.routers[0]
        assert router._lane_threads() > 1 and len(router._primables()) == lanes
        got = [batch_sha256(next(g))]
        state = g.state_dict()
    with many.global_loader(2, workers=WorkerConfig(2, "thread")) as g:
        g.load_state_dict(state)
        got += [batch_sha256(next(g)) for _ in range(2)]
    assert got == ref
