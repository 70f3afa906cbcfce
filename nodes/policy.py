"""What an operator does with a bad record: the ``on_error`` policy and the sentence that says
how to change it (the recipe's vocabulary, so it lives with the operators, not the readers)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ON_ERROR", "policies", "skip_hint"]

#: ``raise``: stop the run naming the file, the record and the fix; ``skip``: a counted,
#: deterministic skip (the same records on every world size)
ON_ERROR = ("raise", "skip")


def skip_hint(dataset: str) -> str:
    """The sentence every data error ends with: how to turn the error into a counted skip.

    >>> print(skip_hint("web"))
    To skip bad records instead, set on_error = "skip" for dataset 'web' in the recipe.
    """
    return f"To skip bad records instead, set on_error = \"skip\" for dataset '{dataset}' in the recipe."


def policies(on_error: Sequence[str] | None, datasets: int) -> list[str]:
    """Each dataset's ``on_error`` (default ``"raise"``), checked: what every encoder keeps.

    >>> policies(None, 2), policies(["skip"], 1)
    (['raise', 'raise'], ['skip'])
    """
    out = list(on_error or ["raise"] * datasets)
    for p in out:
        if p not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {p!r}")
    return out
