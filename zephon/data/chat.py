"""Chat conversations: read, checked, rendered with a chat template, and the assistant tokens found.

A record is read as a conversation and checked by :mod:`zephon.data.conversation` (its form,
roles, turns; :func:`parse_conversation` is re-exported here); which roles are accepted, how a
dataset renames them and where each may come: :mod:`zephon.data.chatroles`.

Rendering uses transformers' own Jinja renderer (what ``apply_chat_template`` runs) with the
template from ``tokenizer_config.json`` or one named in the recipe (:data:`TEMPLATES`, or a
``.jinja`` file). The rendered text is tokenized **once, whole** (special tokens the template
writes are special tokens; a message that spells one is a bad record), so no BPE merge is ever
split by the way the mask is found. Which characters are assistant text:

* the template has ``{% generation %}`` markers: the characters inside them (transformers' rule);
* it has none: for assistant message ``i``, the characters between the rendering of messages
  ``[:i]`` with the generation prompt and the rendering of messages ``[:i + 1]``, less trailing
  whitespace (the template must render each conversation as a prefix of the next, checked).
  Rendering every prefix is quadratic in the conversation's length, so a conversation of more
  than :data:`EXACT_TURNS` assistant turns is rendered once, with each message's start noted as
  the template reads it (:meth:`ChatRenderer.assistant_spans`); the spans that gives are checked
  against the prefix renderings of a few turns (first, last, some between) and used only if all
  agree, else every prefix is rendered as before. A template that ignores
  ``add_generation_prompt`` (its generation prompt renders empty) would put every assistant
  header into the assistant text: it is refused, naming the fix.

Rendering is bounded: a conversation's renderings must finish within the renderer's
``timeout_s`` (a template looping without end stops the run naming the record: a bad record would
depend on the machine's speed) and stay within :func:`render_limit` characters (a bad record).

A token is an assistant token when its characters overlap assistant text (transformers'
``return_assistant_tokens_mask`` rule: a merge that straddles the boundary belongs to the
assistant). End of turn: the template's own end-of-turn token (``<|im_end|>`` in ChatML) is
inside the span and is trained on; nothing else is added (no BOS/EOS of ``[tokenizer]``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zephon.data.chatbounds import (
    ChatTimeoutError,
    RenderScope,
    bounded_template,
    current_budget,
    late_message,
    too_long_message,
)
from zephon.data.chatroles import ROLES, SHAREGPT_ROLES, TOOL_RESULTS, template_roles
from zephon.data.conversation import CHAT_FORMATS, ConversationError, message_strings, parse_conversation, render_limit

__all__ = [
    "CHAT_FORMATS",
    "CHAT_TOKENIZER",
    "EXACT_TURNS",
    "LOSS_ON",
    "ROLES",
    "SHAREGPT_ROLES",
    "TEMPLATES",
    "TOOL_RESULTS",
    "ChatEncoding",
    "ChatRenderer",
    "ConversationError",
    "load_chat_template",
    "parse_conversation",
    "render_limit",
    "select_mask",
    "template_roles",
]

#: which assistant turns are trained on
LOSS_ON = ("all", "last")
_ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "chat")
#: a demo/test tokenizer: the bundled BPE plus ChatML's ``<|im_start|>`` / ``<|im_end|>`` special
#: tokens, its ``tokenizer_config.json`` holding the ChatML template without generation markers
#: (TorchTitan 0.3's tokenizer compiles that template with plain Jinja, which refuses the
#: ``{% generation %}`` tag); the marked one is the shipped "chatml_generation"
CHAT_TOKENIZER = _ASSETS
#: chat templates shipped with zephon, by the name a recipe gives (``chat_template = "chatml"``)
TEMPLATES = {
    "chatml": os.path.join(_ASSETS, "chatml.jinja"),
    "chatml_generation": os.path.join(_ASSETS, "chatml_generation.jinja"),
    "plain": os.path.join(_ASSETS, "plain.jinja"),
    # conversations with images (vision-language chat): image parts as Qwen-VL placeholders
    "chatml_vl": os.path.join(_ASSETS, "chatml_vl.jinja"),
    "chatml_vl_generation": os.path.join(_ASSETS, "chatml_vl_generation.jinja"),
}
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
#: conversations with at most this many assistant turns are masked by rendering each prefix (a
#: template without generation markers); longer ones by one rendering, checked on a sample
EXACT_TURNS = 8
#: how a conversation becomes ids and turns (:meth:`ChatRenderer.encode`); raise it when that
#: changes, so the token cache's entries written before are not read
_RENDER_VERSION = 1
#: prefix renderings a long conversation's spans are checked against (turns: first, last, between)
CHECKED_TURNS = 4


_NO_PROMPT = (
    "the chat template has no {% generation %} markers and renders nothing for add_generation_prompt, so the "
    "assistant text cannot be told from its header (every assistant header would be trained on); add "
    "{% generation %} markers around the assistant text, or render the assistant header under "
    "{% if add_generation_prompt %}"
)


def load_chat_template(name: str | None, tokenizer_path: str) -> str:
    """The template text: ``name`` is a shipped template (:data:`TEMPLATES`) or a file path;
    None takes ``chat_template`` from the tokenizer's ``tokenizer_config.json`` (its "default"
    one when it holds several)."""
    if name:
        path = TEMPLATES.get(name, name)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"chat_template {name!r} is neither a shipped template ({', '.join(TEMPLATES)}) nor a file; "
                "give a path to a .jinja file, or leave it out to use the tokenizer's own"
            )
        with open(path, encoding="utf-8") as f:
            return f.read()
    folder = tokenizer_path if os.path.isdir(tokenizer_path) else os.path.dirname(os.path.abspath(tokenizer_path))
    cfg_path = os.path.join(folder, "tokenizer_config.json")
    cfg: dict[str, Any] = {}
    if os.path.isfile(cfg_path):
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    tpl = cfg.get("chat_template")
    jinja = os.path.join(folder, "chat_template.jinja")
    if tpl is None and os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            tpl = f.read()
    if isinstance(tpl, list):
        tpl = {t.get("name"): t.get("template") for t in tpl}.get("default")
    if not isinstance(tpl, str) or not tpl:
        raise FileNotFoundError(
            f"the tokenizer at {tokenizer_path!r} has no chat_template (tokenizer_config.json or chat_template.jinja); "
            f'name one in the dataset: chat_template = "chatml" (or {", ".join(TEMPLATES)}, or a .jinja file)'
        )
    return tpl


@dataclass(frozen=True)
class ChatEncoding:
    """A rendered, tokenized conversation: ``ids`` (int32) and each assistant turn's token range
    ``[start, stop)`` in order (:func:`select_mask` turns them into a mask)."""

    ids: np.ndarray
    turns: tuple[tuple[int, int], ...]
    text: str


def select_mask(n: int, turns: Sequence[tuple[int, int]], loss_on: str = "all") -> np.ndarray:
    """A bool mask of ``n`` tokens, True on the selected assistant turns (all, or the last).

    >>> select_mask(6, [(1, 2), (4, 6)], "last").astype(int).tolist()
    [0, 0, 0, 0, 1, 1]
    """
    mask = np.zeros(n, dtype=bool)
    chosen = list(turns) if loss_on == "all" else list(turns)[-1:]
    for a, b in chosen:
        mask[a:b] = True
    return mask


def _token_ranges(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Per character span, the range of tokens whose characters overlap it (non-empty spans)."""
    out = []
    starts = np.fromiter((o[0] for o in offsets), np.int64, len(offsets))
    ends = np.fromiter((o[1] for o in offsets), np.int64, len(offsets))
    if np.all(starts[1:] >= starts[:-1]) and np.all(ends[1:] >= ends[:-1]):
        # sorted offsets (the usual case): the overlapping tokens are one run, found by bisection
        # (linear in the conversation, where a scan per turn is quadratic)
        lo = np.searchsorted(ends, [a for a, _ in spans], side="right")
        hi = np.searchsorted(starts, [b for _, b in spans], side="left")
        return [(int(x), int(y)) if x < y else (0, 0) for x, y in zip(lo, hi)]
    for a, b in spans:
        hit = np.flatnonzero((ends > a) & (starts < b))
        out.append((int(hit[0]), int(hit[-1]) + 1) if hit.size else (0, 0))
    return out


class ChatRenderer:
    """Renders conversations with one chat template and finds their assistant tokens.

    A picklable handle (the tokenizer is reloaded lazily in each process). ``fingerprint`` names
    the template, so a recipe's data changes when its template does. ``roles``: the standard
    roles, then the template's own (:func:`template_roles`), the roles it can render.
    """

    def __init__(self, tokenizer_path: str, template: str, timeout_s: float = 300.0) -> None:
        self.tokenizer_path = os.fspath(tokenizer_path)
        self.template = template
        self.timeout_s = float(timeout_s)
        self.exact_turns = EXACT_TURNS
        self.markers = bool(_GENERATION.search(template))
        self.fingerprint = hashlib.sha256(template.encode("utf-8")).hexdigest()[:16]
        self.roles: tuple[str, ...] = (*ROLES, *(r for r in template_roles(template) if r not in ROLES))
        self._lock = threading.Lock()
        self._tok: Any = None
        self._identity: str | None = None
        tok = self._tokenizer()
        self.specials = sorted(
            (t.content for t in tok.get_added_tokens_decoder().values() if t.special), key=len, reverse=True
        )
        self._kwargs = self._special_kwargs()
        self._check_generation_prompt()

    def _check_generation_prompt(self) -> None:
        """Refuse a template without markers that ignores ``add_generation_prompt``: the assistant
        text is found after the generation prompt, so an empty one would train on every header."""
        if self.markers:
            return
        answer = "Zq7 answer"
        probe = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": answer}]}
        try:
            with self._budget(probe):
                bare, _ = self._render(probe, 1, prompt=False)
                prompted, _ = self._render(probe, 1, prompt=True)
                whole, _ = self._render(probe)
        except (ConversationError, ChatTimeoutError, ImportError):
            return  # a template that needs more (a system message), or no renderer installed (said when rendering)
        if bare == prompted and whole.startswith(bare) and not whole[len(bare) :].startswith(answer):
            raise ValueError(_NO_PROMPT)  # an assistant header, rendered only with the message

    def _special_kwargs(self) -> dict[str, Any]:
        folder = self.tokenizer_path
        if not os.path.isdir(folder):
            folder = os.path.dirname(os.path.abspath(folder))
        cfg_path = os.path.join(folder, "tokenizer_config.json")
        if not os.path.isfile(cfg_path):
            return {}
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
        out: dict[str, Any] = {}
        for k in ("bos_token", "eos_token", "pad_token", "unk_token"):
            v = cfg.get(k)
            v = v.get("content") if isinstance(v, dict) else v
            if isinstance(v, str):
                out[k] = v
        return out

    def cache_identity(self) -> str:
        """What a conversation's ids and turns depend on besides the conversation: the tokenizer
        file, the template, the special tokens it is given, how turns are found (the token
        cache's key for conversations: a change to any of them never reads a stale entry)."""
        if self._identity is None:
            p = self.tokenizer_path
            with open(os.path.join(p, "tokenizer.json") if os.path.isdir(p) else p, "rb") as f:
                h = hashlib.sha256(f.read())
            how = [_RENDER_VERSION, self.template, self._kwargs, self.exact_turns, self.markers, self.specials]
            h.update(json.dumps(how, sort_keys=True).encode("utf-8"))
            self._identity = h.hexdigest()
        return self._identity

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_tok")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock, self._tok = threading.Lock(), None

    def _tokenizer(self) -> Any:
        if self._tok is None:
            from tokenizers import Tokenizer

            with self._lock:
                if self._tok is None:
                    p = self.tokenizer_path
                    self._tok = Tokenizer.from_file(os.path.join(p, "tokenizer.json") if os.path.isdir(p) else p)
        return self._tok

    def _compiled(self) -> Any:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        return bounded_template(_compile_jinja_template(self.template), ConversationError)

    def _budget(self, conv: dict[str, Any]) -> RenderScope:
        return RenderScope(self.timeout_s, render_limit(conv))

    def _render(self, conv: dict[str, Any], upto: int | None = None, prompt: bool = False) -> tuple[str, list]:
        from transformers.utils.chat_template_utils import render_jinja_template

        msgs = conv["messages"] if upto is None else conv["messages"][:upto]
        self._compiled()
        try:
            out: Any = render_jinja_template(
                [msgs],
                tools=conv.get("tools"),
                chat_template=self.template,
                return_assistant_tokens_mask=self.markers,
                add_generation_prompt=prompt,
                **self._kwargs,
            )
            texts, spans = out
        except (ChatTimeoutError, ConversationError) as e:
            if isinstance(e, ChatTimeoutError):
                raise ChatTimeoutError(late_message(self.timeout_s)) from None
            raise
        except Exception as e:  # jinja raises many kinds (TemplateError, TypeError, raise_exception)
            raise ConversationError(f"the chat template failed to render it: {type(e).__name__}: {e}") from None
        b = current_budget()
        if b is not None and len(texts[0]) > b.limit:  # the marked path joins without the hook
            raise ConversationError(too_long_message(b.limit))
        return texts[0], (spans[0] if spans else [])

    def check_specials(self, conv: dict[str, Any]) -> None:
        """Refuse a conversation whose text spells a special token (it would forge a turn): in any
        field a template can render (a message's content, name, tool calls, any other key; the tools)."""
        for i, m in enumerate(conv["messages"]):
            for key, text in message_strings(m):
                for sp in self.specials:
                    if sp in text:
                        raise ConversationError(
                            f"message {i} ({m['role']}) spells the special token {sp!r} in its field {key!r}; remove "
                            "it from the data (a message may not forge a turn boundary)"
                        )
        for key, text in message_strings(conv.get("tools") or []):
            for sp in self.specials:
                if sp in text:
                    raise ConversationError(
                        f"the tools ({key!r}) spell the special token {sp!r}; remove it from the data"
                    )

    def render_text(self, conv: dict[str, Any]) -> str:
        """The conversation as the template renders it (the text trained on), bounded in time and
        size like :meth:`encode`; special tokens spelled by a message are refused as there."""
        self.check_specials(conv)
        with self._budget(conv):
            return self._render(conv)[0]

    def assistant_spans(self, conv: dict[str, Any]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character span of each assistant turn (module doc)."""
        with self._budget(conv):
            text, spans = self._render(conv)
            if self.markers:
                return text, [(int(a), int(b)) for a, b in spans]
            turns = [i for i, m in enumerate(conv["messages"]) if m["role"] == "assistant"]
            if len(turns) > self.exact_turns:
                found = self._tracked_spans(conv, text, turns)
                if found is not None:
                    return text, found
            return text, [self._exact_span(conv, text, i) for i in turns]

    def _exact_span(self, conv: dict[str, Any], text: str, i: int) -> tuple[int, int]:
        """Assistant message ``i``'s span from the renderings of its prefixes (module doc)."""
        head, _ = self._render(conv, i, prompt=True)
        upto, _ = self._render(conv, i + 1)
        if not (text.startswith(head) and text.startswith(upto) and len(head) <= len(upto)):
            raise ConversationError(
                f"the chat template does not render message {i}'s conversation as a prefix of the whole one, so "
                "its assistant text cannot be found without {% generation %} markers; add them to the template"
            )
        return len(head), len(upto.rstrip())

    def _tracked_spans(self, conv: dict[str, Any], text: str, turns: list[int]) -> list[tuple[int, int]] | None:
        """The spans from one rendering that notes where the template first reads each message
        (its rendering of the messages before it ends there), checked against the exact spans of
        :data:`CHECKED_TURNS` turns; None when anything disagrees (the caller renders every prefix)."""
        try:
            from transformers.utils.chat_template_utils import _alias_reasoning_fields, _plain_template_data
        except ImportError:
            return None
        b = current_budget()
        if b is None:
            return None
        msgs = _alias_reasoning_fields(_plain_template_data(conv["messages"]))
        b.ids, b.events, b.pos = {id(m): k for k, m in enumerate(msgs)}, [], 0
        pieces = []
        try:
            for piece in self._compiled().generate(
                messages=msgs,
                tools=_plain_template_data(conv.get("tools")),
                documents=None,
                add_generation_prompt=False,
                **_plain_template_data(self._kwargs),
            ):
                pieces.append(piece)
                b.pos += len(piece)
                if b.pos > b.limit:
                    raise ConversationError(too_long_message(b.limit))
        except ChatTimeoutError:
            raise ChatTimeoutError(late_message(self.timeout_s)) from None
        except ConversationError:
            raise
        except Exception:
            return None
        finally:
            events, b.ids, b.events = b.events, {}, []
        if "".join(pieces) != text:
            return None
        starts, want = [0] * (len(msgs) + 1), 0
        for k, pos in events:  # message k's rendering starts where the template first reads it, in order
            if k == want:
                starts[k], want = pos, want + 1
        if want < len(msgs):
            return None
        starts[len(msgs)] = len(text)
        picks = sorted(
            {turns[round(j * (len(turns) - 1) / (CHECKED_TURNS - 1))] for j in range(CHECKED_TURNS)}
            | set(self._first_of_each_kind(conv["messages"], turns))
        )
        exact = {i: self._exact_span(conv, text, i) for i in picks}
        prompt = text[starts[picks[0]] : exact[picks[0]][0]]
        if not prompt or len(prompt) != exact[picks[0]][0] - starts[picks[0]]:
            return None
        spans = [(starts[i] + len(prompt), len(text[: starts[i + 1]].rstrip())) for i in turns]
        if any(not text.startswith(prompt, starts[i]) for i in turns):
            return None
        if any(spans[turns.index(i)] != exact[i] for i in picks):
            return None
        return spans

    @staticmethod
    def _first_of_each_kind(msgs: list[dict[str, Any]], turns: list[int]) -> list[int]:
        """The first assistant turn of each context a template may render differently (the roles
        before and after it, whether it calls tools): checked too, so a rule that applies only to
        some turns is met."""
        seen: dict[tuple[Any, ...], int] = {}
        for i in turns:
            after = msgs[i + 1]["role"] if i + 1 < len(msgs) else None
            seen.setdefault((msgs[i - 1]["role"], after, bool(msgs[i].get("tool_calls"))), i)
        return list(seen.values())

    def encode(self, conv: dict[str, Any]) -> ChatEncoding:
        """Render ``conv`` (from :func:`parse_conversation`), tokenize it whole, find its turns."""
        self.check_specials(conv)
        text, spans = self.assistant_spans(conv)
        enc = self._tokenizer().encode(text, add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.int32)
        turns = tuple(r for r in _token_ranges(enc.offsets, spans) if r[1] > r[0])
        if not turns:
            raise ConversationError("the rendered conversation has no assistant tokens")
        return ChatEncoding(ids, turns, text)

    def __repr__(self) -> str:
        how = "generation markers" if self.markers else "prefix renderings"
        return f"ChatRenderer({self.tokenizer_path!r}, template={self.fingerprint}, spans from {how})"
