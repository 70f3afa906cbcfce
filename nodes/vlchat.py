"""Vision-language chat: conversations whose turns hold images, rendered, expanded and masked.

:class:`FetchVisionChat` is the encoder of chat datasets whose records hold images (kind
``"chat"`` with images, read by :class:`~zephon.data.MultimodalIndex`: the conversation's JSON
text, then its images in the order it shows them). Per record:

1. the conversation is parsed and checked as text chat is, its images as content parts
   (:func:`zephon.data.chatimages.parse_vl_conversation`: the processors' messages form and the
   LLaVA ``<image>`` form); it must show as many images as the record holds;
2. each image is decoded and preprocessed as image-text samples' images are
   (:func:`~zephon.nodes.images.preprocess_patches`: the decode rule, the pixel budget);
3. the conversation is rendered with the dataset's chat template and tokenized whole
   (:class:`~zephon.data.ChatRenderer`: an image part renders as one ``<|image_pad|>``, between
   ``<|vision_start|>`` and ``<|vision_end|>``), and its assistant turns found;
4. each image's placeholder is expanded to its grid, ``(H / patch) * (W / patch) / merge**2``
   tokens (:func:`expand_placeholders`), the turns moved with it: the ids and the assistant mask
   are those of transformers' processor (``apply_chat_template(tokenize=True,
   return_assistant_tokens_mask=True)``) for the same conversation, images and template;
5. the dataset's ``long`` policy fits it to a row (``drop``, ``truncate``, ``truncate_turns``;
   a cut never splits an image's block: the block and the images after the cut are dropped).

The result is an :class:`~zephon.nodes.MMDoc` with ``mask`` (True: an assistant token trained
on) that :class:`~zephon.nodes.MMPack` packs whole, image budgets respected; its labels are -100
on every other token and on every vision token. :class:`MMChat` is the encoder of the text chat
datasets of the same recipe (:class:`~zephon.nodes.FetchChat`'s documents as ``MMDoc``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from zephon.data import BadRecord, ChatRenderer, ConversationError, ShardIndex
from zephon.data.chatbounds import ChatTimeoutError
from zephon.data.chatimages import parse_vl_conversation
from zephon.engine import ProcessLocal

from .chat import ChatOptions, FetchChat, fit_conversation
from .images import ImageError, VisionConfig, preprocess_patches
from .policy import policies, skip_hint
from .stages.pipeline import UnviewableError
from .vision import MMDoc, mrope_positions
from .worksource import WorkItem, read_items

__all__ = ["FetchVisionChat", "MMChat", "expand_placeholders"]


def expand_placeholders(
    ids: np.ndarray, pads: np.ndarray, counts: Sequence[int], turns: Sequence[tuple[int, int]]
) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """``ids`` with the placeholder at each position of ``pads`` repeated ``counts[j]`` times, and
    the token ranges ``turns`` moved with it (a range that holds a placeholder holds its run).

    >>> ids, turns = expand_placeholders(np.array([5, 9, 6, 7]), np.array([1]), [3], [(2, 4)])
    >>> ids.tolist(), turns
    ([5, 9, 9, 9, 6, 7], [(4, 6)])
    """
    reps = np.ones(len(ids), dtype=np.int64)
    reps[pads] = np.asarray(counts, dtype=np.int64)
    shift = np.concatenate([[0], np.cumsum(reps[pads] - 1)])

    def moved(p: int) -> int:
        return int(p + shift[np.searchsorted(pads, p, side="left")])

    return np.repeat(ids, reps), [(moved(a), moved(b)) for a, b in turns]


def _blocks(tokens: np.ndarray, special: Mapping[str, int]) -> list[tuple[int, int]]:
    """Each image's block ``[start, stop)`` in ``tokens``: its placeholder run, with the vision
    markers around it."""
    pad = special["image"]
    is_pad = np.concatenate([[False], tokens == pad, [False]])
    edges = np.flatnonzero(is_pad[1:] != is_pad[:-1])
    out = []
    for a, b in zip(edges[::2], edges[1::2]):
        a -= int(a > 0 and tokens[a - 1] == special["vision_start"])
        b += int(b < len(tokens) and tokens[b] == special["vision_end"])
        out.append((int(a), int(b)))
    return out


class FetchVisionChat(ProcessLocal):
    """``items -> [MMDoc]``: the encoder of chat datasets whose conversations hold images (module
    doc). ``renderers`` / ``options``: per such dataset index; ``special`` maps ``image``,
    ``vision_start``, ``vision_end`` (and ``video``) to token ids; ``row_len``: the tokens a row
    holds; ``on_error[d]``: a bad record (a conversation text chat refuses, a missing, extra or
    unreadable image) stops the run naming it ("raise") or is a counted skip ("skip");
    ``fields[d]``: the key of a record object's messages besides ``messages`` / ``conversations``."""

    def __init__(
        self,
        datasets: Sequence[ShardIndex],
        renderers: Mapping[int, ChatRenderer],
        options: Mapping[int, ChatOptions],
        vision: VisionConfig,
        special: Mapping[str, int],
        *,
        row_len: int,
        on_error: Sequence[str] | None = None,
        fields: Mapping[int, str] | None = None,
    ) -> None:
        self.datasets = list(datasets)
        self.renderers, self.options = dict(renderers), dict(options)
        self.fields = dict(fields or {})  # where a record object holds its messages (text_field)
        self.vision, self.special = vision, dict(special)
        self.row_len = int(row_len)
        self.on_error = policies(on_error, len(self.datasets))
        ProcessLocal.__init__(self)

    def __call__(self, items: list[WorkItem], given: Mapping[tuple[int, int, int], Any] | None = None) -> list[MMDoc]:
        """``items`` (of chat datasets with images) -> their documents; ``given``: records already
        read, by ``(dataset, shard, record)`` (the others are read here, grouped per shard)."""
        other = sorted({it.dataset for it in items if it.dataset not in self.renderers})
        if other:
            raise ValueError(f"FetchVisionChat encodes chat datasets with images only, not datasets {other}")
        return [self._one(it, rec) for it, rec in zip(items, read_items(self.datasets, items, given))]

    def conversation(self, d: int, value: Any) -> dict[str, Any]:
        """Dataset ``d``'s record (its conversation's JSON text first) as a conversation with image
        parts (raises :class:`ConversationError` when it is not one)."""
        opts = self.options[d]
        text = value.segments[0] if hasattr(value, "segments") else value
        rules = opts.role_rules(self.renderers[d])
        return parse_vl_conversation(text, opts.format, opts.system_prompt, self.fields.get(d), **rules)

    def view(self, d: int) -> Callable[[Any, str], str]:
        """How a rule sees dataset ``d``'s records: ``"rendered"`` (the conversation as its template
        renders it, one placeholder per image) or ``"raw"`` (the conversation's JSON text)."""
        return functools.partial(self._view, d)

    def _view(self, d: int, value: Any, how: str) -> str:
        if how == "raw":
            return str(value.segments[0] if hasattr(value, "segments") else value)
        try:
            return self.renderers[d].render_text(self.conversation(d, value))
        except ConversationError as e:
            raise UnviewableError(str(e)) from None

    # -- per record ---------------------------------------------------------------------------
    def _bad(self, it: WorkItem, reason: str, where: tuple[str, str] | None = None) -> MMDoc:
        ix = self.datasets[it.dataset]
        if where is None:
            loc = ix.locate(it.shard, it.record)
            where = (str(loc["file"]), str(loc["locator"]))
        if self.on_error[it.dataset] == "raise":
            raise BadRecord(ix.name, where[0], where[1], reason).to_error(skip_hint(ix.name))
        return MMDoc(np.zeros(0, np.int32), it.dataset, it, skipped=f"{reason} ({where[0]}, {where[1]})")

    def _skip(self, it: WorkItem, reason: str) -> MMDoc:
        return MMDoc(np.zeros(0, np.int32), it.dataset, it, skipped=reason)

    def _one(self, it: WorkItem, rec: Any) -> MMDoc:
        if it.part > 0:  # a conversation is never planned as parts; a later part carries nothing
            return MMDoc(np.zeros(0, np.int32), it.dataset, it)
        if isinstance(rec, BadRecord):
            return self._bad(it, rec.reason, (rec.file, rec.locator))
        images = list(rec.segments[1:])
        try:
            conv = self.conversation(it.dataset, rec)
            if conv["images"] != len(images):
                raise ConversationError(
                    f"the conversation shows {conv['images']} images (image parts or <image> markers) but the record "
                    f"holds {len(images)}; every image must be shown once, in order"
                )
            enc = self.renderers[it.dataset].encode(conv)
        except ChatTimeoutError as e:  # not a bad record (it depends on the machine): the run stops
            ix = self.datasets[it.dataset]
            loc = ix.locate(it.shard, it.record)
            raise BadRecord(ix.name, str(loc["file"]), str(loc["locator"]), str(e)).to_error(
                "Fix the chat template (or raise [workers] timeout_s)."
            ) from None
        except ConversationError as e:
            return self._bad(it, str(e), (rec.file, rec.locator))
        pads = np.flatnonzero(enc.ids == self.special["image"])
        if len(pads) != len(images):  # the template's fault, not the record's: the run stops
            raise BadRecord(
                self.datasets[it.dataset].name,
                rec.file,
                rec.locator,
                f"the chat template renders {len(pads)} image placeholders for the conversation's {len(images)} images",
            ).to_error('Use a template that renders each image part as one placeholder (chat_template = "chatml_vl").')
        v = self.vision
        if len(images) > v.max_images_per_batch or (v.max_images_per_row and len(images) > v.max_images_per_row):
            limit = "max_images_per_batch" if len(images) > v.max_images_per_batch else "max_images_per_row"
            return self._skip(it, f"conversation has {len(images)} images, more than [vision].{limit}")
        prepared = []  # decoded only for a conversation the budgets take
        for j, data in enumerate(images):
            try:
                prepared.append(preprocess_patches(data, self.vision))
            except ImageError as e:
                return self._bad(it, f"{e} (image #{j + 1} of the conversation)", (rec.file, rec.locator))
        counts = [int(g.prod()) // (v.merge_size * v.merge_size) for _, g in prepared]
        ids, turns = expand_placeholders(enc.ids, pads, counts, enc.turns)
        return self._fit(it, ids, turns, prepared)

    def _fit(self, it: WorkItem, ids: np.ndarray, turns: list[tuple[int, int]], prepared: list[Any]) -> MMDoc:
        """The conversation within a row under its ``long`` policy, an image block never cut."""
        got, _ = fit_conversation(ids, turns, self.options[it.dataset], self.row_len)
        if isinstance(got, str):
            return self._skip(it, got)
        tokens, mask = got
        kept = len(prepared)
        if len(tokens) < len(ids):
            blocks = _blocks(ids, self.special)
            kept = sum(1 for _, b in blocks if b <= len(tokens))
            if kept < len(blocks) and blocks[kept][0] < len(tokens):  # the cut is inside a block: before it
                tokens, mask = tokens[: blocks[kept][0]], mask[: blocks[kept][0]]
        v = self.vision
        pix = [p for p, _ in prepared[:kept]]
        pixels = pix[0] if len(pix) == 1 else (np.concatenate(pix) if pix else np.zeros((0, v.patch_dim), np.float32))
        grid = np.stack([g for _, g in prepared[:kept]]) if kept else np.zeros((0, 3), np.int64)
        mrope = mrope_positions(tokens, self.special["image"], grid, v.merge_size) if v.mrope else None
        return MMDoc(
            np.asarray(tokens, np.int32),
            it.dataset,
            it,
            pixels,
            grid,
            mrope,
            truncated=len(ids) - len(tokens),
            mask=mask,
        )

    def __repr__(self) -> str:
        names = [self.datasets[d].name for d in sorted(self.renderers)]
        return f"FetchVisionChat(chat={names}, row_len={self.row_len}, vision={self.vision})"


class MMChat(ProcessLocal):
    """The encoder of the text chat datasets of a recipe with images: :class:`FetchChat`'s
    conversations as :class:`MMDoc` s with their ``mask``, so one packer takes every kind."""

    def __init__(self, chat: FetchChat) -> None:
        self.chat = chat
        ProcessLocal.__init__(self)

    def __call__(self, items: list[WorkItem], given: Mapping[tuple[int, int, int], Any] | None = None) -> list[MMDoc]:
        return [
            MMDoc(d.tokens, d.dataset, d.item, skipped=d.skipped, offset=d.offset, truncated=d.cut, mask=d.mask)
            for d in self.chat(items, given)
        ]

    def view(self, d: int) -> Callable[[Any, str], str]:
        """How a rule sees dataset ``d``'s conversations (:meth:`FetchChat.view`)."""
        return self.chat.view(d)

    def __repr__(self) -> str:
        return f"MMChat({self.chat!r})"
