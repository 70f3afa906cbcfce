"""Chat data: conversations rendered and masked (:class:`FetchChat`), packed whole (:class:`ChatPack`).

:class:`FetchChat` is the mapper's batch function of a recipe with chat datasets: a chat item's
record (its conversation as JSON text, read with ``text_mode = "json"``) is checked, rendered
with the dataset's chat template and tokenized whole (:class:`zephon.data.chat.ChatRenderer`);
its ``mask`` is True on the assistant tokens of the selected turns (``loss_on``). It is the chat
datasets' encoder in the recipe's :class:`~zephon.nodes.RecordPipeline`, beside the text
datasets' :class:`~zephon.nodes.FetchTokenize`, so chat and text mix in one lane; ``[[filters]]``
see a conversation as its template renders it, or as its record's JSON (:meth:`FetchChat.view`).

A conversation longer than a row (``seq_len + 1`` tokens) follows its dataset's ``long`` policy
(:data:`LONG`): ``"drop"`` it (a counted skip, reason "conversation too long"), ``"truncate"``
(keep the first row of tokens), ``"truncate_turns"`` (keep the conversation up to the last
assistant turn that ends within a row; none: dropped), or ``"split"`` (the packer may cut it
across rows). Truncations are counted in :class:`ChatPack`'s metrics; drops by the
:class:`SkipCounter` like any skip.

:class:`ChatPack` is :class:`Pack` whose ``labels`` are also ``-100`` where the target token is
not supervised (``mask`` False): with chat documents only assistant tokens are trained on.
``first_fit`` / ``best_fit`` never split a conversation that fits a row; ``greedy`` would, so it
is refused unless splitting is allowed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from torchdata.nodes import BaseNode

from zephon.data import BadRecord, ChatRenderer, ConversationError, DataError, ShardIndex
from zephon.data.chat import ROLES, ChatEncoding, parse_conversation, select_mask
from zephon.data.chatbounds import ChatTimeoutError
from zephon.data.datasets.tokencache import TokenCache, TokenEntry
from zephon.engine import ProcessLocal

from .pack import Pack
from .policy import policies, skip_hint
from .rows import IGNORE_INDEX
from .stages.pipeline import UnviewableError
from .tokencached import cache_setting, through_cache
from .worksource import WorkItem, read_items

__all__ = ["LONG", "ChatDoc", "ChatOptions", "ChatPack", "FetchChat", "chat_cache_settings", "fit_conversation"]

#: what happens to a conversation longer than a row (module doc)
LONG = ("drop", "truncate", "truncate_turns", "split")


class ChatDoc(NamedTuple):
    """A rendered conversation: ``tokens`` and ``mask`` (True: an assistant token trained on), or a
    skipped record (``tokens`` empty). ``truncated`` names the long policy that cut it."""

    tokens: np.ndarray
    dataset: int
    item: WorkItem
    skipped: str | None = None
    mask: np.ndarray | None = None
    truncated: str | None = None
    offset: int = 0
    text_part: bool = False
    cut: int = 0  # tokens a long policy cut from its end

    @property
    def provenance(self) -> str:
        """Where this record comes from, in words."""
        return self.item.provenance


@dataclass(frozen=True)
class ChatOptions:
    """One chat dataset's settings: record form, turns trained on, long policy, system prompt,
    its role mapping (``roles``, applied before every check) and whether its template's own
    roles are accepted (``template_roles``: data version 6; before, only the standard ones)."""

    format: str = "messages"
    loss_on: str = "all"
    long: str = "drop"
    system_prompt: str | None = None
    roles: Mapping[str, str] | None = None
    template_roles: bool = True

    def accepted(self, renderer: ChatRenderer) -> tuple[str, ...]:
        """The roles a conversation may have, rendered with ``renderer``."""
        return renderer.roles if self.template_roles else ROLES

    def role_rules(self, renderer: ChatRenderer) -> dict[str, Any]:
        """The role arguments of :func:`~zephon.data.chat.parse_conversation` for conversations
        rendered with ``renderer``: accepted roles, this dataset's mapping, the template's roles."""
        return {"roles": self.accepted(renderer), "rename": self.roles, "known": renderer.roles}

    def parse(self, value: Any, renderer: ChatRenderer) -> dict[str, Any]:
        """A record's value as a checked conversation (:func:`~zephon.data.chat.parse_conversation`
        with these settings), to be rendered with ``renderer``."""
        return parse_conversation(value, self.format, self.system_prompt, **self.role_rules(renderer))


def fit_conversation(
    ids: np.ndarray, turns: Sequence[tuple[int, int]], opts: ChatOptions, row: int
) -> tuple[Any, str | None]:
    """``(tokens, mask)`` within ``row`` tokens under ``opts.long``, and the policy applied (None:
    it fit); ``(reason, None)`` when the conversation is dropped.

    >>> ids = np.arange(10); t = [(2, 4), (6, 9)]
    >>> fit_conversation(ids, t, ChatOptions(long="truncate_turns"), 8)[0][1].astype(int).tolist()
    [0, 0, 1, 1]
    >>> fit_conversation(ids, t, ChatOptions(long="drop"), 8)[0]
    'conversation too long: 10 tokens, a row holds 8 (long = "drop")'
    """
    n = len(ids)
    if n <= row or opts.long == "split":
        return (ids, select_mask(n, turns, opts.loss_on)), None
    if opts.long == "truncate":
        kept = [(a, min(b, row)) for a, b in turns if a < row]
        return (ids[:row], select_mask(row, kept, opts.loss_on)), "truncate"
    if opts.long == "truncate_turns":
        kept = [(a, b) for a, b in turns if b <= row]
        if kept:
            cut = kept[-1][1]
            return (ids[:cut], select_mask(cut, kept, opts.loss_on)), "truncate_turns"
    return f'conversation too long: {n} tokens, a row holds {row} (long = "{opts.long}")', None


def chat_cache_settings(renderer: ChatRenderer, opts: ChatOptions) -> str:
    """The token cache's settings key of conversations rendered by ``renderer`` and read as
    ``opts`` say (format, system prompt, roles): what their ids and turns depend on besides the
    record (``loss_on`` and ``long`` are applied after, so they share the entries)."""
    how = [opts.format, opts.system_prompt, sorted((opts.roles or {}).items()), opts.template_roles]
    return TokenCache.settings_key(renderer.cache_identity(), f"chat|{how}")


class FetchChat(ProcessLocal):
    """``items -> [ChatDoc]``: the encoder of chat datasets (conversations rendered and masked).

    ``renderers`` / ``options``: per chat dataset index. ``on_error[d]``: a bad conversation (not
    JSON, unknown role, turns not alternating, no assistant turn, the template failing, a message
    spelling a special token) stops the run naming file and record ("raise") or is a counted
    skip ("skip"). ``row_len``: the tokens a row holds (the long policy's limit). Text datasets
    of the same recipe have their own encoder (:class:`~zephon.nodes.RecordPipeline`).
    """

    def __init__(
        self,
        datasets: Sequence[ShardIndex],
        renderers: Mapping[int, ChatRenderer],
        options: Mapping[int, ChatOptions],
        row_len: int,
        on_error: Sequence[str] | None = None,
    ) -> None:
        self.datasets = list(datasets)
        self.renderers, self.options = dict(renderers), dict(options)
        self.row_len = int(row_len)
        self.on_error = policies(on_error, len(self.datasets))
        self.token_cache = cache_setting()  # the node's token cache ($ZEPHON_TOKEN_CACHE), carried to workers
        self._settings: dict[int, str] = {}
        ProcessLocal.__init__(self)

    def __call__(self, items: list[WorkItem], given: Mapping[tuple[int, int, int], Any] | None = None) -> list[Any]:
        """``items`` (of chat datasets) -> their :class:`ChatDoc` s; ``given``: records already
        read, by ``(dataset, shard, record)`` (the others are read here, grouped per shard).
        A conversation's ids and turns come from the node's token cache where it holds them."""
        other = [j for j, it in enumerate(items) if it.dataset not in self.renderers]
        if other:
            raise ValueError(
                f"FetchChat encodes chat datasets only, not datasets {sorted({items[j].dataset for j in other})}"
            )
        got = through_cache(self, items, functools.partial(self._encode_all, given=given))
        return [g if isinstance(g, ChatDoc) else self._fit(it, g) for it, g in zip(items, got)]

    def _encode_all(self, items: list[WorkItem], given: Mapping[tuple[int, int, int], Any] | None) -> list[Any]:
        return [self._encode(it, rec) for it, rec in zip(items, read_items(self.datasets, items, given))]

    # -- the token cache's view of this encoder (tokencached.py): ids and turns before the long policy
    def cache_settings(self, d: int, whole: bool) -> str | None:
        """What dataset ``d``'s conversations' ids and turns depend on besides the record: the
        renderer (tokenizer, template) and how the record is read as a conversation."""
        got = self._settings.get(d)
        if got is None:
            got = self._settings[d] = chat_cache_settings(self.renderers[d], self.options[d])
        return got

    def cache_width(self) -> int:
        """Bytes per id (and turn boundary) in the token cache."""
        return 4

    @staticmethod
    def from_entry(e: TokenEntry, it: WorkItem | None = None) -> ChatEncoding:
        """The ids and turns a cache entry holds (ids, then the turns' bounds; ``offset``: the ids)."""
        n = int(e.offset)
        bounds = e.tokens[n:].tolist()
        return ChatEncoding(e.tokens[:n], tuple(zip(bounds[::2], bounds[1::2])), "")

    @staticmethod
    def to_entry(got: Any) -> TokenEntry | None:
        """A conversation's ids and turns as a cache entry (None: a skip, not cached)."""
        if not isinstance(got, ChatEncoding):
            return None
        bounds = np.asarray(got.turns, dtype=np.int32).reshape(-1)
        return TokenEntry(np.concatenate([got.ids, bounds]).astype(np.int32), len(got.ids))

    def conversation(self, d: int, value: str) -> dict[str, Any]:
        """Dataset ``d``'s record ``value`` (its JSON text) as a conversation (raises
        :class:`ConversationError` when it is not one)."""
        return self.options[d].parse(value, self.renderers[d])

    def view(self, d: int) -> Callable[[Any, str], str]:
        """How a rule sees dataset ``d``'s records: ``"rendered"`` (the conversation as the chat
        template renders it, the text trained on) or ``"raw"`` (the record's JSON text)."""
        return functools.partial(self._view, d)

    def _view(self, d: int, value: Any, how: str) -> str:
        if how == "raw" or not isinstance(value, str):
            return str(value)
        try:
            return self.renderers[d].render_text(self.conversation(d, value))
        except ConversationError as e:
            raise UnviewableError(str(e)) from None

    def _encode(self, it: WorkItem, rec: Any) -> ChatEncoding | ChatDoc:
        """A record's ids and turns, or its ChatDoc when there are none (a skip, a later part)."""
        d = it.dataset
        if it.part > 0:  # a conversation is never planned as parts; a later part carries nothing
            return ChatDoc(np.zeros(0, dtype=np.int32), d, it)
        if not isinstance(rec, BadRecord):
            try:
                return self.renderers[d].encode(self.conversation(d, rec))
            except ChatTimeoutError as e:  # not a bad record (it depends on the machine): the run stops
                ix = self.datasets[d]
                raise BadRecord(ix.name, ix.locate(it.shard, it.record)["file"], _locator(ix, it), str(e)).to_error(
                    "Fix the chat template (or raise [workers] timeout_s)."
                ) from None
            except ConversationError as e:
                ix = self.datasets[d]
                rec = BadRecord(ix.name, ix.locate(it.shard, it.record)["file"], _locator(ix, it), str(e))
        if self.on_error[d] == "raise":
            raise _error(rec, self.datasets[d].name)
        return ChatDoc(np.zeros(0, dtype=np.int32), d, it, f"{rec.reason} ({rec.locator})")

    def _fit(self, it: WorkItem, enc: ChatEncoding) -> ChatDoc:
        """A conversation's ChatDoc under its dataset's long policy."""
        got, how = fit_conversation(enc.ids, enc.turns, self.options[it.dataset], self.row_len)
        if isinstance(got, str):
            return ChatDoc(np.zeros(0, dtype=np.int32), it.dataset, it, got)
        return ChatDoc(got[0], it.dataset, it, None, got[1], how, cut=len(enc.ids) - len(got[0]))

    def __repr__(self) -> str:
        names = [self.datasets[d].name for d in sorted(self.renderers)]
        return f"FetchChat(chat={names}, row_len={self.row_len})"


def _locator(ix: ShardIndex, it: WorkItem) -> str:
    return str(ix.locate(it.shard, it.record)["locator"])


def _error(rec: BadRecord, name: str) -> DataError:
    return rec.to_error(skip_hint(name))


class ChatPack(Pack):
    """:class:`Pack` with supervised targets: a document's ``mask`` (None: every token) says which
    tokens are trained on as targets; every other label is ``-100``. ``allow_split`` lets a
    conversation be cut across rows (``long = "split"``, or the ``greedy`` algorithm).

    >>> from zephon.engine.testing import ListSource
    >>> doc = ChatDoc(np.array([5, 6, 7, 8]), 0, WorkItem(0, 0, 0, 0, 0), mask=np.array([0, 0, 1, 1], bool))
    >>> next(ChatPack(ListSource([doc]), seq_len=5, algorithm="first_fit"))["labels"].tolist()
    [-100, 7, 8, -100, -100]
    """

    node_type = "chat_pack"

    def __init__(self, source: BaseNode, *, allow_split: bool = False, **kw: Any) -> None:
        super().__init__(source, **kw)
        if self.algorithm == "greedy" and not allow_split:
            raise ValueError(
                'pack.algorithm = "greedy" cuts conversations across rows; use "first_fit" or "best_fit" '
                '(a conversation stays in one row), or allow splitting with long = "split"'
            )
        self.allow_split = allow_split
        self._mask_row: np.ndarray | None = None
        self.truncated: dict[str, int] = {}  # observability: conversations cut by a long policy

    def accept(self, doc: Any) -> None:
        n = len(doc.tokens)
        mask = getattr(doc, "mask", None)
        if mask is None:
            mask = np.ones(n, dtype=bool)
        elif n > self.row_len and not self.allow_split:
            raise ValueError(f"{doc.provenance}: a conversation of {n} tokens does not fit a row of {self.row_len}")
        how = getattr(doc, "truncated", None)
        if how:
            self.truncated[how] = self.truncated.get(how, 0) + 1
        both = np.stack([np.asarray(doc.tokens, np.int64), mask.astype(np.int64)], axis=1)
        super().accept(doc._replace(tokens=both))

    def _emit_row(self, segments: list, used: int) -> None:
        m = np.zeros(self.row_len, dtype=bool)
        plain, pos = [], 0
        for seg, ds, prov in segments:
            m[pos : pos + len(seg)] = seg[:, 1] != 0
            pos += len(seg)
            plain.append((seg[:, 0], ds, prov))
        self._mask_row = m
        try:
            super()._emit_row(plain, used)
        finally:
            self._mask_row = None

    def emit(self, item: Any) -> None:
        if self._mask_row is not None:
            item["labels"][~self._mask_row[1:]] = IGNORE_INDEX
        super().emit(item)

    def extra_metrics(self) -> dict[str, Any]:
        """The packer's metrics and the conversations each long policy cut."""
        return {**super().extra_metrics(), "truncated": dict(self.truncated)}
