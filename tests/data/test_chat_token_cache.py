"""The token cache holds conversations too (issue 35): a chat dataset's rendered ids and assistant
turns are kept, keyed by the renderer (tokenizer file, template, its special tokens) and how a
record is read as a conversation (format, system prompt, roles); what is applied after (loss_on,
the long policy) shares the entries. Batches are byte-identical cold, warm, corrupted, with
inline, thread and process workers, W = 1, 2, 4, with bad records skipped, in a mix with text;
a warm run renders nothing; ``zephon warm`` fills what the loader reads."""

from __future__ import annotations

import copy
import os

import pytest
from compose_fixtures import base_config, with_skips, write_compose_root
from text_fixtures import use_token_cache_folder

from zephon import Recipe, WorkerConfig, batch_sha256
from zephon.data import token_cache
from zephon.data.chat import ChatRenderer
from zephon.data.datasets import tokencache as tc
from zephon.recipe.warm import warm_local, warm_share

pytestmark = pytest.mark.filterwarnings("ignore::zephon.recipe.BadSamplesWarning")

STEPS = 5


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return write_compose_root(str(tmp_path_factory.mktemp("chatcache")))


@pytest.fixture
def folder(tmp_path, monkeypatch):
    return use_token_cache_folder(tmp_path, monkeypatch)


@pytest.fixture
def renders(monkeypatch):
    """Conversations rendered in this process (inline and thread workers)."""
    got = {"n": 0}
    encode = ChatRenderer.encode

    def counted(self, conv):
        got["n"] += 1
        return encode(self, conv)

    monkeypatch.setattr(ChatRenderer, "encode", counted)
    return got


def hashes(
    cfg: dict, root: str, world: int = 1, workers: WorkerConfig = WorkerConfig(0), renders: dict | None = None
) -> list[str]:
    """The run's batch hashes; ``renders``: counted from the loader's start (prepare's token
    estimates render a seeded sample of conversations in every run, as text's tokenize one)."""
    r = Recipe.from_dict(copy.deepcopy(cfg), root)
    r.prepare()
    if renders is not None:  # counted from here: what the loader renders and misses
        renders["n"] = 0
        renders["misses"] = token_cache().stats["misses"] if token_cache() is not None else 0
    with r.global_loader(world, workers=workers, prefetch=0) as g:
        out = [batch_sha256(next(g)) for _ in range(STEPS)]
    cache = token_cache()
    if cache is not None:
        cache.flush()
    return out


def uncached(cfg: dict, root: str) -> list[str]:
    env = os.environ.pop(tc.ENV_DIR, None)
    try:
        return hashes(cfg, root)
    finally:
        if env is not None:
            os.environ[tc.ENV_DIR] = env


@pytest.mark.parametrize("kind", ["chat", "mix"])
def test_chat_batches_are_the_same_cold_and_warm_and_a_warm_run_renders_nothing(root, folder, renders, kind):
    cfg = base_config(kind, root)
    want = uncached(cfg, root)
    assert hashes(cfg, root) == want  # cold
    assert token_cache().stats["written"] > 0
    assert hashes(cfg, root, renders=renders) == want  # warm, the same run
    assert renders["n"] == 0 and token_cache().stats["misses"] == renders["misses"]  # nothing rendered or tokenized
    assert hashes(cfg, root, 2, WorkerConfig(2, "thread")) == want
    assert hashes(cfg, root, 4, WorkerConfig(2, "process")) == want


@pytest.mark.parametrize(
    "change",
    [
        {"system_prompt": "You are terse."},
        {"chat_template": "plain"},
        {"roles": {"human": "user"}},
    ],
    ids=["system_prompt", "template", "roles"],
)
def test_what_changes_the_ids_never_reads_a_stale_entry(root, folder, change):
    cfg = base_config("chat", root)
    hashes(cfg, root)  # warm for the recipe as it is
    other = copy.deepcopy(cfg)
    for d in other["datasets"]:
        d.update(change)
    want = uncached(other, root)
    hits = token_cache().stats["hits"]
    assert hashes(other, root) == want
    assert token_cache().stats["hits"] == hits  # none of the first recipe's entries was read


@pytest.mark.parametrize("change", [{"loss_on": "last"}, {"long": "drop"}], ids=["loss_on", "long"])
def test_what_applies_after_rendering_shares_the_entries(root, folder, renders, change):
    cfg = base_config("chat", root)
    hashes(cfg, root)
    other = copy.deepcopy(cfg)
    for d in other["datasets"]:
        d.update(change)
    want = uncached(other, root)
    assert hashes(other, root, renders=renders) == want
    assert renders["n"] == 0  # the ablation read every conversation's ids and turns from the cache


def test_corrupt_chat_entries_are_rendered_again_and_replaced(root, folder):
    cfg = base_config("chat", root)
    want = uncached(cfg, root)
    hashes(cfg, root)
    for dirpath, _, names in os.walk(folder / "blocks"):
        for n in names:  # flip the last byte of every block (the last entry's turns)
            with open(os.path.join(dirpath, n), "r+b") as f:
                f.seek(-1, 2)
                last = f.read(1)
                f.seek(-1, 2)
                f.write(bytes([last[0] ^ 0xFF]))
    tc._CACHES.clear()  # a fresh process's view
    assert hashes(cfg, root, 2, WorkerConfig(2, "thread")) == want
    assert token_cache().stats["corrupt"] > 0


def test_skipped_conversations_are_skipped_alike_warm(root, folder):
    cfg = base_config("chat", root)
    with_skips(cfg, "chat")
    want = uncached(cfg, root)
    assert hashes(cfg, root) == want
    assert hashes(cfg, root, 2, WorkerConfig(2, "thread")) == want


def test_zephon_warm_fills_the_conversations_the_loader_reads(root, folder, renders):
    cfg = base_config("mix", root)
    want = uncached(cfg, root)
    r = Recipe.from_dict(copy.deepcopy(cfg), root)
    counts = warm_local(r, threads=2)
    assert counts["tokenized"] > 0
    held, planned = warm_share(Recipe.from_dict(copy.deepcopy(cfg), root), STEPS)
    assert held == planned > 0
    assert hashes(cfg, root, renders=renders) == want
    assert renders["n"] == 0 and token_cache().stats["misses"] == renders["misses"]
    assert warm_local(Recipe.from_dict(copy.deepcopy(cfg), root))["tokenized"] == 0  # idempotent


def test_a_warm_cache_gives_the_chat_token_estimates_without_rendering(root, folder, renders):
    cfg = base_config("chat", root)
    env = os.environ.pop(tc.ENV_DIR)
    try:
        want = Recipe.from_dict(copy.deepcopy(cfg), root).prepare().estimates
    finally:
        os.environ[tc.ENV_DIR] = env
    warm_local(Recipe.from_dict(copy.deepcopy(cfg), root))
    renders["n"] = 0
    assert Recipe.from_dict(copy.deepcopy(cfg), root).prepare().estimates == want
    assert renders["n"] == 0
