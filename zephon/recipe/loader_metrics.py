"""Per-step loader metrics for dashboards: flat ``{name: number}`` dicts that any metrics logger
takes (TorchTitan's TensorBoard / W&B logger, ``SummaryWriter.add_scalar``, ``wandb.log``).

Why a flat dict: every dashboard speaks ``name -> scalar at step``; the pipeline's own metrics
(:meth:`zephon.engine.router.Router.summary_metrics`) are nested per node and cumulative, so this module
turns them, and what it sees of each batch, into per-interval numbers under one prefix:

==============================================  =====================================================
``<p>data_loading_s``                           mean seconds a recipe step spent in the loader's ``next()``
``<p>waiting_on_workers_s``                     seconds the lanes waited on tokenize/decode workers (interval)
``<p>steps``                                    recipe steps in the interval
``<p>tokens/<dataset>``                         non-padding tokens of each dataset delivered in the interval
``<p>realized_share/<dataset>``                 each dataset's share of the tokens delivered so far
``<p>declared_share/<dataset>``                 its weight now (``[[schedule]]`` applied), normalised
``<p>trained_tokens/<dataset>``                 tokens trained on (label not -100) in the interval (chat recipes)
``<p>trained_share/<dataset>``                  their share of the dataset's tokens so far (chat: the assistant's)
``<p>records/<dataset>``                        records read so far (bad ones included)
``<p>skipped/<dataset>``                        records skipped so far (``on_error = "skip"``: bad, too large)
``<p>skipped_share/<dataset>``                  skipped / read
``<p>truncated/<dataset>``                      image-text samples cut to fit a row so far (text after the last image)
``<p>truncated_tokens``                         the tokens those samples lost
``<p>truncated_conversations/<long>``           conversations a chat ``long`` policy cut so far
``<p>packing_efficiency``                       non-padding share of the row tokens packed in the interval
``<p>padding_tokens``                           padding tokens packed in the interval
``<p>token_cache/hits``, ``misses``             documents read from / not found in the node's token cache
``<p>token_cache/hit_share``                    hits / (hits + misses) in the interval
``<p>token_cache/bytes_read``, ``bytes_written`` bytes of ids read from / written to it in the interval
``<p>token_cache/remote_hits``, ``remote_bytes`` entries merged from / bytes fetched from its remote tier
==============================================  =====================================================

The token cache's numbers (``$ZEPHON_TOKEN_CACHE`` set) count the documents this process
tokenizes or reads (inline and thread workers); process workers count in their own processes.

The numbers are this process's lanes (one data-parallel rank, or every rank of a
:class:`~zephon.engine.GlobalLoader`); nothing crosses ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from zephon.data import token_cache

from .recipe import Recipe

__all__ = ["LoaderMetrics", "metered", "skips_line", "summary_of", "trained_counts"]

MetricsCallback = Callable[[dict[str, float], int], Any]


class LoaderMetrics:
    r"""Collects one rank's loader metrics between two :meth:`collect` calls.

    Feed it each recipe step's local batch with :meth:`record` (and the seconds spent fetching
    it), then call :meth:`collect` with the pipeline's summary metrics at each logging step.

    >>> import json, os, tempfile
    >>> from zephon.data import BUNDLED_TOKENIZER
    >>> from zephon.engine import WorkerConfig
    >>> root = tempfile.mkdtemp()
    >>> for name in ("web", "code"):
    ...     with open(os.path.join(root, f"{name}.jsonl"), "w") as f:
    ...         f.writelines(json.dumps({"text": f"{name} document {i} " * 30}) + "\n" for i in range(200))
    >>> recipe = Recipe.from_dict({"seed": 1, "lanes": 4, "seq_len": 64, "global_batch_size": 8,
    ...     "tokenizer": {"path": BUNDLED_TOKENIZER}, "shuffle": {"buffer": 1},
    ...     "datasets": [{"name": "web", "path": "web.jsonl", "weight": 3.0},
    ...                  {"name": "code", "path": "code.jsonl", "weight": 1.0}]}, base_dir=root)
    >>> m = LoaderMetrics(recipe)
    >>> with recipe.router(world_size=2, rank=0, workers=WorkerConfig(0)) as router:
    ...     m.record(next(router), seconds=0.5)
    ...     out = m.collect(router.summary_metrics())
    >>> out["zephon/steps"], out["zephon/data_loading_s"], out["zephon/declared_share/web"]
    (1, 0.5, 0.75)
    >>> out["zephon/tokens/web"] + out["zephon/tokens/code"] <= 4 * 64, 0 < out["zephon/packing_efficiency"] <= 1
    (True, True)
    """

    def __init__(self, recipe: Recipe, prefix: str = "zephon/") -> None:
        self.recipe, self.prefix = recipe, prefix
        self.names = [d.name for d in recipe.datasets]
        self.step = 0  # recipe steps recorded (this process; a resumed loader counts from its step)
        self._total = np.zeros(len(self.names), dtype=np.int64)
        self._tokens = np.zeros(len(self.names), dtype=np.int64)
        # tokens trained on (chat recipes: the assistant's), in the interval and so far
        self._chat = any(d.kind == "chat" for d in recipe.spec.datasets)
        self._trained = np.zeros(len(self.names), dtype=np.int64)
        self._trained_total = np.zeros(len(self.names), dtype=np.int64)
        self._seconds = 0.0
        self._steps = 0
        self._last: dict[str, float] = {}  # cumulative pipeline counters at the last collect
        self._cache_last: dict[str, int] = {}  # the token cache's counters at the last collect

    def add_time(self, seconds: float) -> None:
        """Seconds spent in the loader outside :meth:`record` (e.g. slices of a fetched step)."""
        self._seconds += float(seconds)

    def record(self, batch: Mapping[str, Any], seconds: float = 0.0, step: int | None = None) -> None:
        """One recipe step's local batch (its ``dataset`` field) and the seconds it took to fetch."""
        ds = np.asarray(batch["dataset"]).ravel()
        counts = np.bincount(ds[ds >= 0].astype(np.int64), minlength=len(self.names))[: len(self.names)]
        self._tokens += counts
        self._total += counts
        if self._chat and "labels" in batch:
            trained = trained_counts(batch, len(self.names))
            self._trained += trained
            self._trained_total += trained
        self._seconds += float(seconds)
        self._steps += 1
        self.step = self.step + 1 if step is None else int(step)

    def collect(self, summary: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, float]:
        """The metrics of the interval since the last call (see the module docstring), then a new
        interval. ``summary``: :meth:`zephon.engine.router.Router.summary_metrics` (skips, packing, worker
        wait); without it only the batch-derived numbers are returned."""
        p = self.prefix
        out: dict[str, float] = {}
        out[f"{p}steps"] = self._steps
        out[f"{p}data_loading_s"] = self._seconds / self._steps if self._steps else 0.0
        total = int(self._total.sum())
        weights = self.recipe.schedule.weights(self.recipe.schedule.phase_at(max(self.step - 1, 0)))
        for i, name in enumerate(self.names):
            out[f"{p}tokens/{name}"] = int(self._tokens[i])
            out[f"{p}realized_share/{name}"] = float(self._total[i]) / total if total else 0.0
            out[f"{p}declared_share/{name}"] = round(float(weights[i]), 12)
            if self._chat:
                out[f"{p}trained_tokens/{name}"] = int(self._trained[i])
                out[f"{p}trained_share/{name}"] = float(self._trained_total[i]) / max(int(self._total[i]), 1)
        if summary is not None:
            out.update(self._from_summary(summary))
        out.update(self._from_token_cache())
        self._tokens[:] = 0
        self._trained[:] = 0
        self._seconds, self._steps = 0.0, 0
        return out

    def _from_token_cache(self) -> dict[str, float]:
        cache = token_cache()
        if cache is None:
            return {}
        now = {
            k: cache.stats[k] for k in ("hits", "misses", "bytes_read", "bytes_written", "remote_hits", "remote_bytes")
        }
        d = {k: v - self._cache_last.get(k, 0) for k, v in now.items()}
        self._cache_last = now
        out: dict[str, float] = {f"{self.prefix}token_cache/{k}": v for k, v in d.items()}
        seen = d["hits"] + d["misses"]
        out[f"{self.prefix}token_cache/hit_share"] = d["hits"] / seen if seen else 0.0
        return out

    def _from_summary(self, summary: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
        p = self.prefix
        out: dict[str, float] = {}
        by_type = {v.get("node_type"): v for v in summary.values()}
        skips = by_type.get("skip_counter", {})
        seen, skipped = skips.get("seen", {}), skips.get("skipped", {})
        for name in self.names:
            if name in seen:
                out[f"{p}records/{name}"] = int(seen[name])
                out[f"{p}skipped/{name}"] = int(skipped.get(name, 0))
                out[f"{p}skipped_share/{name}"] = skipped.get(name, 0) / seen[name] if seen[name] else 0.0
        out.update(_truncations(p, self.names, by_type))
        packer = by_type.get("pack") or by_type.get("mm_pack") or by_type.get("chat_pack") or {}
        wait = float(by_type.get("ordered_map", {}).get("wait_workers_s", 0.0))
        now = {"pad": float(packer.get("pad_tokens", 0)), "row": float(packer.get("row_tokens", 0)), "wait": wait}
        delta = {k: v - self._last.get(k, 0.0) for k, v in now.items()}
        self._last = now
        if packer:
            out[f"{p}padding_tokens"] = int(delta["pad"])
            out[f"{p}packing_efficiency"] = 1.0 - delta["pad"] / delta["row"] if delta["row"] > 0 else 1.0
        if "ordered_map" in by_type:
            out[f"{p}waiting_on_workers_s"] = max(delta["wait"], 0.0)
        return out


def trained_counts(batch: Mapping[str, Any], datasets: int) -> np.ndarray:
    """Per dataset, the tokens of ``batch`` trained on: a label that is not -100 counts for the
    dataset of its input position (chat: the assistant's tokens; never an image's).

    >>> b = {"dataset": np.array([[0, 0, 1, -1]]), "labels": np.array([[-100, 5, 6, -100]])}
    >>> trained_counts(b, 2).tolist()
    [1, 1]
    """
    ds = np.asarray(batch["dataset"]).ravel()
    ds = ds[(np.asarray(batch["labels"]).ravel() != -100) & (ds >= 0)].astype(np.int64)
    return np.bincount(ds, minlength=datasets)[:datasets]


def _truncations(p: str, names: list[str], by_type: Mapping[Any, Mapping[str, Any]]) -> dict[str, float]:
    """The packers' truncation counts: image-text samples cut to fit a row (MMPack, by dataset
    number) and conversations a chat ``long`` policy cut (ChatPack, by policy)."""
    out: dict[str, float] = {}
    mm = by_type.get("mm_pack")
    if mm is not None:
        cut = mm.get("truncated", {})
        for i, name in enumerate(names):
            out[f"{p}truncated/{name}"] = int(cut.get(i, 0))
        out[f"{p}truncated_tokens"] = int(mm.get("truncated_tokens", 0))
    for how, n in (by_type.get("chat_pack") or {}).get("truncated", {}).items():
        out[f"{p}truncated_conversations/{how}"] = int(n)
    return out


def skips_line(summary: Mapping[str, Mapping[str, Any]] | None, names: list[str]) -> str | None:
    """One line of what a run skipped and what its packers cut so far (None: nothing), from
    :func:`summary_of`: records skipped per dataset (of those read), image-text samples cut to fit
    a row per dataset (and the tokens they lost), conversations cut per chat ``long`` policy."""
    if not summary:
        return None
    by_type = {v.get("node_type"): v for v in summary.values()}
    skips = by_type.get("skip_counter", {})
    seen, skipped = skips.get("seen", {}), skips.get("skipped", {})
    parts = []
    said = [f"{n} {int(skipped[n])} of {int(seen.get(n, 0))} read" for n in names if skipped.get(n)]
    if said:
        parts.append("skipped records: " + ", ".join(said))
    cut = _truncations("", names, by_type)
    said = [f"{n} {int(cut[f'truncated/{n}'])}" for n in names if cut.get(f"truncated/{n}")]
    if said:
        parts.append(f"samples cut to fit a row: {', '.join(said)} ({int(cut['truncated_tokens'])} tokens cut)")
    said = [f"{k.split('/', 1)[1]} {int(v)}" for k, v in cut.items() if k.startswith("truncated_conversations/") and v]
    if said:
        parts.append("conversations cut by their long policy: " + ", ".join(said))
    return "; ".join(parts) if parts else None


def summary_of(loader: Any) -> dict[str, dict[str, Any]] | None:
    """Summary metrics of a Router, or of every router of a GlobalLoader (or of a
    :class:`zephon.recipe.runtime.RankBatches`) summed (skips, packing, truncations)."""
    if hasattr(loader, "summary_metrics"):
        return loader.summary_metrics()
    routers = getattr(loader, "routers", None)
    if not routers:
        return None
    out: dict[str, dict[str, Any]] = {}
    for r in routers:
        for name, m in r.summary_metrics().items():
            agg = out.setdefault(name, {"node_type": m.get("node_type")})
            for k, v in m.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    agg[k] = agg.get(k, 0) + v
                elif isinstance(v, dict):
                    d = agg.setdefault(k, {})
                    for kk, vv in v.items():
                        d[kk] = d.get(kk, 0) + vv
    return out


def metered(
    loader: Iterable[Any], recipe: Recipe, callback: MetricsCallback, *, every: int = 1, prefix: str = "zephon/"
) -> Iterator[Any]:
    r"""Yield ``loader``'s batches unchanged and call ``callback(metrics, step)`` every ``every``
    recipe steps: the plain-loop way to get :class:`LoaderMetrics` into any logger.

    ``loader``: ``recipe.router(...)`` (one rank) or ``recipe.global_loader(...)``; ``step``
    counts the batches yielded (from the loader's own step after a resume).

    >>> import json, os, tempfile
    >>> from zephon.data import BUNDLED_TOKENIZER
    >>> from zephon.engine import WorkerConfig
    >>> root = tempfile.mkdtemp()
    >>> with open(os.path.join(root, "web.jsonl"), "w") as f:
    ...     f.writelines(json.dumps({"text": f"document {i} " * 30}) + "\n" for i in range(200))
    >>> recipe = Recipe.from_dict({"seed": 1, "lanes": 4, "seq_len": 64, "global_batch_size": 8,
    ...     "tokenizer": {"path": BUNDLED_TOKENIZER}, "shuffle": {"buffer": 1},
    ...     "datasets": [{"name": "web", "path": "web.jsonl", "weight": 1.0}]}, base_dir=root)
    >>> logged = []
    >>> with recipe.global_loader(world_size=1, workers=WorkerConfig(0)) as g:
    ...     for i, batch in zip(range(4), metered(g, recipe, lambda m, s: logged.append((s, m)), every=2)):
    ...         pass
    >>> [s for s, _ in logged], 0 < logged[0][1]["zephon/packing_efficiency"] <= 1
    ([2, 4], True)
    """
    if every < 1:
        raise ValueError(f"metered(every={every}): log every N >= 1 recipe steps")
    m = LoaderMetrics(recipe, prefix)
    m.step = int(getattr(loader, "step", 0))
    it = iter(loader)
    while True:
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            return
        m.record(batch, time.perf_counter() - t0)
        if m.step % every == 0:
            callback(m.collect(summary_of(loader)), m.step)
        yield batch
