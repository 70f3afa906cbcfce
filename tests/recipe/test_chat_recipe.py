"""Chat recipes end to end: labels only on assistant tokens (checked against transformers on the
records each row's provenance names), conversations whole in a row, the same bytes on every
world size, worker mode and resume, long conversations and bad records counted, token shares."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

from zephon import Recipe, WorkerConfig, batch_sha256
from zephon.data import DataError
from zephon.data.chat import CHAT_TOKENIZER, SHAREGPT_ROLES, load_chat_template
from zephon.nodes import provenance_entry, row_spans
from zephon.recipe import RecipeError
from zephon.recipe.chat import realized_shares
from zephon.tools.chat_demo import write_chat_recipe

transformers = pytest.importorskip("transformers")
pq = pytest.importorskip("pyarrow.parquet")

STEPS = 6


@pytest.fixture(scope="module")
def hf():
    return transformers.AutoTokenizer.from_pretrained(CHAT_TOKENIZER)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def recipe_path(root):
    return write_chat_recipe(os.path.join(root, "all"), seq_len=256)


def _batches(path, steps=STEPS, world=1, workers=None, **kw):
    r = Recipe.from_toml(path)
    with r.global_loader(world_size=world, workers=workers, **kw) as g:
        return r, [next(g) for _ in range(steps)]


def _record(r, d, shard, record):
    """The conversation of a record, read with json / pyarrow from where the index says it is."""
    where = r.indexes[d].locate(shard, record)
    kind, n = where["locator"].split()
    if kind == "line":
        with open(where["file"], encoding="utf-8") as f:
            return json.loads(f.read().splitlines()[int(n) - 1])["messages"]
    row = pq.read_table(where["file"]).column("conversations")[int(n)].as_py()
    msgs = [{"role": SHAREGPT_ROLES[m["from"]], "content": m["value"]} for m in row]
    if msgs[0]["role"] == "system":
        return msgs
    return [{"role": "system", "content": "You are a helpful assistant."}, *msgs]


def _reference(hf, conv, loss_on):
    """transformers' tokens and assistant mask from the marked ChatML template (the sharegpt
    dataset's; the messages dataset uses the tokenizer's own unmarked ChatML, which renders the
    same text), the last turn only with loss_on = "last"."""
    tpl = load_chat_template("chatml_generation", CHAT_TOKENIZER)
    out = hf.apply_chat_template(conv, chat_template=tpl, return_dict=True, return_assistant_tokens_mask=True)
    mask = np.asarray(out["assistant_masks"], bool)
    if loss_on == "last":
        run = np.flatnonzero(mask)
        start = run[np.flatnonzero(np.diff(run) > 1)[-1] + 1] if (np.diff(run) > 1).any() else run[0]
        mask[:start] = False
    return np.asarray(out["input_ids"]), mask


def _check_rows(r, batches, hf, loss_on="all"):
    """Every label of every row against the reference: a chat segment's target is supervised iff
    it is an assistant token of a selected turn; a text segment's targets are all its next tokens."""
    chat_ds = {i for i, s in enumerate(r.datasets) if s.kind == "chat"}
    supervised = assistant = 0
    for b in batches:
        for row in range(b["input"].shape[0]):
            labels = b["labels"][row]
            tokens = np.append(b["input"][row], labels[-1])  # the row's last token is only a label
            spans = row_spans(b["provenance"][row])
            assert len(set(b["document_ids"][row][b["document_ids"][row] >= 0])) == len(
                [s for s in spans if s[0] < len(labels)]
            )
            for entry, (lo, hi) in zip(b["provenance"][row], spans):
                p = provenance_entry(entry)
                want = np.full(hi - lo, -100)
                if p.dataset in chat_ds:
                    assert (p.tok_start, hi - lo) == (0, hi - lo)  # whole from its start: never split
                    ids, mask = _reference(hf, _record(r, p.dataset, p.shard, p.record), loss_on)
                    n = hi - lo
                    assert tokens[lo:hi][: len(labels) - lo].tolist() == ids[:n][: len(labels) - lo].tolist()
                    want[:-1] = np.where(mask[1:n], ids[1:n], -100)
                    assistant += int(mask[1:n].sum())
                else:
                    want[:-1] = tokens[lo + 1 : hi]
                got = labels[lo : min(hi, len(labels))]
                assert got.tolist() == want[: len(got)].tolist(), (row, p)
                if p.dataset in chat_ds:
                    supervised += int((got != -100).sum())
            assert (labels[spans[-1][1] :] == -100).all()  # padding
    return supervised, assistant


def test_labels_are_exactly_the_assistant_tokens(recipe_path, hf):
    r, batches = _batches(recipe_path)
    sup, asst = _check_rows(r, batches, hf)
    assert sup > 1000 and sup <= asst  # a row-final token has no target in its row
    assert asst - sup <= sum(b["input"].shape[0] for b in batches)


def test_last_turn_only(root, hf):
    path = write_chat_recipe(os.path.join(root, "last"), loss_on="last")
    r, batches = _batches(path, steps=3)
    # the sharegpt dataset keeps loss_on = "all"; the messages one trains on its last turn only
    chat = r.datasets[0]
    assert chat.loss_on == "last"
    r.spec = dataclasses.replace(r.spec)  # unchanged; the check reads each dataset's own setting
    for b in batches:
        for row in range(b["input"].shape[0]):
            for entry, (lo, hi) in zip(b["provenance"][row], row_spans(b["provenance"][row])):
                p = provenance_entry(entry)
                if p.dataset != 0:
                    continue
                ids, mask = _reference(hf, _record(r, 0, p.shard, p.record), "last")
                got = b["labels"][row][lo : hi - 1]
                assert got.tolist() == np.where(mask[1 : hi - lo], ids[1 : hi - lo], -100).tolist()


def test_same_batches_on_every_world_size_worker_mode_and_resume(recipe_path):
    _, ref = _batches(recipe_path, steps=STEPS)
    want = [batch_sha256(b) for b in ref]
    for world, workers in [(2, WorkerConfig(2, "thread")), (4, WorkerConfig(2, "process")), (1, WorkerConfig(0))]:
        _, got = _batches(recipe_path, steps=STEPS, world=world, workers=workers)
        assert [batch_sha256(b) for b in got] == want, (world, workers)
    r = Recipe.from_toml(recipe_path)
    with r.global_loader(world_size=4) as g:
        first = [batch_sha256(next(g)) for _ in range(2)]
        state = json.loads(json.dumps(g.state_dict()))
    with r.global_loader(world_size=2, workers=WorkerConfig(2, "thread")) as g:
        g.load_state_dict(state)
        rest = [batch_sha256(next(g)) for _ in range(STEPS - 2)]
    assert first + rest == want


def test_long_conversations_follow_their_policy_and_are_counted(root):
    path = write_chat_recipe(os.path.join(root, "short"), seq_len=96, long="drop")
    r = Recipe.from_toml(path)
    router = r.router(world_size=1)
    batches = [next(router) for _ in range(4)]
    m = router.summary_metrics()
    skips = next(v for v in m.values() if v.get("node_type") == "skip_counter")
    pack = next(v for v in m.values() if v.get("node_type") == "chat_pack")
    assert skips["skipped"]["chat"] > 0  # "drop": counted skips, reason "conversation too long"
    assert pack["truncated"].get("truncate_turns", 0) > 0  # the sharegpt dataset cuts whole turns
    reasons = [c for c in router.lane_nodes[0].pipeline_metrics() if c.get("node_type") == "skip_counter"]
    router.close()
    assert "conversation too long" in json.dumps(reasons)
    for b in batches:  # still: a conversation is whole in its row, and only assistant tokens trained on
        for row in range(b["input"].shape[0]):
            for entry in b["provenance"][row]:
                p = provenance_entry(entry)
                if p.dataset < 2:
                    assert p.tok_start == 0 and p.tok_end <= 97


def test_bad_conversations_name_file_and_record_or_are_counted_skips(tmp_path):
    path = write_chat_recipe(str(tmp_path), weights=(1.0, 0.0, 0.0), conversations=40)
    shard = tmp_path / "chat" / "part-0.jsonl"
    lines = shard.read_text().splitlines()
    lines[3] = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]})
    lines[5] = json.dumps(
        {"messages": [{"role": "user", "content": "<|im_end|>"}, {"role": "assistant", "content": "x"}]}
    )
    shard.write_text("\n".join(lines) + "\n")
    r = Recipe.from_toml(path)
    with pytest.raises(DataError) as e, r.global_loader(world_size=1) as g:
        for _ in range(20):
            next(g)
    msg = str(e.value)
    assert "part-0.jsonl" in msg and ("line 4" in msg or "line 6" in msg) and 'on_error = "skip"' in msg
    text = open(path).read().replace('long = "drop"', 'long = "drop"\non_error = "skip"', 1)
    open(path, "w").write(text)
    r = Recipe.from_toml(path)
    router = r.router(world_size=1)
    for _ in range(20):
        next(router)
    skips = next(v for v in router.summary_metrics().values() if v.get("node_type") == "skip_counter")
    router.close()
    assert skips["skipped"]["chat"] >= 2


@pytest.mark.parametrize("count", ["all", "loss"])
def test_token_shares_count_all_or_loss_tokens(root, count):
    path = write_chat_recipe(os.path.join(root, f"mix-{count}"), count=count, weights=(0.4, 0.2, 0.4), seq_len=512)
    r, batches = _batches(path, steps=12, world=2)
    shares = realized_shares(batches, 3, count)
    assert np.abs(shares - np.array([0.4, 0.2, 0.4])).max() < 0.12, shares
    if count == "loss":  # counting all tokens instead would over-weigh chat (its prompts count)
        assert realized_shares(batches, 3, "all")[2] < shares[2]


def test_recipe_rules_and_fingerprint(root, tmp_path):
    base = open(write_chat_recipe(str(tmp_path))).read()
    greedy = base.replace('algorithm = "best_fit"', 'algorithm = "greedy"')
    (tmp_path / "g.toml").write_text(greedy)
    with pytest.raises(RecipeError, match="greedy.*cuts conversations"):
        Recipe.from_toml(str(tmp_path / "g.toml"))
    (tmp_path / "k.toml").write_text(base.replace('name = "web"', 'name = "web"\nloss_on = "last"'))
    with pytest.raises(RecipeError, match='loss_on only applies to kind = "chat"'):
        Recipe.from_toml(str(tmp_path / "k.toml"))
    (tmp_path / "t.toml").write_text(base.replace('chat_template = "chatml_generation"', 'chat_template = "chatml"'))
    a = Recipe.from_toml(str(tmp_path / "chat.toml")).fingerprint
    b = Recipe.from_toml(str(tmp_path / "t.toml")).fingerprint
    assert a != b  # the template is part of the data definition
