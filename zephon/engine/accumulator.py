"""Accumulators: single-threaded stateful operators checkpointed by flush and replay.

An accumulator sees every record of its lane in order and makes all stateful decisions (what
to pack together, in which order to emit). It flushes, i.e. empties its buffer into its output
queue, at points that are a deterministic function of its own input stream: every
``flush_every`` inputs, wherever the operator's own logic empties it anyway, and at the end of
the stream.

Its checkpoint holds no buffer contents: just the upstream's state at the last point where the
buffer and the output queue were both empty (the *anchor*), the operator's few counters at that
point, and how many outputs it has delivered since. Restore rewinds the upstream to the anchor
and replays, dropping the outputs that were already delivered. Replay cost is therefore bounded
by one flush interval, whatever the step.

Subclasses implement :meth:`accept` (consume one input, append complete outputs with
:meth:`emit`), :meth:`flush` (emit or drop everything still held), and optionally
:meth:`extra_state` / :meth:`load_extra_state` for small counters that must be known at the
anchor (e.g. a window counter that keys a random stream).
"""

from __future__ import annotations

import abc
import collections
from typing import Any

from torchdata.nodes import BaseNode

from .node import ANCHOR, EXTRA, MAX_STATE_INT, SINCE, StateError, ZNode, check_state_keys, state_int, state_node

__all__ = ["Accumulator"]


class Accumulator(ZNode[Any]):
    """Base class for stateful per-lane operators (pack, shuffle, batch...).

    Why: an operator that buffers items (a packer, a shuffle window) would otherwise have to
    checkpoint its buffer; an accumulator checkpoints only where its buffer was last empty and
    replays from there, so its state stays a few integers whatever it holds.

    A pairing operator, and the check that it resumes from every step:

    >>> from zephon.engine.testing import RangeSource, check_node
    >>> class Pairs(Accumulator):
    ...     node_type = "pairs"
    ...     def clear(self): self._held = []
    ...     def buffer_empty(self): return not self._held
    ...     def accept(self, x):
    ...         self._held.append(x)
    ...         if len(self._held) == 2:
    ...             self.flush()
    ...     def flush(self):
    ...         if self._held:
    ...             self.emit(tuple(self._held))
    ...         self._held = []
    >>> node = Pairs(RangeSource(5))
    >>> list(node)
    [(0, 1), (2, 3), (4,)]
    >>> check_node(lambda: Pairs(RangeSource(5))).steps
    3
    """

    node_type = "accumulator"

    def __init__(self, source: BaseNode, *, flush_every: int | None = None) -> None:
        super().__init__()
        if flush_every is not None and (not isinstance(flush_every, int) or flush_every < 1):
            raise ValueError(
                f"{type(self).__name__}: flush_every must be a positive integer or None, got {flush_every!r}"
            )
        self.source = source
        self.flush_every = flush_every
        self._out: collections.deque[Any] = collections.deque()
        self._anchor: dict[str, Any] | None = None
        self._anchor_extra: dict[str, Any] = {}
        self._since = 0  # outputs delivered since the anchor
        self._inputs = 0  # inputs accepted since the last flush
        self._pending_anchor = True
        self._done = False
        self.replayed = 0  # outputs re-generated on the last restore (observability)

    # -- operator hooks (the four abstract ones must be written: a forgotten ``buffer_empty``
    # would let an anchor be taken while items are still held, and resume wrongly) ------------
    @abc.abstractmethod
    def accept(self, item: Any) -> None:
        """Consume one input; call ``self.emit(x)`` for every output it completes."""

    @abc.abstractmethod
    def flush(self) -> None:
        """Empty the buffer: emit (or drop, as the operator defines) everything still held."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Forget buffer contents and set counters to their initial values (called on reset)."""

    @abc.abstractmethod
    def buffer_empty(self) -> bool:
        """True when the operator holds nothing; an anchor may be taken then."""

    def extra_state(self) -> dict[str, Any]:
        """Small counters needed to replay from the anchor (same keys at every step)."""
        return {}

    def load_extra_state(self, extra: dict[str, Any]) -> None:
        """Restore what :meth:`extra_state` returned (check every value: it comes from a file;
        :func:`zephon.engine.node.state_int` and :func:`zephon.engine.node.check_state_keys` help)."""
        if extra:
            raise StateError(f"{self!r}: state field 'extra' must be empty for this node, got {sorted(extra)}")

    def max_since(self) -> int | None:
        """The most outputs one flush interval of this operator can deliver before its next
        anchor, from its configuration alone (None: no static bound). A restored ``since`` above
        it is refused before anything is replayed; replay itself stops, with an error, at the
        point where the interval ends (the exact check)."""
        return None

    def on_flush(self) -> None:
        """Called at every flush point: after :meth:`flush`, and when :meth:`accept` emptied the
        buffer by itself (a window that filled up and was emitted). E.g. advance a window
        counter."""

    # -- machinery --------------------------------------------------------------------------
    def emit(self, item: Any) -> None:
        """Queue one output (call from :meth:`accept` or :meth:`flush`); delivered in order."""
        self._out.append(item)

    def _take_anchor(self) -> None:
        self._anchor = self.source.state_dict()
        self._anchor_extra = self.extra_state()
        self._since = 0
        self._pending_anchor = False

    def _do_flush(self) -> None:
        self.flush()
        self._inputs = 0
        self.on_flush()
        if not self.buffer_empty():
            raise RuntimeError(f"{self!r}: flush() left items in the buffer; it must empty it")
        self._pending_anchor = True

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._out.clear()
        self.clear()
        self._inputs = 0
        self._done = False
        self.replayed = 0
        if initial_state is None:
            self.source.reset(None)
            self._take_anchor()
            return
        check_state_keys(self, initial_state, (ANCHOR, EXTRA, SINCE))
        cap = self.max_since()
        since = state_int(self, SINCE, initial_state[SINCE], 0, MAX_STATE_INT if cap is None else cap)
        anchor = state_node(self, ANCHOR, initial_state[ANCHOR])
        extra = initial_state[EXTRA]
        if not isinstance(extra, dict):
            raise StateError(f"{self!r}: state field 'extra' must be a JSON object, got {type(extra).__name__}")
        self.load_extra_state(extra)
        self.source.reset(anchor)
        self._take_anchor()
        for i in range(since):  # replay: regenerate and drop what was already delivered
            if i and not self._out and self._pending_anchor and self.buffer_empty():
                # the flush interval that started at the anchor is over: a true state never
                # counts more outputs since its anchor than that interval produced
                raise StateError(
                    f"{self!r}: state field 'since' = {since}, but the flush interval at its anchor "
                    f"produced only {i} outputs; the state was edited or corrupted"
                )
            try:
                self._next_output()
            except StopIteration:
                raise StateError(
                    f"{self!r}: replay ended after {i} of {since} outputs; the data changed since the "
                    "checkpoint was written"
                ) from None
        self._since = since
        self.replayed = since

    def get_state(self) -> dict[str, Any]:
        # no side effect: when nothing is held the state is simply "here", the anchor the next
        # read would take anyway
        if self._pending_anchor and not self._out and self.buffer_empty():
            return self._tagged({ANCHOR: self.source.state_dict(), EXTRA: self.extra_state(), SINCE: 0})
        return self._tagged({ANCHOR: self._anchor, EXTRA: dict(self._anchor_extra), SINCE: self._since})

    def _next_output(self) -> Any:
        while not self._out:
            if self._done:
                raise StopIteration
            self.check_cancelled()  # a window's first fill can take minutes: a close stops it
            if self._pending_anchor and self.buffer_empty():
                self._take_anchor()
            try:
                item = next(self.source)
            except StopIteration:
                self._done = True
                self._do_flush()
                continue
            self.accept(item)
            self._inputs += 1
            if self.flush_every is not None and self._inputs >= self.flush_every:
                self._do_flush()
            elif self.buffer_empty() and not self._pending_anchor:
                # the operator emptied its buffer by itself: a free flush point
                self._inputs = 0
                self.on_flush()
                self._pending_anchor = True
        return self._out.popleft()

    def next(self) -> Any:
        out = self._next_output()
        self._since += 1
        return out
