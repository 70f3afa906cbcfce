# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: -all
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 02 · Writing your own node
#
# zephon pipelines are chains of [torchdata.nodes](https://pytorch.org/data/) nodes. There are
# two kinds of operator, and knowing which one you are writing is most of the work:
#
# | kind | use it for | parallel? | state | example |
# |---|---|---|---|---|
# | **stateless map** — `zephon.engine.OrderedMapper(source, fn=...)` | decode, tokenize, filter-by-content, augment with a seeded RNG | yes: N threads or processes, results in input order | none of yours: the mapper checkpoints its own position | fetch + tokenize |
# | **accumulator** — subclass `zephon.engine.Accumulator` | anything that looks at *several* records: pack, shuffle, batch, sort, bucket | no: one thread per lane | a few counters; **never** the buffer | `Pack`, `WindowShuffle`, `Batch` |
#
# The rule that keeps a run deterministic: a map's output depends only on its input item; an
# accumulator's output depends only on its input *stream* (and a seed). Then the worker count
# is a pure performance knob, and a checkpoint can be a few hundred bytes.
#
# This notebook writes one of each, proves they resume exactly with `zephon.engine.testing.check_node`,
# shows what check_node says about a *broken* node, and plugs the new node into a multi-lane
# loader whose global batches do not depend on the world size.

# %%
import json
import random
import time

import numpy as np

import zephon
from zephon import GlobalLoader, WorkerConfig, batch_sha256
from zephon.engine import Accumulator, LaneContext, OrderedMapper
from zephon.nodes import Batch
from zephon.engine.testing import RangeSource, check_node

# %% [markdown]
# ## 1. A stateless map
#
# `RangeSource(n)` is the synthetic source the engine's own tests use: it yields `0, 1, ..., n-1`
# and its state is a single cursor. We map a deliberately *uneven* function over it with two
# worker threads: item *i* sleeps a pseudo-random few milliseconds, so workers finish out of
# order. The mapper still delivers results strictly in input order.

# %%
def slow_square(x: int) -> int:
    time.sleep(0.001 * ((x * 37) % 7))  # uneven work: later items often finish first
    return x * x


mapped = OrderedMapper(RangeSource(20), fn=slow_square, workers=WorkerConfig(2, "thread"), chunk_size=2)
print(mapped)
print(list(mapped))
mapped.close()  # stops the private pool (a node built inside a lane would share the rank's pool instead)

# %% [markdown]
# Its checkpoint is the upstream's state at the start of the chunk being delivered plus how many
# items of that chunk were delivered. On restore it rewinds the source and *skips* those items
# without mapping them again:

# %%
m = OrderedMapper(RangeSource(20), fn=slow_square, workers=WorkerConfig(2, "thread"), chunk_size=4)
first = [next(m) for _ in range(6)]
state = m.state_dict()
m.close()
print("after 6 items:", first)
print("state:", json.dumps(state))

m2 = OrderedMapper(RangeSource(20), fn=slow_square, workers=WorkerConfig(2, "thread"), chunk_size=4)
m2.reset(state)
print("resumed:", list(m2))
m2.close()

# %% [markdown]
# ### Proving it: `check_node`
#
# Doing that by hand for one step proves little. `zephon.engine.testing.check_node(make)` runs a node
# built by `make()` to the end, then for **every** step *k* builds a fresh node, restores the
# state taken after *k* outputs (after a JSON round trip) and checks that everything that follows
# is byte-identical. It also checks the state's keys never change shape, and that `close()` leaves
# no threads or processes behind. Put one call per node in your test suite.

# %%
result = check_node(lambda: OrderedMapper(RangeSource(40), fn=slow_square, workers=WorkerConfig(2, "thread"), chunk_size=4))
print(f"{result.steps} steps, restored at each of them; largest state: {result.max_state_bytes} bytes of JSON")

# %% [markdown]
# ### A broken map
#
# The function you map must be *pure*: the same input gives the same output, whichever worker
# runs it and whenever. Randomness is fine only when it is seeded from the item (or from
# `zephon.engine.lane_rng(seed, lane, op, epoch, counter)`). Here is a map with an unseeded random
# augmentation — exactly the bug that makes a resumed run silently diverge — and what check_node
# says about it:

# %%
def noisy(x: int) -> float:
    return x + random.random()  # unseeded: differs on every call


try:
    check_node(lambda: OrderedMapper(RangeSource(10), fn=noisy))
except AssertionError as e:
    print("check_node caught it:", e)


def seeded_noise(x: int) -> float:
    return x + np.random.default_rng(x).random()  # seeded by the item: pure


print("the seeded version passes:", check_node(lambda: OrderedMapper(RangeSource(10), fn=seeded_noise)).steps, "steps")

# %% [markdown]
# ## 2. An accumulator
#
# Our example is a classic from sequence-to-sequence training: a **length-sorted window**.
# It collects `window` documents, then emits them sorted by length, so that the batches built
# from consecutive outputs need little padding. Ties are broken by a seeded random key, so the
# order is still shuffled within a length. Each output is tagged with the window it came from.
#
# First, a map that turns an integer into a synthetic "document" (a dict of numpy arrays,
# padded to a fixed width so every batch has the same shape):

# %%
MAX_LEN = 48


def make_doc(i: int) -> dict:
    length = 1 + (i * 7919 + 13) % 47  # a cheap hash: lengths 1..47 in no particular order
    tokens = np.full(MAX_LEN, -1, dtype=np.int64)
    tokens[:length] = (np.arange(length) + i) % 1000
    return {"id": i, "length": length, "tokens": tokens}


make_doc(3)

# %% [markdown]
# An `Accumulator` subclass implements a few hooks; the base class does the threading-free
# bookkeeping, the checkpointing and the replay:
#
# * `accept(item)` — consume one input; call `self.emit(x)` for every output it completes.
# * `flush()` — emit (or drop) everything still held. Called when the operator decides to, every
#   `flush_every` inputs if you pass it to `super().__init__`, and at the end of the stream.
# * `buffer_empty()` — true when nothing is held. Each time the buffer is empty, the base class may
#   take an **anchor**: the upstream's state at that point.
# * `clear()` — forget the buffer and reset counters (called on `reset`).
# * `extra_state()` / `load_extra_state(extra)` — *small counters that must be known at the anchor*.
#   Here, the window number, which keys the random tie-break and is written into the outputs.
# * `on_flush()` — called after every flush; the natural place to advance a window counter.
#
# The checkpoint holds **no buffer contents**: only the anchor, the extra state at the anchor
# and the number of outputs delivered since. Restoring rewinds the upstream to the anchor and
# replays — at most one window of work — dropping the outputs already delivered.

# %%
class LengthSortWindow(Accumulator):
    """Collect ``window`` documents, emit them shortest first (seeded tie-break), tagged with the window."""

    node_type = "length_sort_window"  # written into the state; a state of another node type is refused

    def __init__(self, source, *, window: int, seed: int, lane: int = 0) -> None:
        super().__init__(source)
        self.window, self.seed, self.lane = window, seed, lane
        self._items: list = []
        self._window = 0

    def _repr_args(self):  # shown by repr() and describe()
        yield f"window={self.window}"
        yield f"lane={self.lane}"

    def accept(self, item) -> None:
        self._items.append(item)
        if len(self._items) >= self.window:
            self.flush()

    def flush(self) -> None:
        items, self._items = self._items, []
        if not items:
            return
        rng = zephon.engine.lane_rng(self.seed, self.lane, "length_sort", 0, self._window)
        tie = rng.random(len(items))
        for i in sorted(range(len(items)), key=lambda i: (items[i]["length"], tie[i])):
            self.emit({**items[i], "window": self._window})

    def on_flush(self) -> None:
        self._window += 1

    def buffer_empty(self) -> bool:
        return not self._items

    def clear(self) -> None:
        self._items = []
        self._window = 0

    def extra_state(self) -> dict:
        return {"window": self._window}

    def load_extra_state(self, extra: dict) -> None:
        self._window = int(extra["window"])


node = LengthSortWindow(OrderedMapper(RangeSource(24), fn=make_doc), window=8, seed=0)
print(node.describe())
for out in list(node)[:10]:
    print(f"window {out['window']}  doc {out['id']:2d}  length {out['length']:2d}")

# %% [markdown]
# The state after 11 outputs: the upstream position at the start of window 1, `extra` with the
# window number, and `since = 3` outputs delivered from it. No documents.

# %%
node = LengthSortWindow(OrderedMapper(RangeSource(24), fn=make_doc), window=8, seed=0)
for _ in range(11):
    next(node)
state = node.state_dict()
print(json.dumps(state, indent=1))

restored = LengthSortWindow(OrderedMapper(RangeSource(24), fn=make_doc), window=8, seed=0)
restored.reset(state)
print("outputs replayed on restore:", restored.replayed, "| next id:", next(restored)["id"], "== uninterrupted:", next(node)["id"])

# %% [markdown]
# And the proof, at every step:

# %%
result = check_node(lambda: LengthSortWindow(OrderedMapper(RangeSource(60), fn=make_doc), window=8, seed=0))
print(f"LengthSortWindow: {result.steps} steps, restored at every one; largest state {result.max_state_bytes} bytes")

# %% [markdown]
# ### A broken accumulator
#
# The most common mistake: a counter that lives on the object but is **not** in `extra_state`.
# Everything looks fine when you iterate it — the bug only shows after a restore, when the
# counter starts again from zero. Weeks into a run, that is a different shuffle order, or a
# different curriculum phase, on resume. check_node finds it in milliseconds and names the step:

# %%
class ForgetfulLengthSortWindow(LengthSortWindow):
    node_type = "forgetful_length_sort_window"

    def extra_state(self) -> dict:  # "the window number is just bookkeeping, no need to save it"
        return {}

    def load_extra_state(self, extra: dict) -> None:
        pass


try:
    check_node(lambda: ForgetfulLengthSortWindow(OrderedMapper(RangeSource(60), fn=make_doc), window=8, seed=0))
except AssertionError as e:
    print("check_node caught it:", e)

# %% [markdown]
# The other rule, *`flush()` must empty the buffer*, is enforced at run time: a flush that leaves
# items behind would make the next anchor wrong, so the base class refuses to continue.

# %%
class LeakyFlush(LengthSortWindow):
    node_type = "leaky_flush"

    def flush(self) -> None:
        if len(self._items) > 1:
            keep = self._items.pop()  # "keep one for the next window" — not allowed
            super().flush()
            self._items.append(keep)
        else:
            super().flush()


try:
    list(LeakyFlush(OrderedMapper(RangeSource(10), fn=make_doc), window=100, seed=0))
except RuntimeError as e:
    print("refused:", e)

# %% [markdown]
# ## 3. Plugging the node into lanes
#
# A real pipeline has a fixed number of **lanes**; each lane is built from a pure function of a
# `LaneContext` (its lane id, the lane count, the seed, and the rank's shared worker pool).
# `GlobalLoader(build_lane, lanes=L, world_size=W, seed=...)` runs W ranks in this process, each
# owning `L/W` contiguous lanes, and concatenates their micro-batches into global batches.
#
# Note the three things `build_lane` does with the context:
#
# * the source reads only this lane's part of the data (`RangeSource(n, ctx.lane, ctx.lanes)`);
# * the mapper uses the rank's **shared** pool (`ctx.pool()`), so 8 lanes on a rank share one
#   pool of workers instead of starting 8;
# * the accumulator's random stream is keyed by `ctx.seed` and `ctx.lane`, never by the rank.

# %%
LANES = 8


def build_lane(ctx: LaneContext):
    node = RangeSource(10_000, ctx.lane, ctx.lanes)
    node = OrderedMapper(node, fn=make_doc, pool=ctx.pool(), max_in_flight=ctx.max_in_flight(), lane=ctx.lane,
                         chunk_size=8, name="make_doc")
    node = LengthSortWindow(node, window=16, seed=ctx.seed, lane=ctx.lane)
    return Batch(node, batch_size=4)  # 4 rows per lane per step -> 32 rows per global batch


print(build_lane(LaneContext(seed=7, lane=0, lanes=LANES)).describe())

# %% [markdown]
# Run 8 steps at world sizes 1, 2, 4, 8, with and without worker threads, and compare the hash
# of every global batch:

# %%
def global_hashes(world_size: int, workers: WorkerConfig, steps: int = 8) -> list:
    with GlobalLoader(build_lane, lanes=LANES, world_size=world_size, seed=7, workers=workers) as g:
        return [batch_sha256(next(g)) for _ in range(steps)]


runs = {}
for W in (1, 2, 4, 8):
    for workers in (WorkerConfig(0), WorkerConfig(2, "thread")):
        runs[f"W={W}, {workers.count} {workers.backend}s"] = global_hashes(W, workers)

print(f"{'':24s}" + " ".join(f"step {t:<4d}" for t in range(8)))
for name, hashes in runs.items():
    print(f"{name:24s}" + " ".join(h[:9] for h in hashes))
print("\nidentical across all runs:", len({tuple(h) for h in runs.values()}) == 1)

# %% [markdown]
# And a whole lane — source, mapper, our accumulator, batch — resumes exactly at every step:

# %%
result = check_node(lambda: build_lane(LaneContext(seed=7, lane=3, lanes=LANES)), max_steps=30)
print(f"lane 3: {result.steps} steps restored; largest lane state {result.max_state_bytes} bytes")

# %% [markdown]
# ### Threads or processes?
#
# `WorkerConfig(n, "process")` runs the map in `n` processes (started with `forkserver`), which
# helps when the function holds the GIL (pure-Python parsing). The function and its arguments
# are pickled, so they must be **importable** — define them in a module of your package, not in a
# notebook cell (`make_doc` above lives in `__main__` and would fail to unpickle in a worker).
# Threads are the right default for functions that release the GIL (tokenizers, image decoding,
# I/O). Either way the output is the same bytes: notebook 04 shows both.
#
# **Checklist for your own node**
#
# 1. Map or accumulator? If it needs more than one record, it is an accumulator.
# 2. Randomness only from `zephon.engine.lane_rng(seed, lane, op, epoch, counter)` (or seeded by the item).
# 3. Every counter that affects an output is in `extra_state`.
# 4. `flush()` empties the buffer; pass `flush_every=` to bound replay if your buffer rarely empties on its own.
# 5. One `check_node(lambda: YourNode(...))` in your tests.
