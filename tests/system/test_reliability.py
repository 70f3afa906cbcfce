"""Reliability: bad input raises with file/record/fix or is skipped deterministically and counted;
changed data and old checkpoints are handled explicitly; interrupts leave nothing behind."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from state_edits import node_of, unsealed

from zephon import Recipe, StateError, WorkerConfig, batch_sha256
from zephon.data.datasets import DataError
from zephon.engine import WorkerPool
from zephon.engine.checkpoint import FORMAT_VERSION, decode_state, encode_state, migrate
from zephon.nodes import skip_hint
from zephon.recipe.migrations import LANE_MIGRATIONS
from zephon.tools.demo import TOKENIZER_DIR
from zephon.tools.synth import generate_documents, write_parquet

BAD_LINES = {
    "malformed JSON": b'{"text": "unterminated\n',
    "not an object": b'["a", "list"]\n',
    "missing field": b'{"body": "no text field here"}\n',
    "non-string text": b'{"text": 42}\n',
    "invalid UTF-8": b'{"text": "bad \xff\xfe bytes"}\n',
    "empty text": b'{"text": ""}\n',
}


def make_data(root, n_good=120):
    """web/: JSONL shards with one of each bad line kind mixed in; code/: clean Parquet."""
    os.makedirs(f"{root}/web", exist_ok=True)
    docs = generate_documents("web", n_good, seed=11)
    for s in range(2):
        lines = [json.dumps({"text": d}).encode() + b"\n" for d in docs[s::2]]
        for i, bad in enumerate(BAD_LINES.values()):
            lines.insert(3 + 7 * i + s, bad)
        with open(f"{root}/web/part-{s}.jsonl", "wb") as f:
            f.writelines(lines)
    os.makedirs(f"{root}/code", exist_ok=True)
    write_parquet(f"{root}/code/c.parquet", generate_documents("code", 80, seed=12), row_group_size=20)
    open(f"{root}/web/empty.jsonl", "wb").close()  # a zero-byte shard is fine: 0 records
    return 2 * len(BAD_LINES)


def recipe(root, on_error="skip", policy="repeat", extra="", **kw):
    cfg = {
        "seed": 5,
        "lanes": 4,
        "seq_len": 64,
        "global_batch_size": 8,
        "cache_dir": f"{root}/cache",
        "tokenizer": {"path": TOKENIZER_DIR},
        "datasets": [
            {
                "name": "web",
                "path": f"{root}/web/*.jsonl",
                "format": "jsonl",
                "weight": 0.6,
                "on_error": on_error,
                "policy": policy,
                **kw,
            },
            {"name": "code", "path": f"{root}/code/*.parquet", "weight": 0.4, "policy": policy},
        ],
        "shuffle": {"buffer": 4},
        "pack": {"flush_every": 16},
    }
    return Recipe.from_dict(cfg, root)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("bad"))
    n_bad = make_data(root)
    return root, n_bad


def run(r, world, steps, workers=WorkerConfig(0), state=None):
    with r.global_loader(world, workers=workers) as g:
        if state is not None:
            g.load_state_dict(state)
        hs = [batch_sha256(next(g)) for _ in range(steps)]
        return hs, decode_state(encode_state(g.state_dict()))


def test_raise_names_dataset_file_record_and_fix(data):
    root, _ = data
    with pytest.raises(Exception) as ei:
        run(recipe(root, on_error="raise"), 2, 40)
    msg = str(ei.value)
    assert "dataset 'web'" in msg and "part-" in msg and "line " in msg
    assert "set on_error = \"skip\" for dataset 'web'" in msg
    notes = " ".join(getattr(ei.value, "__notes__", []))
    assert "lane " in notes  # the mapper adds where in the pipeline it happened (the error keeps its type)


@pytest.mark.parametrize("kind", list(BAD_LINES))
def test_each_bad_record_kind_is_reported(tmp_path, kind):
    os.makedirs(tmp_path / "web")
    os.makedirs(tmp_path / "code")
    write_parquet(str(tmp_path / "code/c.parquet"), generate_documents("code", 20, seed=1))
    with open(tmp_path / "web/a.jsonl", "wb") as f:
        f.write(json.dumps({"text": "a fine document"}).encode() + b"\n" + BAD_LINES[kind])
    from zephon.data.datasets import index_dataset

    ix = index_dataset("web", str(tmp_path / "web/*.jsonl"), cache_dir=str(tmp_path / "cache"))
    good, bad = ix.read(0, [0, 1])
    assert good == "a fine document"
    err = str(bad.to_error(skip_hint("web")))
    assert "line 2" in err and "a.jsonl" in err and "on_error" in err


def test_skips_are_deterministic_and_counted(data):
    root, n_bad = data
    r = recipe(root)
    ref, state = run(r, 1, 30)
    for world, workers in [(2, WorkerConfig(2, "thread")), (4, WorkerConfig(1, "process"))]:
        assert run(r, world, 30, workers)[0] == ref
    a, st = run(r, 4, 11)
    b, _ = run(r, 2, 19, state=st)
    assert a + b == ref

    # the counts are in every lane's checkpoint state, and the same on every world size
    def skipped(state):
        total = 0
        for k, v in state.items():
            if k.startswith("lane_"):
                node = v["state"]
                while node.get("type") != "skip_counter":
                    node = node["anchor"]
                total += sum(node["skipped"])
        return total

    assert skipped(state) == skipped(run(r, 4, 30)[1]) > 0


def test_one_epoch_skips_exactly_the_bad_records(data):
    root, n_bad = data
    # data version 1: an empty text is one of the bad records (from version 2 it is a document)
    r = recipe(root, policy="stop").replace(global_batch_size=4, data_version=1)
    total = 0
    by_reason = {}
    from zephon.engine import LaneContext

    for lane in range(r.lanes):
        node = r.build_lane(LaneContext(seed=r.seed, lane=lane, lanes=r.lanes))
        for _ in node:
            pass
        counter = node
        while type(counter).__name__ != "SkipCounter":
            counter = counter.source
        c = counter.counts()
        total += c["skipped"]["web"]
        for row in c["by_file"]:
            by_reason[row["reason"]] = by_reason.get(row["reason"], 0) + row["count"]
            assert row["file"].endswith(".jsonl") and row["dataset"] == "web"
        node.close()
    assert total == n_bad
    assert len(by_reason) >= 4, by_reason


def test_skip_budget(data):
    root, _ = data
    # 1000 steps read every lane's share of the data several times (policy "repeat"), so under
    # any record order some lane meets a second bad record (a budget of 4 // 4 = 1 per lane)
    with pytest.raises(DataError, match="too many bad records.*max_skipped"):
        run(recipe(root, max_skipped=4), 1, 1000)
    with pytest.raises(DataError, match="too many bad records"):
        run(recipe(root, max_skipped_fraction=0.01), 1, 1000)
    run(recipe(root, max_skipped=1000), 1, 30)


def test_budget_keys_need_skip_policy(data):
    from zephon import RecipeError

    with pytest.raises(RecipeError, match='only apply with on_error = "skip"'):
        recipe(data[0], on_error="raise", max_skipped=3)


def test_file_level_errors_name_the_file(tmp_path):
    from zephon.data.datasets import index_dataset

    (tmp_path / "t").mkdir()
    raw = gzip.compress(b'{"text": "x"}\n' * 1000)
    (tmp_path / "t/a.jsonl.gz").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(DataError, match=r"a\.jsonl\.gz"):
        index_dataset("t", str(tmp_path / "t/*.jsonl.gz"), cache_dir=str(tmp_path / "c"))
    (tmp_path / "p").mkdir()
    (tmp_path / "p/x.parquet").write_bytes(b"PAR1 not really parquet")
    with pytest.raises(DataError, match=r"x\.parquet"):
        index_dataset("p", str(tmp_path / "p/*.parquet"), cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError, match="matched nothing|no files|does not exist"):
        index_dataset("m", str(tmp_path / "missing/*.jsonl"), cache_dir=str(tmp_path / "c"))


def test_changed_source_file_is_refused_on_resume(tmp_path):
    root = str(tmp_path)
    make_data(root)
    r = recipe(root)
    _, state = run(r, 2, 5)
    with open(f"{root}/web/part-1.jsonl", "ab") as f:  # the data changes between save and resume
        f.write(json.dumps({"text": "a new document"}).encode() + b"\n")
    with pytest.raises(StateError, match="files of dataset 'web' changed"):
        run(recipe(root), 2, 1, state=state)


def as_format(state, version):
    """``state`` written as format ``version`` (1 or 2) was: lane entries are the pipelines' states
    (no lane identity, no digests), skip counters of version 1 (no streak); format 1 also had no
    "shared" entry and no skip_counter in text lanes."""
    old = unsealed(state)
    old["format_version"] = version
    for k, v in old.items():
        if k.startswith("lane_"):
            counter = node_of(v, "skip_counter")
            counter["version"] = 1
            del counter["streak"]
            if version == 1:
                node = v
                while node["anchor"].get("type") != "skip_counter":
                    node = node["anchor"]
                node["anchor"] = node["anchor"]["upstream"]
    if version == 1:
        del old["shared"]
    return old


@pytest.mark.parametrize("version", [1, 2])
def test_old_format_checkpoint_loads_through_migration(data, version):
    root, _ = data
    r = recipe(root)
    ref, _ = run(r, 2, 12)
    _, state = run(r, 2, 5)
    enc = encode_state(as_format(state, version))
    decoded = decode_state(enc)  # decoding leaves it as written; the recipe's lanes know how to migrate it
    assert decoded["format_version"] == version
    assert migrate(decoded, LANE_MIGRATIONS)["format_version"] == FORMAT_VERSION
    assert run(recipe(root), 4, 7, state=decoded)[0] == ref[5:]  # a fresh Recipe: nothing registered on import


def test_checkpoint_of_the_former_special_token_default_names_the_setting(tmp_path):
    """Before special-token parsing became an opt-in, document text like "<|eos|>" became the
    special token. A format 2 checkpoint of that default resumes with the setting it names, and
    only with it (the tokenizer changed otherwise)."""
    root = str(tmp_path)
    make_data(root)
    old_default = recipe(root).replace(tokenizer={"path": TOKENIZER_DIR, "special_tokens_in_text": True})
    ref, _ = run(old_default, 2, 9)
    _, state = run(old_default, 2, 4)
    v2 = as_format(state, 2)
    with pytest.raises(StateError, match="set \\[tokenizer\\] special_tokens_in_text = true"):
        run(recipe(root), 2, 1, state=v2)
    assert run(old_default.replace(), 2, 5, state=v2)[0] == ref[4:]


def test_checkpoint_from_newer_zephon_is_refused(data):
    root, _ = data
    _, state = run(recipe(root), 2, 2)
    state["format_version"] = 99
    with pytest.raises(StateError, match="newer than this zephon"):
        decode_state(encode_state(state))


INTERRUPT_SCRIPT = textwrap.dedent("""
    import os, sys, json
    from zephon import Recipe, WorkerConfig
    sys.path[:0] = [{tests!r}, os.path.join({tests!r}, "..", "support")]
    from test_reliability import recipe
    if __name__ == "__main__":
        r = recipe({root!r})
        g = r.global_loader(2, workers=WorkerConfig(2, "process"))
        next(g)
        import multiprocessing
        print(json.dumps([p.pid for p in multiprocessing.active_children()]), flush=True)
        while True:
            next(g)
""")


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_keyboard_interrupt_leaves_no_worker_processes(data, tmp_path):
    root, _ = data
    script = tmp_path / "interrupt.py"
    script.write_text(INTERRUPT_SCRIPT.format(tests=os.path.dirname(__file__), root=root))
    # a test runner's worker process (pytest-xdist) may ignore SIGINT, and a child inherits an
    # ignored signal: Python then installs no KeyboardInterrupt handler. Ctrl-C's default restored
    p = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    pids = json.loads(p.stdout.readline())
    assert pids, "the loader should have started worker processes"
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert "KeyboardInterrupt" in err
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if _alive(pid)]


def test_externally_killed_worker_surfaces_promptly_and_cleans_up(data):
    import multiprocessing

    from zephon import PipelineError
    from zephon.engine.testing import _threads, assert_no_leaks

    root, _ = data
    before = _threads()
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    earlier = {p.pid for p in multiprocessing.active_children()}  # (another test's, still exiting)
    g = recipe(root).global_loader(2, workers=WorkerConfig(2, "process"))
    next(g)
    victims = [p for p in multiprocessing.active_children() if p.pid not in earlier]
    assert victims
    os.kill(victims[0].pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(PipelineError, match="worker process died"):
        for _ in range(10_000):
            next(g)
    detected = time.monotonic() - t0
    assert detected < 30
    t1 = time.monotonic()
    g.close()
    assert_no_leaks(before)
    print(f"killed worker detected in {detected:.2f} s, cleaned up in {time.monotonic() - t1:.2f} s")
    if os.path.isdir("/dev/shm"):
        # (other processes on the machine may create segments meanwhile: only ours count)
        ours = {n for n in set(os.listdir("/dev/shm")) - shm_before if str(os.getpid()) in n}
        assert not ours, f"shared-memory segments left behind: {ours}"


def test_a_lost_worker_is_seen_without_the_executor():
    """The consumer's own check (WorkerPool.lost_workers, polled while it waits for a result)
    finds a killed worker whatever the executor's management thread has noticed."""
    pool = WorkerPool(WorkerConfig(1, "process", shm_mb=0))
    try:
        assert pool.submit(os.getpid).result(timeout=60) != os.getpid()
        assert pool.lost_workers() == []
        (pid,) = list(pool.executor._processes)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while pid not in pool.lost_workers() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pid in pool.lost_workers()
    finally:
        pool.close()
    assert pool.lost_workers() == []


def test_skip_counter_and_work_source_restore_at_every_step(data):
    from zephon.engine import OrderedMapper
    from zephon.engine.testing import check_node
    from zephon.nodes import SkipCounter
    from zephon.nodes.worksource import LaneWorkSource

    root, _ = data
    r = recipe(root)
    p = r.prepare()
    check_node(lambda: LaneWorkSource(p.plan, 1), max_steps=120)

    def make(lane):
        node = OrderedMapper(LaneWorkSource(p.plan, lane), batch_fn=p.pipeline, chunk_size=5)
        return SkipCounter(node, dataset_names=["web", "code"], lanes=r.lanes)

    def first_skip(lane):  # outputs before the lane's first skipped record (the order decides)
        node = make(lane)
        try:
            for i in range(60):
                next(node)
                if sum(node.state_dict()["skipped"]):
                    return i
            return 60
        finally:
            node.close()

    lane = min(range(r.lanes), key=first_skip)
    res = check_node(lambda: make(lane), max_steps=60, every=2)
    assert res.steps == 60
    # the counts are part of the state, and some records were skipped along the way
    assert sum(res.states[-1]["skipped"]) > 0
