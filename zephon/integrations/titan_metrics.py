"""zephon's loader metrics in TorchTitan's own metrics logger (TensorBoard, W&B).

TorchTitan 0.3.0's trainer logs through ``MetricsProcessor.log(step, loss, ..., extra_metrics)``
every ``metrics.log_freq`` steps, to whatever ``--metrics.enable_tensorboard`` /
``--metrics.enable_wandb`` turned on. :func:`zephon.integrations.torchtitan.with_zephon` makes the
trainer's ``metrics`` a :class:`ZephonMetricsProcessor.Config` (same fields, one more), whose
processor adds the training loader's :class:`zephon.recipe.LoaderMetrics` to each of those
calls, so ``zephon/data_loading_s``, ``zephon/tokens/<dataset>``, ``zephon/realized_share/<dataset>``
vs ``zephon/declared_share/<dataset>``, ``zephon/skipped/<dataset>`` and
``zephon/packing_efficiency`` sit next to the loss in the same run, at the same steps.

The loader registers itself here when built (``ZephonDataLoader.Config.dashboard``, off for the
validation loader :func:`with_zephon` builds); the processor asks every live registered loader of
its process. TorchTitan logs from rank 0 only unless ``--metrics.save_for_all_ranks``: the numbers
are then rank 0's lanes (token shares of 1/W of the data), or each rank's own in its own folder.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, fields
from typing import Any

from torchtitan.components.metrics import MetricsProcessor

__all__ = ["ZephonMetricsProcessor", "dashboard_metrics", "register_loader", "zephon_metrics_config"]

_LOADERS: list[weakref.ref[Any]] = []


def register_loader(loader: Any) -> None:
    """Add ``loader`` (anything with ``dashboard_metrics() -> dict``) to this process's dashboards."""
    _LOADERS[:] = [r for r in _LOADERS if r() is not None]
    _LOADERS.append(weakref.ref(loader))


def dashboard_metrics() -> dict[str, float]:
    """The metrics of every live registered loader since the last call (merged)."""
    out: dict[str, float] = {}
    for ref in list(_LOADERS):
        loader = ref()
        if loader is not None:
            out.update(loader.dashboard_metrics())
    return out


class ZephonMetricsProcessor(MetricsProcessor):
    """TorchTitan's ``MetricsProcessor`` that also logs the zephon loader's metrics."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        zephon: bool = True
        """Add zephon's loader metrics (data-loading time, tokens and realized vs declared share
        per dataset, skips, packing efficiency) to every metrics step, under ``zephon/``."""

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ) -> None:
        """TorchTitan's log, with the loaders' metrics of the interval in ``extra_metrics``."""
        extra = dict(extra_metrics or {})
        if getattr(self.config, "zephon", True):
            extra.update(dashboard_metrics())
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)


def zephon_metrics_config(config: Any) -> Any:
    """``config`` (a ``MetricsProcessor.Config``) as a :class:`ZephonMetricsProcessor.Config` with
    the same values (returned unchanged when it already is one, or is some other processor's)."""
    if isinstance(config, ZephonMetricsProcessor.Config) or type(config) is not MetricsProcessor.Config:
        return config
    return ZephonMetricsProcessor.Config(**{f.name: getattr(config, f.name) for f in fields(config)})
