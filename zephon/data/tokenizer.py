"""The tokenizer handle used by the pipeline.

:class:`TextTokenizer` wraps a Hugging Face ``tokenizers.Tokenizer`` and adds the loader's
BOS/EOS policy. Its hot call, :meth:`TextTokenizer.encode_batch`, makes one call into Rust per
batch (``Tokenizer.encode_batch_fast``: no offsets, ``add_special_tokens=False``), which
releases the GIL, so several Python threads tokenize in parallel. BOS/EOS ids are added here,
not by the tokenizer's post-processor, so the policy is the loader's and is part of the
fingerprint.

Threads: ``tokenizers`` also parallelizes *inside* one ``encode_batch_fast`` call on its own
global Rayon pool unless ``TOKENIZERS_PARALLELISM=false``. Output ids never depend on it, but
CPU use does: measured here, two Python threads calling ``encode_batch`` scale ~2x only with
that parallelism off (each call then runs on its calling thread); with it on, all calls share
one Rayon pool (and with ``RAYON_NUM_THREADS=1`` they serialize). A pipeline that runs its own
tokenizer threads should call :func:`set_tokenizers_parallelism(False)` (read at each call, so
it works after import). After a ``fork`` that follows parallel use, ``tokenizers`` turns its
parallelism off in the child.

Pickling keeps only the path, the flags and a few small fields; a process worker reloads the
tokenizer lazily on first use and checks that the file still has the same fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "BOS_CANDIDATES",
    "BUNDLED_TOKENIZER",
    "EOS_CANDIDATES",
    "PAD_CANDIDATES",
    "TextTokenizer",
    "set_tokenizers_parallelism",
]

#: the small byte-level BPE (vocab 4096) the repo ships for the demo and the tests
#: (``scripts/make_tokenizer.py`` rebuilds it); real runs point a recipe at their own tokenizer
BUNDLED_TOKENIZER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "tokenizer")

# Fallback names, tried in order when tokenizer_config.json names no token.
BOS_CANDIDATES = ("<|bos|>", "<s>", "<|begin_of_text|>", "<|startoftext|>", "<bos>", "[BOS]", "<|endoftext|>")
EOS_CANDIDATES = ("<|eos|>", "</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "[EOS]", "<|im_end|>")
PAD_CANDIDATES = ("<|pad|>", "<pad>", "[PAD]", "<|padding|>")

_EXPECTED = (
    "tokenizer.json (optionally with tokenizer_config.json naming bos_token/eos_token), "
    "or a folder that transformers.AutoTokenizer can load with a fast tokenizer"
)


#: the largest tokenizer.json read (the largest published ones are tens of MB); checked before reading
MAX_TOKENIZER_BYTES = 512 << 20
#: the largest tokenizer_config.json read
MAX_CONFIG_BYTES = 16 << 20


def _read_file(path: str, limit: int, what: str) -> bytes:
    """A small file's bytes, its type and size checked first: a FIFO would block, a 2 GB (or
    sparse) file would be read whole before the parser refused it."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{what} {path!r} is not a regular file (a FIFO, socket or device); point at the file")
    if st.st_size > limit:
        raise ValueError(
            f"{what} {path!r} is {st.st_size} bytes, more than any {what} ({limit}); is it the right file?"
        )
    with open(path, "rb") as f:
        return f.read(limit + 1)


def set_tokenizers_parallelism(enabled: bool) -> None:
    """Turn the ``tokenizers`` library's internal (Rayon) parallelism on or off for this process
    (it reads ``TOKENIZERS_PARALLELISM`` at every call). Turn it off when the pipeline runs its
    own tokenizer threads, so N threads use N cores and nothing else."""
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if enabled else "false"


def _word_of_id(tok: Any, tid: int, name: str, opted_in: bool = False) -> str | None:
    """An ordinary word with the id ``tid`` of the special token ``name``: a word of the model's
    own vocabulary with that id (but ``name``, which a model vocabulary may list too), or ``name``
    itself when plain text encodes to it (unless ``opted_in``: ``special_tokens_in_text``, where
    the token's own text is meant to give its id); None when only the special token reaches it."""
    for w, i in tok.get_vocab(with_added_tokens=False).items():
        if i == tid and w != name:
            try:
                return str(tok.decoder.decode([w])) if tok.decoder is not None else w
            except Exception:  # a decoder that cannot decode a lone piece: the piece's own spelling
                return w
    return name if not opted_in and tok.encode(name, add_special_tokens=False).ids == [tid] else None


def _token_content(v: Any) -> str | None:
    """tokenizer_config.json stores tokens as "<s>" or {"content": "<s>", ...}."""
    if v is None:
        return None
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


class TextTokenizer:
    """A picklable, thread-safe tokenizer handle with a BOS/EOS policy.

    Args:
        path: a folder holding ``tokenizer.json`` (and optionally ``tokenizer_config.json``),
            the ``tokenizer.json`` file itself (a sibling ``tokenizer_config.json`` is read if
            present), or a folder that ``transformers.AutoTokenizer`` loads offline with a fast
            tokenizer (used when there is no ``tokenizer.json``).
        add_bos, add_eos: put ``bos_id`` before / ``eos_id`` after every document.
        bos_token, eos_token: name the special tokens explicitly (override the config).
        special_tokens_in_text: False (the default): the text of a special token inside a
            document, e.g. ``<|eos|>``, is encoded as plain text (``Tokenizer.encode_special_tokens``),
            so raw documents cannot forge document boundaries or image placeholders. True (the
            Hugging Face behaviour, an explicit opt-in: ``[tokenizer] special_tokens_in_text =
            true``) gives such text the special token's id. Part of the fingerprint.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        add_bos: bool = True,
        add_eos: bool = True,
        bos_token: str | None = None,
        eos_token: str | None = None,
        special_tokens_in_text: bool = False,
    ) -> None:
        self.path = os.fspath(path)
        self.special_tokens_in_text = bool(special_tokens_in_text)
        self.add_bos = bool(add_bos)
        self.add_eos = bool(add_eos)
        self._bos_token_arg = bos_token
        self._eos_token_arg = eos_token
        self._lock = threading.Lock()
        tok, config, source = self._load()
        if not self.special_tokens_in_text:
            if not hasattr(tok, "encode_special_tokens"):
                raise ValueError(
                    "special_tokens_in_text=False needs tokenizers >= 0.15 (Tokenizer.encode_special_tokens)"
                )
            tok.encode_special_tokens = True
        self._tok = tok
        self.source = source  # "tokenizer.json" or "AutoTokenizer"
        self._resolve_special(tok, config)
        self._check_forgeable(tok)
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
        self.fingerprint = self._fingerprint(tok)
        #: the tokenizer's identity: a hash of its content alone (not the BOS/EOS policy), which
        #: data version 4 puts in the data definition (a fork or resume under another is refused)
        self.identity = hashlib.sha256(self._json_bytes).hexdigest()[:16]
        self._fast = hasattr(tok, "encode_batch_fast")

    # ------------------------------------------------------------------ loading
    def _load(self):
        from tokenizers import Tokenizer

        p = self.path
        if not os.path.exists(p):
            raise FileNotFoundError(f"tokenizer path {p!r} does not exist; expected {_EXPECTED}")
        if os.path.isdir(p):
            tj = os.path.join(p, "tokenizer.json")
            cfg_path = os.path.join(p, "tokenizer_config.json")
        else:
            tj = p
            cfg_path = os.path.join(os.path.dirname(os.path.abspath(p)), "tokenizer_config.json")

        config: dict = {}
        if os.path.isfile(cfg_path):
            try:
                config = json.loads(_read_file(cfg_path, MAX_CONFIG_BYTES, "tokenizer config").decode("utf-8"))
            except (OSError, ValueError) as e:
                raise ValueError(f"cannot read tokenizer config {cfg_path!r}: {e}") from e
            if not isinstance(config, dict):
                raise ValueError(f"tokenizer config {cfg_path!r} is not a JSON object")

        if os.path.exists(tj) and not os.path.isdir(tj):
            raw = _read_file(tj, MAX_TOKENIZER_BYTES, "tokenizer file")
            try:
                tok = Tokenizer.from_str(raw.decode("utf-8"))
            except Exception as e:  # tokenizers raises a plain Exception on bad JSON
                raise ValueError(
                    f"cannot load tokenizer file {tj!r} with tokenizers.Tokenizer: {e}; expected {_EXPECTED}"
                ) from e
            self._json_bytes = raw
            return tok, config, "tokenizer.json"

        # no tokenizer.json: try transformers.AutoTokenizer, offline
        if not os.path.isdir(p):
            raise ValueError(f"{p!r} is not a tokenizer.json file nor a folder; expected {_EXPECTED}")
        listing = sorted(os.listdir(p))
        if not any(os.path.isfile(os.path.join(p, f)) for f in listing):
            raise FileNotFoundError(
                f"no tokenizer.json in {p!r} (the folder has no files: {listing}); expected {_EXPECTED}"
            )
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise FileNotFoundError(
                f"no tokenizer.json in {p!r} (found {listing}), and transformers is "
                f"not installed to try AutoTokenizer; expected {_EXPECTED}"
            ) from e
        try:
            hf = AutoTokenizer.from_pretrained(p, local_files_only=True)
        except Exception as e:
            why = " ".join(str(e).split())
            raise FileNotFoundError(
                f"no tokenizer.json in {p!r} (found {listing}); expected {_EXPECTED}. "
                f"transformers.AutoTokenizer could not load it offline either: {why}"
            ) from e
        backend = getattr(hf, "backend_tokenizer", None)
        if not getattr(hf, "is_fast", False) or backend is None:
            raise ValueError(
                f"{p!r} loads as a slow (Python) tokenizer {type(hf).__name__}; zephon needs a fast "
                "tokenizer: save one with tokenizer.json (e.g. PreTrainedTokenizerFast.save_pretrained)"
            )
        tok = Tokenizer.from_str(backend.to_str())  # a private copy
        self._json_bytes = backend.to_str().encode("utf-8")
        cfg = dict(config)
        for key in ("bos_token", "eos_token", "pad_token"):
            if cfg.get(key) is None and getattr(hf, key, None) is not None:
                cfg[key] = str(getattr(hf, key))
        return tok, cfg, "AutoTokenizer"

    def _resolve_special(self, tok, config: dict) -> None:
        def resolve(kind: str, explicit: str | None, cands: Sequence[str]) -> tuple[str | None, int | None]:
            name = explicit if explicit is not None else _token_content(config.get(f"{kind}_token"))
            if name is not None:
                tid = tok.token_to_id(name)
                if tid is None:
                    raise ValueError(
                        f"{kind}_token {name!r} (from {'the argument' if explicit is not None else 'tokenizer_config.json'}) "
                        f"is not in the vocabulary of {self.path!r}"
                    )
                return name, int(tid)
            for c in cands:
                tid = tok.token_to_id(c)
                if tid is not None:
                    return c, int(tid)
            return None, None

        self.bos_token, self.bos_id = resolve("bos", self._bos_token_arg, BOS_CANDIDATES)
        self.eos_token, self.eos_id = resolve("eos", self._eos_token_arg, EOS_CANDIDATES)
        self.pad_token, self.pad_id = resolve("pad", None, PAD_CANDIDATES)
        for kind, want, tid, cands in (
            ("bos", self.add_bos, self.bos_id, BOS_CANDIDATES),
            ("eos", self.add_eos, self.eos_id, EOS_CANDIDATES),
        ):
            if want and tid is None:
                raise ValueError(
                    f"add_{kind}=True but the tokenizer at {self.path!r} has no {kind.upper()} token "
                    f"(no {kind}_token in tokenizer_config.json and none of {list(cands)} in the "
                    f"vocabulary). Fix: set add_{kind} = false, or name the token "
                    f'({kind}_token=... here, or "{kind}_token" in tokenizer_config.json)'
                )

    def _check_forgeable(self, tok) -> None:
        """Refuse a BOS or EOS id that plain text encodes to: a tokenizer whose EOS is an ordinary
        vocabulary word (not an added special token), or whose EOS id is also a word's id, lets a
        document forge a document boundary."""
        for kind, name, tid, used in (
            ("BOS", self.bos_token, self.bos_id, self.add_bos),
            ("EOS", self.eos_token, self.eos_id, self.add_eos),
        ):
            if not used or name is None or tid is None:
                continue
            word = _word_of_id(tok, tid, name, self.special_tokens_in_text)
            if word is not None:
                raise ValueError(
                    f"the {kind} id {tid} ({name!r}) of the tokenizer at {self.path!r} is also the id of the "
                    f"ordinary vocabulary word {word!r}: plain text {word!r} in a document would be "
                    f"indistinguishable from a document boundary. Fix: use a tokenizer whose {kind} is "
                    f"an added special token with an id of its own (tokenizer.json 'added_tokens' with \"special\": "
                    f"true), name another with {kind.lower()}_token, or set add_{kind.lower()} = false"
                )

    def fingerprint_with(self, special_tokens_in_text: bool) -> str:
        """The fingerprint this tokenizer would have with the other special-token policy (to tell
        a user which setting a checkpoint was written with)."""
        return self._fingerprint(None, special_tokens_in_text)

    def _fingerprint(self, tok, special_tokens_in_text: bool | None = None) -> str:
        h = hashlib.sha256(self._json_bytes)
        if special_tokens_in_text is None:
            special_tokens_in_text = self.special_tokens_in_text
        policy = {
            "add_bos": self.add_bos,
            "add_eos": self.add_eos,
            "special_tokens_in_text": special_tokens_in_text,
            "bos_id": self.bos_id if self.add_bos else None,
            "eos_id": self.eos_id if self.add_eos else None,
        }
        h.update(b"\x00zephon.tokenizer\x00")
        h.update(json.dumps(policy, sort_keys=True).encode("utf-8"))
        return h.hexdigest()

    # ------------------------------------------------------------------ pickling
    _STATE_KEYS = (
        "path",
        "add_bos",
        "add_eos",
        "_bos_token_arg",
        "_eos_token_arg",
        "special_tokens_in_text",
        "source",
        "bos_token",
        "bos_id",
        "eos_token",
        "eos_id",
        "pad_token",
        "pad_id",
        "vocab_size",
        "fingerprint",
        "identity",
    )

    def __getstate__(self) -> dict:
        return {k: getattr(self, k) for k in self._STATE_KEYS}

    def __setstate__(self, state: dict) -> None:
        for k in self._STATE_KEYS:
            setattr(self, k, state[k])
        self._lock = threading.Lock()
        self._tok = None  # reloaded lazily in this process

    def _tokenizer(self):
        tok = self._tok
        if tok is not None:
            return tok
        with self._lock:
            if self._tok is None:
                fp = self.fingerprint
                fresh = TextTokenizer(
                    self.path,
                    self.add_bos,
                    self.add_eos,
                    self._bos_token_arg,
                    self._eos_token_arg,
                    self.special_tokens_in_text,
                )
                if fresh.fingerprint != fp:
                    raise ValueError(
                        f"tokenizer at {self.path!r} changed since this handle was created "
                        f"(fingerprint {fresh.fingerprint[:12]} != {fp[:12]})"
                    )
                self._fast = fresh._fast
                self._json_bytes = fresh._json_bytes
                self._tok = fresh._tok
            return self._tok

    # ------------------------------------------------------------------ encoding
    def _encodings(self, texts: list[str]):
        tok = self._tokenizer()
        if not isinstance(texts, list):
            texts = list(texts)
        if self._fast:
            return tok.encode_batch_fast(texts, add_special_tokens=False)
        return tok.encode_batch(texts, add_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text as int32 arrays, with BOS/EOS added per the policy.

        One Rust call for the whole batch (the GIL is released inside it); thread-safe.
        """
        encs = self._encodings(texts)
        lead = 1 if self.add_bos else 0
        extra = lead + (1 if self.add_eos else 0)
        bos, eos = self.bos_id or 0, self.eos_id or 0  # set whenever add_bos / add_eos is (checked at load)
        out = []
        for e in encs:
            ids = e.ids
            if extra == 0:
                out.append(np.array(ids, dtype=np.int32))
                continue
            n = len(ids)
            a = np.empty(n + extra, dtype=np.int32)
            a[lead : lead + n] = ids
            if lead:
                a[0] = bos
            if self.add_eos:
                a[-1] = eos
            out.append(a)
        return out

    def encode_content(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text as int32 arrays, without BOS/EOS: the pieces of a sample that
        the caller lays out itself (captions between vision blocks, token estimation)."""
        return [np.asarray(e.ids, dtype=np.int32) for e in self._encodings(texts)]

    def content_offsets(self, text: str) -> list[tuple[int, int]]:
        """The character span of each content token of ``text`` (no BOS/EOS), in token order:
        provenance maps a token range back to the characters and bytes it covers."""
        return [tuple(o) for o in self._tokenizer().encode(text, add_special_tokens=False).offsets]

    def encode(self, text: str) -> np.ndarray:
        """One text; same as ``encode_batch([text])[0]`` (prefer batches on hot paths)."""
        return self.encode_batch([text])[0]

    def count_tokens(self, texts: list[str]) -> int:
        """Total tokens of ``texts``, BOS/EOS included: ``sum(map(len, encode_batch(texts)))``."""
        encs = self._encodings(texts)
        per_doc = (1 if self.add_bos else 0) + (1 if self.add_eos else 0)
        return sum(len(e) for e in encs) + per_doc * len(encs)

    def decode(self, ids: Iterable[int] | np.ndarray, skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (special tokens kept unless ``skip_special_tokens``)."""
        if isinstance(ids, np.ndarray):
            ids = ids.astype(np.int64, copy=False).tolist()
        else:
            ids = [int(i) for i in ids]
        return self._tokenizer().decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of ``token`` in the vocabulary, or None."""
        return self._tokenizer().token_to_id(token)

    def __repr__(self) -> str:
        return (
            f"TextTokenizer({self.path!r}, add_bos={self.add_bos}, add_eos={self.add_eos}, "
            f"vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id}, "
            f"fingerprint={self.fingerprint[:12]})"
        )
