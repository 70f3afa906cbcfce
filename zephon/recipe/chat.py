"""Chat datasets in a recipe (``kind = "chat"``): their index, templates, token estimates and
the mapper's batch function, in one place so the rest of the assembly changes by a few lines.

A chat dataset's record is a conversation, read as JSON text (``text_mode = "json"``), its roles
mapped by the dataset's ``roles`` (e.g. ``{"human" = "user", "function_response" = "ipython"}``),
rendered with its ``chat_template`` (the tokenizer's own when not given) and masked (``loss_on``).
From data version 6 the template's own roles are accepted (Llama 3.1's ``ipython``); before,
only the standard ones (:data:`zephon.data.chat.ROLES`). See
:mod:`zephon.data.chat` and :class:`zephon.nodes.FetchChat`. The templates' text enters the
recipe fingerprint (:func:`templates_digest`). Mixing by tokens counts a chat dataset's tokens
by ``[mixing] count``: ``"all"`` rendered tokens, or ``"loss"`` (the assistant tokens trained
on), both measured on the same seeded sample as text datasets' tokens per byte.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from zephon.data import ChatRenderer, ConversationError, ShardIndex
from zephon.data.chat import load_chat_template
from zephon.data.chatbounds import ChatTimeoutError
from zephon.data.chatimages import parse_vl_conversation
from zephon.data.datasets.tokencache import TokenCache
from zephon.nodes import IGNORE_INDEX, ChatOptions, FetchChat, FetchVisionChat, fit_conversation
from zephon.nodes.chat import chat_cache_settings
from zephon.nodes.tokencached import cached_entries
from zephon.nodes.vlchat import expand_placeholders

from .estimate import planned_bytes
from .spec import CHAT_KIND, COUNT, RecipeError, RecipeSpec

__all__ = [
    "CHAT_KEYS",
    "chat_encoder",
    "chat_renderers",
    "check_chat",
    "estimate_chat",
    "realized_shares",
    "templates_digest",
    "vl_chat_encoder",
]

#: the dataset keys of chat datasets only
CHAT_KEYS = ("chat_template", "chat_format", "loss_on", "long", "system_prompt", "roles")
#: the first data version accepting a chat template's own roles (Llama 3's ``ipython``)
TEMPLATE_ROLES_VERSION = 6


def check_chat(spec: RecipeSpec) -> None:
    """The packer keeps a conversation in one row (first_fit / best_fit) unless its dataset allows
    splitting (``long = "split"``); a conversation with images is never split (its images would
    be cut from their context); ``roles`` is a table of names."""
    chat = [s for s in spec.datasets if s.kind == CHAT_KIND]
    for s in chat:
        _check_roles_key(s.roles, f"[[datasets]] {s.name!r}")
    split = [s.name for s in chat if s.has_images and s.long == "split"]
    if split:
        raise RecipeError(
            f'recipe: dataset {split[0]!r}: long = "split" would cut a conversation with images across rows; '
            'use "drop", "truncate" or "truncate_turns"'
        )
    whole = [s.name for s in chat if s.long != "split"]
    if whole and spec.pack.algorithm == "greedy" and not spec.multimodal:  # images: MMPack places whole
        raise RecipeError(
            f'recipe: [pack] algorithm = "greedy" cuts conversations across rows (chat dataset {whole[0]!r}); '
            'set algorithm = "first_fit" or "best_fit" (a conversation stays in one row), or long = "split"'
        )


def _check_roles_key(roles: Any, where: str) -> None:
    """A chat dataset's ``roles``: a table of role names to role names (where each maps to is
    checked against its template's roles when the recipe is prepared: :func:`chat_renderers`)."""
    if roles is None:
        return
    if not isinstance(roles, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v for k, v in roles.items()
    ):
        shown = repr(roles)
        raise RecipeError(
            f'recipe: {where}.roles must be a table of names to non-empty role names, e.g. roles = {{"human" = '
            f'"user"}}, got {shown[:80] + "..." if len(shown) > 80 else shown}'
        )


def _options(spec: RecipeSpec) -> dict[int, ChatOptions]:
    own = spec.data_version >= TEMPLATE_ROLES_VERSION
    return {
        d: ChatOptions(s.chat_format, s.loss_on, s.long, s.system_prompt, s.roles, own)
        for d, s in enumerate(spec.datasets)
        if s.kind == CHAT_KIND
    }


def _check_roles(spec: RecipeSpec, d: int, renderer: ChatRenderer) -> None:
    """A dataset's ``roles`` maps to accepted roles only (else every conversation using it
    would be a bad record): refused when the recipe is prepared, where its template is read."""
    s = spec.datasets[d]
    accepted = _options(spec)[d].accepted(renderer)
    for src, dst in (s.roles or {}).items():
        if dst not in accepted:
            later = (
                f", or set data_version = {TEMPLATE_ROLES_VERSION} (the chat template's own roles, {dst!r} among "
                "them, are accepted from it)"
                if dst in renderer.roles
                else ""
            )
            raise RecipeError(
                f"recipe: dataset {s.name!r}: roles maps {src!r} to {dst!r}, which is not an accepted role "
                f"(accepted: {', '.join(accepted)}); map it to one of them{later}"
            )


def chat_renderers(spec: RecipeSpec) -> dict[int, ChatRenderer]:
    """A renderer per chat dataset (by dataset index), its template found as the recipe says
    (a ``roles`` mapping to a role it does not accept is refused)."""
    out = {}
    for d, s in enumerate(spec.datasets):
        if s.kind != CHAT_KIND:
            continue
        try:
            out[d] = ChatRenderer(
                spec.tokenizer.path,
                load_chat_template(s.chat_template, spec.tokenizer.path),
                timeout_s=spec.workers.for_stage("tokenize").timeout_s,
            )
        except (OSError, ValueError) as e:
            raise RecipeError(f"recipe: dataset {s.name!r}: {e}") from None
        _check_roles(spec, d, out[d])
    return out


def templates_digest(spec: RecipeSpec, renderers: Mapping[int, ChatRenderer] | None = None) -> str:
    """What the chat templates add to the recipe fingerprint ("" without chat datasets);
    ``renderers``: the recipe's, when built already."""
    chat = chat_renderers(spec) if renderers is None else renderers
    prints = [f"{d}:{r.fingerprint}" for d, r in sorted(chat.items())]
    return hashlib.sha256(";".join(prints).encode()).hexdigest()[:16] if prints else ""


def estimate_chat(
    spec: RecipeSpec,
    d: int,
    index: ShardIndex,
    renderer: ChatRenderer,
    sampler: Callable[..., Any],
    special: Mapping[str, int] | None = None,
    cache: TokenCache | None = None,
) -> tuple[float, float, int, dict[str, tuple[int, str]]]:
    """A chat dataset's token estimate ``(tokens per record byte, 0 per record, conversations
    measured, bad ones by reason)`` on the seeded sample ``sampler`` draws (the one text datasets
    are measured on); tokens are all rendered ones or the "loss" ones (``[mixing] count``), as the
    run delivers them under the dataset's ``long`` policy (a dropped conversation weighs its bytes
    with no tokens, so the plan draws more conversations to make the dataset's share; from data
    version 5 a bad one does too: skipped under ``on_error = "skip"``, it delivers nothing).
    ``special``: the vision token ids, for a dataset whose conversations hold images. ``cache``:
    the node's token cache, whose entries give sampled conversations' ids and turns unrendered."""
    opts = _options(spec)[d]
    sample = sampler(index, seed=spec.seed, samples=spec.mixing.estimate_samples, ds_number=d)
    tokens = nbytes = records = 0
    bad: dict[str, tuple[int, str]] = {}
    images = _ImageRuns(spec, d, index, special or {}) if spec.datasets[d].has_images else None
    settings = chat_cache_settings(renderer, opts) if cache is not None and images is None else ""
    for s, local in sample:
        sizes = index.record_bytes(s)
        held = cached_entries(cache, settings, index, s, local) if settings else {}
        for r, rec in zip(local, index.read(s, local)):
            try:
                if images is not None:
                    got = images.fit(renderer, opts, rec, s, r)
                else:
                    if not isinstance(rec, str):
                        raise ConversationError(str(getattr(rec, "reason", rec)))
                    e = held.get(r)
                    enc = FetchChat.from_entry(e) if e is not None else renderer.encode(opts.parse(rec, renderer))
                    got, _ = fit_conversation(enc.ids, enc.turns, opts, spec.seq_len + 1)  # what the run delivers
            except ChatTimeoutError as e:  # not a bad record: whether it happens depends on the machine
                where = index.locate(s, r)
                raise RecipeError(
                    f"recipe: dataset {index.name!r}, file {where['file']!r}, {where['locator']}: {e}"
                ) from None
            except ConversationError as e:
                key = str(e).split(":")[0][:60]
                bad[key] = (bad.get(key, (0, ""))[0] + 1, str(e))
                nbytes += planned_bytes(index, int(sizes[r])) if spec.data_version >= 5 else 0
                continue
            if not isinstance(got, str):  # a dropped one delivers nothing
                tokens += len(got[0]) if spec.mixing.count == "all" else int(got[1].sum())
            nbytes += int(sizes[r])
            records += 1
    return (max(tokens, 1) / nbytes if nbytes else 1.0), 0.0, records, bad


class _ImageRuns:
    """A conversation with images as the estimate counts it: rendered, each placeholder expanded
    to its image's run (from the indexed image sizes: nothing decoded), fit to a row; its text
    tokens are those the plan weighs by bytes (the image blocks, ``<|vision_start|>`` and
    ``<|vision_end|>`` included, are added per record from the sizes, see ``record_weights``)."""

    def __init__(self, spec: RecipeSpec, d: int, index: Any, special: Mapping[str, int]) -> None:
        self.spec, self.d, self.index = spec, d, index
        self.vision = spec.vision.config
        self.special = {k: special[k] for k in ("image", "vision_start", "vision_end")}
        self._firsts: dict[int, np.ndarray] = {}

    def fit(self, renderer: ChatRenderer, opts: ChatOptions, rec: Any, s: int, r: int) -> Any:
        if not hasattr(rec, "segments"):
            raise ConversationError(str(getattr(rec, "reason", rec)))
        field = self.spec.datasets[self.d].text_field
        rules = opts.role_rules(renderer)
        conv = parse_vl_conversation(rec.segments[0], opts.format, opts.system_prompt, field, **rules)
        if conv["images"] != len(rec.segments) - 1:
            raise ConversationError("the conversation shows another number of images than its record holds")
        enc = renderer.encode(conv)
        n_img, ws, hs = self.index.image_sizes(s)
        if s not in self._firsts:  # where each record's images start among the shard's (once a shard)
            self._firsts[s] = np.concatenate([[0], np.cumsum(n_img)])
        first = int(self._firsts[s][r])
        pads = np.flatnonzero(enc.ids == self.special["image"])
        runs = [self.vision.image_tokens(int(ws[first + j]), int(hs[first + j])) for j in range(len(pads))]
        ids, turns = expand_placeholders(enc.ids, pads, runs, enc.turns)
        got, _ = fit_conversation(ids, turns, opts, self.spec.seq_len + 1)
        if isinstance(got, str):
            return got
        vision = np.isin(got[0], list(self.special.values()))
        return got[0][~vision], got[1][~vision]


def chat_encoder(spec: RecipeSpec, indexes: Sequence[ShardIndex], renderers: Mapping[int, ChatRenderer]) -> FetchChat:
    """The encoder of a recipe's text chat datasets (its record pipeline's, beside the text one)."""
    text = {d: r for d, r in renderers.items() if not spec.datasets[d].has_images}
    return FetchChat(
        indexes, text, _options(spec), row_len=spec.seq_len + 1, on_error=[s.on_error for s in spec.datasets]
    )


def vl_chat_encoder(
    spec: RecipeSpec, indexes: Sequence[ShardIndex], renderers: Mapping[int, ChatRenderer], special: Mapping[str, int]
) -> FetchVisionChat:
    """The encoder of a recipe's chat datasets whose conversations hold images."""
    return FetchVisionChat(
        indexes,
        {d: r for d, r in renderers.items() if spec.datasets[d].has_images},
        _options(spec),
        spec.vision.config,
        special,
        row_len=spec.seq_len + 1,
        on_error=[s.on_error for s in spec.datasets],
        fields={d: s.text_field for d, s in enumerate(spec.datasets) if s.has_images},
    )


def realized_shares(batches: Iterable[Mapping[str, Any]], datasets: int, count: str = "all") -> np.ndarray:
    """Each dataset's share of the tokens of ``batches``: all non-padding tokens (``count =
    "all"``) or the tokens trained on (``"loss"``: a target that is not -100 counts for the
    dataset of its input position).

    >>> b = {"dataset": np.array([[0, 0, 1, -1]]), "labels": np.array([[-100, 5, 6, -100]])}
    >>> realized_shares([b], 2).tolist(), realized_shares([b], 2, "loss").tolist()
    ([0.6666666666666666, 0.3333333333333333], [0.5, 0.5])
    """
    if count not in COUNT:
        raise ValueError(f"count must be one of {COUNT}, got {count!r}")
    totals = np.zeros(datasets, np.float64)
    for b in batches:
        ds = np.asarray(b["dataset"]).reshape(-1)
        if count == "loss":
            ds = ds[np.asarray(b["labels"]).reshape(-1) != IGNORE_INDEX]
        ds = ds[ds >= 0]
        totals += np.bincount(ds, minlength=datasets)[:datasets]
    return totals / totals.sum() if totals.sum() else totals
