"""The engine's public surface: a slim, sorted package list, and every module one idea, public in its own module."""

import importlib

import zephon.engine


def isort_key(name: str) -> tuple[int, str]:
    """ruff's (isort's) order for ``__all__`` (RUF022): CONSTANTS, then Classes, then functions."""
    return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)


MODULES = ["collate", "digest", "end", "lanes", "prefetch", "router", "checkpoint", "workers", "mapper", "node"]


def test_the_engine_lists_what_an_operator_author_needs_sorted():
    names = zephon.engine.__all__
    assert names == sorted(names, key=isort_key)
    assert len(names) <= 30, f"{len(names)} names: keep the rest public in their own module"
    for n in ("ZNode", "Accumulator", "OrderedMapper", "WorkerConfig", "WorkerPool", "ProcessLocal", "LaneContext"):
        assert n in names
    for n in ("Router", "GlobalLoader", "batch_sha256", "valid_world_sizes"):
        assert n not in names


def test_each_engine_module_lists_its_names_sorted_and_defined():
    for m in MODULES:
        mod = importlib.import_module(f"zephon.engine.{m}")
        names = mod.__all__
        assert all(hasattr(mod, n) for n in names), m
    for m in ["collate", "digest", "end", "lanes", "prefetch", "router"]:
        assert importlib.import_module(f"zephon.engine.{m}").__all__ == sorted(
            importlib.import_module(f"zephon.engine.{m}").__all__
        ), m


def test_one_name_for_the_divisors_of_the_lane_count():
    import zephon.engine.lanes as lanes

    assert not hasattr(lanes, "valid_world_sizes") and not hasattr(zephon, "valid_world_sizes")
    assert lanes.divisors(12) == [1, 2, 3, 4, 6, 12]
