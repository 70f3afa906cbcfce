"""Tests for zephon.tokenizer.TextTokenizer and the bundled tokenizer."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import pickle
import shutil
import threading
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import numpy as np
import pytest
from tokenizers import Tokenizer

from zephon.data import BUNDLED_TOKENIZER
from zephon.data.tokenizer import TextTokenizer
from zephon.tools.synth import generate_documents

BUNDLED = BUNDLED_TOKENIZER
BUNDLED_JSON = os.path.join(BUNDLED, "tokenizer.json")


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return (
        generate_documents("web", 40, seed=3)
        + generate_documents("code", 30, seed=3)
        + generate_documents("books", 5, seed=3)
        + ["", " ", "\n\n", "caf\u00e9 \u00fcber \U0001f600 \u4e2d\u6587", "a" * 3000, "tab\there"]
    )


@pytest.fixture(scope="module")
def tt() -> TextTokenizer:
    return TextTokenizer(BUNDLED)


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a, b))


# ----------------------------------------------------------------------------- bundled files
def test_bundled_files():
    assert os.path.getsize(BUNDLED_JSON) < 1_000_000
    with open(os.path.join(BUNDLED, "tokenizer_config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == ("<|bos|>", "<|eos|>", "<|pad|>")
    raw = Tokenizer.from_file(BUNDLED_JSON)
    assert raw.get_vocab_size() == 4096
    assert [raw.token_to_id(t) for t in ("<|bos|>", "<|eos|>", "<|pad|>")] == [0, 1, 2]
    assert raw.encode("hello world").ids == raw.encode("hello world", add_special_tokens=False).ids


def test_load_folder_and_file(tt):
    f = TextTokenizer(BUNDLED_JSON)
    assert (tt.bos_id, tt.eos_id, tt.pad_id, tt.vocab_size) == (0, 1, 2, 4096)
    assert (f.bos_id, f.eos_id, f.pad_id, f.vocab_size) == (0, 1, 2, 4096)
    assert f.fingerprint == tt.fingerprint and len(tt.fingerprint) == 64
    assert tt.source == "tokenizer.json"
    assert "vocab_size=4096" in repr(tt)


def test_fingerprint_depends_on_policy_not_location(tmp_path, tt):
    fps = {TextTokenizer(BUNDLED, add_bos=b, add_eos=e).fingerprint for b in (0, 1) for e in (0, 1)}
    assert len(fps) == 4
    shutil.copytree(BUNDLED, tmp_path / "copy")
    assert TextTokenizer(tmp_path / "copy").fingerprint == tt.fingerprint
    assert TextTokenizer(BUNDLED, special_tokens_in_text=True).fingerprint != tt.fingerprint
    assert tt.fingerprint_with(True) == TextTokenizer(BUNDLED, special_tokens_in_text=True).fingerprint


# ----------------------------------------------------------------------------- encoding
@pytest.mark.parametrize("add_bos,add_eos", [(True, True), (True, False), (False, True), (False, False)])
def test_encode_batch_equals_per_doc_encode(docs, add_bos, add_eos):
    t = TextTokenizer(BUNDLED, add_bos=add_bos, add_eos=add_eos)
    raw = Tokenizer.from_file(BUNDLED_JSON)
    got = t.encode_batch(docs)
    assert len(got) == len(docs)
    for d, a in zip(docs, got):
        want = ([0] if add_bos else []) + raw.encode(d, add_special_tokens=False).ids + ([1] if add_eos else [])
        assert a.dtype == np.int32 and a.ndim == 1
        assert a.tolist() == want
    assert t.count_tokens(docs) == sum(len(a) for a in got)
    assert t.encode(docs[0]).tolist() == got[0].tolist()
    assert t.encode_batch([]) == [] and t.count_tokens([]) == 0


def test_fallback_without_encode_batch_fast(docs):
    a = TextTokenizer(BUNDLED)
    b = TextTokenizer(BUNDLED)
    b._fast = False  # as with a tokenizers version that lacks encode_batch_fast
    assert _same(a.encode_batch(docs), b.encode_batch(docs))


def test_decode_round_trip(tt, docs):
    for d, ids in zip(docs, tt.encode_batch(docs)):
        assert tt.decode(ids, skip_special_tokens=True) == d
        assert tt.decode(ids.tolist()) == "<|bos|>" + d + "<|eos|>"


def test_special_token_text_policy(tt):
    """Document text cannot forge special tokens unless the recipe opts in."""
    text = "before <|eos|> after"
    opted_in = TextTokenizer(BUNDLED, special_tokens_in_text=True)
    assert 1 in opted_in.encode(text)[1:-1].tolist()  # the Hugging Face behaviour: the text becomes the id
    safe = tt  # the default
    ids = safe.encode(text)
    assert ids[0] == 0 and ids[-1] == 1 and 1 not in ids[1:-1].tolist() and 0 not in ids[1:-1].tolist()
    assert safe.decode(ids, skip_special_tokens=True) == text
    safe2 = pickle.loads(pickle.dumps(safe))
    assert safe2.encode(text).tolist() == ids.tolist()


# ----------------------------------------------------------------------------- BOS/EOS policy
def _tiny_tokenizer_json(path, specials=()):
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=list(specials),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["hello world, hello there"] * 20, trainer=trainer)
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    return tok


def test_no_bos_token_gives_clear_error(tmp_path):
    _tiny_tokenizer_json(tmp_path / "t", specials=["</s>"])
    with pytest.raises(ValueError, match=r"add_bos=True.*no BOS token.*add_bos = false"):
        TextTokenizer(tmp_path / "t")
    t = TextTokenizer(tmp_path / "t", add_bos=False)
    assert t.bos_id is None and t.eos_id == 0  # </s> found by its common name
    assert t.encode("hello")[-1] == 0
    with pytest.raises(ValueError, match="not in the vocabulary"):
        TextTokenizer(tmp_path / "t", bos_token="<nope>")


def test_common_names_without_config(tmp_path):
    _tiny_tokenizer_json(tmp_path / "t", specials=["<pad>", "<s>", "</s>"])
    t = TextTokenizer(tmp_path / "t")
    assert (t.pad_id, t.bos_id, t.eos_id) == (0, 1, 2)
    assert (t.bos_token, t.eos_token) == ("<s>", "</s>")


def test_config_names_tokens(tmp_path):
    d = tmp_path / "t"
    shutil.copytree(BUNDLED, d)
    # dict form, as transformers writes AddedToken; swap roles to prove the config wins
    (d / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<|eos|>", "special": True}, "eos_token": "<|pad|>"})
    )
    t = TextTokenizer(d)
    assert (t.bos_id, t.eos_id) == (1, 2)
    assert TextTokenizer(d / "tokenizer.json").bos_id == 1  # sibling config read for a file path
    assert TextTokenizer(d, bos_token="<|bos|>").bos_id == 0  # explicit argument wins
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|nope|>"}))
    with pytest.raises(ValueError, match="nope.*tokenizer_config.json"):
        TextTokenizer(d)


# ----------------------------------------------------------------------------- errors
def test_missing_path_error(tmp_path):
    p = tmp_path / "no_such_dir"
    with pytest.raises(FileNotFoundError, match="no_such_dir.*tokenizer.json"):
        TextTokenizer(p)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty.*tokenizer.json"):
        TextTokenizer(tmp_path / "empty")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "readme.txt").write_text("not a tokenizer")
    with pytest.raises(FileNotFoundError, match="other.*readme.txt.*expected tokenizer.json.*AutoTokenizer"):
        TextTokenizer(tmp_path / "other")


def test_unreadable_file_error(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.*tokenizer.json"):
        TextTokenizer(bad)
    with pytest.raises(ValueError, match="tokenizer.json"):
        TextTokenizer(bad / "tokenizer.json")
    (bad / "tokenizer.json").write_text("{}")
    (bad / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        TextTokenizer(bad)


# ----------------------------------------------------------------------------- pickling, threads
def test_pickle_round_trip(tt, docs):
    blob = pickle.dumps(tt)
    assert len(blob) < 2000  # path + flags, not the vocabulary
    t2 = pickle.loads(blob)
    assert t2._tok is None  # reloaded lazily
    assert (t2.bos_id, t2.eos_id, t2.vocab_size, t2.fingerprint) == (
        tt.bos_id,
        tt.eos_id,
        tt.vocab_size,
        tt.fingerprint,
    )
    assert _same(t2.encode_batch(docs), tt.encode_batch(docs))
    assert t2.decode([0, 1]) == "<|bos|><|eos|>"


def test_pickle_detects_changed_file(tmp_path, docs):
    d = tmp_path / "t"
    shutil.copytree(BUNDLED, d)
    t = TextTokenizer(d)
    blob = pickle.dumps(t)
    Tokenizer.from_file(str(d / "tokenizer.json")).save(str(d / "tokenizer.json"), pretty=True)
    with pytest.raises(ValueError, match="changed"):
        pickle.loads(blob).encode_batch(docs[:2])


def test_process_worker_reloads(tt, docs):
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as ex:
        got = ex.submit(tt.encode_batch, docs).result(timeout=60)  # pickles the handle
    assert _same(got, tt.encode_batch(docs))


def test_thread_safety(docs):
    ref = TextTokenizer(BUNDLED).encode_batch(docs)
    # a fresh unpickled handle: the lazy load itself races between threads
    shared = pickle.loads(pickle.dumps(TextTokenizer(BUNDLED)))
    barrier = threading.Barrier(4)
    batches = [docs[i : i + 7] for i in range(0, len(docs), 7)]

    def work(k: int) -> list[np.ndarray]:
        barrier.wait()
        out: list[np.ndarray] = []
        for r in range(3):
            order = batches[k % 2 :: 2] + batches[1 - k % 2 :: 2] if r else batches
            res = {id(b): shared.encode_batch(b) for b in order}
            out = [a for b in batches for a in res[id(b)]]
        return out

    with ThreadPoolExecutor(4) as ex:
        results = list(ex.map(work, range(4)))
    for r in results:
        assert _same(r, ref)


# ----------------------------------------------------------------------------- transformers
def test_transformers_fast_tokenizer_agrees(docs):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=BUNDLED_JSON)
    t = TextTokenizer(BUNDLED, add_bos=False, add_eos=False)
    for d, a in zip(docs, t.encode_batch(docs)):
        assert hf(d, add_special_tokens=False)["input_ids"] == a.tolist()


def test_autotokenizer_loads_bundled_folder(docs, tt):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(BUNDLED, local_files_only=True)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (tt.bos_id, tt.eos_id, tt.pad_id)
    assert hf(docs[0], add_special_tokens=False)["input_ids"] == tt.encode(docs[0])[1:-1].tolist()


def test_autotokenizer_only_folder(tmp_path, docs, tt):
    """A folder without tokenizer.json (GPT-2 style vocab.json + merges.txt) goes through
    transformers.AutoTokenizer and its backend tokenizer."""
    d = tmp_path / "gpt2style"
    d.mkdir()
    Tokenizer.from_file(BUNDLED_JSON).model.save(str(d))
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "GPT2Tokenizer",
                "bos_token": "<|bos|>",
                "eos_token": "<|eos|>",
                "pad_token": "<|pad|>",
                "add_prefix_space": False,
            }
        )
    )
    assert not (d / "tokenizer.json").exists()
    t = TextTokenizer(d)
    assert t.source == "AutoTokenizer"
    assert (t.bos_id, t.eos_id, t.pad_id) == (0, 1, 2)
    assert _same(t.encode_batch(docs), tt.encode_batch(docs))
    t2 = pickle.loads(pickle.dumps(t))
    assert t2.fingerprint == t.fingerprint
    assert _same(t2.encode_batch(docs[:5]), tt.encode_batch(docs[:5]))


def test_set_tokenizers_parallelism(monkeypatch, tt, docs):
    from zephon.data.tokenizer import set_tokenizers_parallelism

    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")  # restored (or removed) at teardown
    ref = tt.encode_batch(docs)
    set_tokenizers_parallelism(False)
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"
    assert _same(tt.encode_batch(docs), ref)  # ids never depend on it
    set_tokenizers_parallelism(True)
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true"


# -- hostile or mistaken tokenizer files ---------------------------------------------------------
def _word_level(folder, special: bool) -> str:
    """A tokenizer whose EOS '</s>' is an ordinary vocabulary word (special=False) or an added
    special token (special=True)."""
    import json as _json

    from tokenizers import Tokenizer as _Tok
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    vocab = {"[UNK]": 0, "hello": 1} if special else {"[UNK]": 0, "hello": 1, "<s>": 2, "</s>": 3}
    tok = _Tok(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = WhitespaceSplit()
    if special:  # only added tokens: plain text never reaches their ids
        tok.add_special_tokens(["<s>", "</s>"])
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        _json.dump({"bos_token": "<s>", "eos_token": "</s>"}, f)
    return str(folder)


def test_an_eos_that_plain_text_can_forge_is_refused_naming_the_token(tmp_path):
    with pytest.raises(ValueError, match=r"BOS id 2 \('<s>'\) .* ordinary vocabulary word '<s>'.*Fix: use a tokenizer"):
        TextTokenizer(_word_level(tmp_path / "ordinary", special=False))
    import warnings as _w

    with _w.catch_warnings():
        _w.simplefilter("error")
        TextTokenizer(_word_level(tmp_path / "special", special=True))


def test_a_huge_sparse_tokenizer_file_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "tokenizer.json"
    with open(path, "wb") as f:
        f.truncate(2 << 30)  # 2 GiB, sparse: costs no disk
    with pytest.raises(ValueError, match="more than any tokenizer file"):
        TextTokenizer(str(path), add_bos=False, add_eos=False)


def test_a_fifo_as_tokenizer_is_refused_without_blocking(tmp_path):
    from fifo import refusal_of_fifo

    load = "from zephon.data import TextTokenizer; TextTokenizer(PATH)"
    assert "not a regular file" in refusal_of_fifo(str(tmp_path / "tokenizer.json"), load, "ValueError")
