"""Plots for exploring a recipe in Jupyter (matplotlib): token shares over steps, packing
efficiency, document lengths, per-node throughput. Each returns a ``matplotlib`` Figure."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "plot_document_lengths",
    "plot_node_throughput",
    "plot_packing_efficiency",
    "plot_token_shares",
    "token_shares",
]


def _plt():
    # no backend switch: Jupyter's inline backend must stay in charge (matplotlib falls back
    # to a headless backend by itself where there is no display)
    import matplotlib.pyplot as plt

    return plt


def token_shares(recipe: Any, steps: int, world_size: int = 1, workers: Any = None) -> np.ndarray:
    """Cumulative realized token share per dataset after each step: shape ``[steps, datasets]``.

    >>> import tempfile
    >>> from zephon.tools.demo import demo_recipe
    >>> recipe = demo_recipe(tempfile.mkdtemp(), scale=0.01).replace(lanes=4, global_batch_size=8, shuffle={"buffer": 1})
    >>> shares = token_shares(recipe, steps=2)
    >>> shares.shape, bool(np.allclose(shares.sum(axis=1), 1))
    ((2, 3), True)
    """
    counts = np.zeros(len(recipe.datasets))
    out = np.zeros((steps, len(recipe.datasets)))
    with recipe.global_loader(world_size, workers=workers) as g:
        for t in range(steps):
            b = next(g)
            ds = b["dataset"]
            counts += np.bincount(ds[ds >= 0].ravel(), minlength=len(counts))
            out[t] = counts / max(counts.sum(), 1)
    return out


def target_shares(recipe: Any, steps: int) -> np.ndarray:
    """The scheduled token share per dataset at each step (curricula change it).

    >>> import tempfile
    >>> from zephon.tools.demo import demo_recipe
    >>> target_shares(demo_recipe(tempfile.mkdtemp(), scale=0.01), steps=1).round(2).tolist()
    [[0.6, 0.25, 0.15]]
    """
    out = np.zeros((steps, len(recipe.datasets)))
    for t in range(steps):
        out[t] = recipe.schedule.weights(recipe.schedule.phase_at(t))
    return out


def plot_token_shares(recipe: Any, steps: int = 200, world_size: int = 1, shares: np.ndarray | None = None):
    """Realized (cumulative) vs target token share per dataset over steps."""
    plt = _plt()
    shares = token_shares(recipe, steps, world_size) if shares is None else shares
    target = target_shares(recipe, len(shares))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for d, spec in enumerate(recipe.datasets):
        (line,) = ax.plot(np.arange(1, len(shares) + 1), shares[:, d], label=f"{spec.name} (realized)")
        ax.plot(
            np.arange(1, len(shares) + 1),
            target[:, d],
            "--",
            color=line.get_color(),
            alpha=0.6,
            label=f"{spec.name} (target)",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("token share (cumulative)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("Token shares: realized vs target")
    fig.tight_layout()
    return fig


def plot_packing_efficiency(recipe: Any, steps: int = 20, world_size: int = 1):
    """Distribution of per-row packing efficiency (share of non-padding tokens)."""
    plt = _plt()
    effs: list[float] = []
    with recipe.global_loader(world_size) as g:
        for _ in range(steps):
            b = next(g)
            effs.extend((b["document_ids"] >= 0).mean(axis=1).tolist())
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.hist(effs, bins=np.linspace(0, 1, 41))
    ax.set_xlabel("row packing efficiency")
    ax.set_ylabel("rows")
    ax.set_title(f"{recipe.spec.pack.algorithm}: mean {np.mean(effs):.1%} over {len(effs)} rows")
    fig.tight_layout()
    return fig


def plot_document_lengths(recipe: Any, samples: int = 300):
    """Token length distribution per dataset, from a seeded sample of records."""
    from zephon.engine.permute import IndexPermutation

    plt = _plt()
    p = recipe.prepare()
    fig, ax = plt.subplots(figsize=(6, 3))
    for d, (spec, ix) in enumerate(zip(recipe.datasets, p.indexes)):
        k = min(samples, ix.num_records)
        picks = np.sort(IndexPermutation(ix.num_records, 1000 + d).take(np.arange(k)))
        offs = ix.shard_offsets()
        shards = np.searchsorted(offs, picks, side="right") - 1
        texts = []
        for s in np.unique(shards):
            texts += [t for t in ix.read(int(s), (picks[shards == s] - offs[s]).tolist()) if isinstance(t, str)]
        lengths = [len(t) for t in p.tokenizer.encode_batch(texts)]
        ax.hist(lengths, bins=np.logspace(0, np.log10(max(lengths) + 1), 30), alpha=0.5, label=spec.name)
    ax.set_xscale("log")
    ax.set_xlabel("document length (tokens)")
    ax.set_ylabel("documents")
    ax.legend()
    ax.set_title("Document lengths per dataset")
    fig.tight_layout()
    return fig


def plot_node_throughput(metrics: dict[str, dict[str, Any]]):
    """Items/s and own seconds per node type, from ``Router.summary_metrics()``."""
    plt = _plt()
    names = list(metrics)
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    axes[0].barh(names, [metrics[n].get("items_per_s", 0) for n in names])
    axes[0].set_xscale("log")
    axes[0].set_xlabel("items / s (inclusive)")
    axes[1].barh(names, [metrics[n].get("self_s", 0) for n in names])
    axes[1].set_xlabel("own seconds")
    axes[1].set_yticks([])
    fig.suptitle("Per-node throughput")
    fig.tight_layout()
    return fig
