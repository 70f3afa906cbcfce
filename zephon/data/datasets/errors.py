"""Errors raised by the dataset layer, and the marker returned for bad records."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SKIP_HINT", "BadRecord", "DataError"]


def SKIP_HINT(dataset: str) -> str:  # noqa: N802 - reads like a constant at call sites
    """The sentence every data error ends with: how to turn the error into a counted skip.

    >>> print(SKIP_HINT("web"))
    To skip bad records instead, set on_error = "skip" for dataset 'web' in the recipe.
    """
    return f"To skip bad records instead, set on_error = \"skip\" for dataset '{dataset}' in the recipe."


def _compose(reason: str, dataset: str | None, file: str | None, locator: str | None, fix: str | None) -> str:
    parts = []
    if dataset is not None:
        parts.append(f"dataset '{dataset}'")
    if file is not None:
        parts.append(f"file '{file}'")
    if locator is not None:
        parts.append(locator)
    reason = reason.rstrip().rstrip(".")
    msg = f"{', '.join(parts)}: {reason}." if parts else f"{reason}."
    if fix:
        msg += " " + fix.strip()
    return msg


class DataError(Exception):
    """A problem with the data itself (a file, or one record of a file).

    The message names the dataset, the file, the record locator (``line N`` for line-based
    formats, ``row N`` (0-based) for Parquet/Arrow), the reason, and how to fix it. The parts
    are also available as attributes.
    """

    def __init__(
        self,
        reason: str,
        *,
        dataset: str | None = None,
        file: str | None = None,
        locator: str | None = None,
        fix: str | None = None,
    ) -> None:
        self.reason = reason
        self.dataset = dataset
        self.file = file
        self.locator = locator
        self.fix = fix
        super().__init__(_compose(reason, dataset, file, locator, fix))

    def __reduce__(self):  # keyword-only __init__: make it picklable across processes
        return (
            _rebuild_data_error,
            (self.reason, self.dataset, self.file, self.locator, self.fix),
        )


def _rebuild_data_error(reason, dataset, file, locator, fix) -> DataError:
    return DataError(reason, dataset=dataset, file=file, locator=locator, fix=fix)


@dataclass(frozen=True)
class BadRecord:
    """Returned by ``DatasetIndex.read`` in place of a record whose content is bad.

    The caller applies the raise/skip policy: ``raise rec.to_error()`` or count and drop it.
    """

    dataset: str
    file: str
    locator: str  # "line 17" (1-based physical line), "row 3" (0-based row), or "whole file"
    reason: str

    def to_error(self) -> DataError:
        """The :class:`DataError` raised for this record when the policy is "raise"."""
        return DataError(
            self.reason,
            dataset=self.dataset,
            file=self.file,
            locator=self.locator,
            fix=SKIP_HINT(self.dataset),
        )
