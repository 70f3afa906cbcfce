"""Errors raised by the dataset layer, and the marker returned for bad records."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BadRecord", "DataError"]


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

    #: the message is for the user as it is (a worker's traceback adds nothing to it)
    user_error = True

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

    The caller applies the raise/skip policy (the operators' ``on_error``): raise
    ``rec.to_error(fix)`` or count and drop it.
    """

    dataset: str
    file: str
    locator: str  # "line 17" (1-based physical line), "row 3" (0-based row), or "whole file"
    reason: str

    def to_error(self, fix: str | None = None) -> DataError:
        """The :class:`DataError` for this record, ending with ``fix`` (how to get past it).

        >>> print(BadRecord("web", "a.jsonl", "line 3", "not JSON").to_error("Fix the line."))
        dataset 'web', file 'a.jsonl', line 3: not JSON. Fix the line.
        """
        return DataError(self.reason, dataset=self.dataset, file=self.file, locator=self.locator, fix=fix)
