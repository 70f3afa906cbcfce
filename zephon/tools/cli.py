"""The ``zephon`` command line: ``demo``, ``hashes``, ``inspect``, ``ledger``, ``warm``.

Each command is also a function here, so a notebook or a test can call it without a shell.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import traceback
import warnings
from typing import Any

import numpy as np

from zephon.data import DataError
from zephon.engine import PipelineError, StateError, WorkerConfig
from zephon.engine.checkpoint import decode_state, encode_state, load_state, save_state
from zephon.engine.digest import batch_sha256
from zephon.engine.lanes import check_world_size
from zephon.engine.shutdown import Terminated, stop_on_signals
from zephon.recipe import RankBatches, Recipe, RecipeError
from zephon.recipe.estimate import bad_samples_message
from zephon.recipe.keys import max_workers
from zephon.recipe.loader_metrics import skips_line, summary_of, trained_counts

from .cli_parser import DISTRIBUTION, STATE_FILE, build_parser, version_line
from .demo import demo_recipe, what_you_saw
from .display import describe_plan, format_batch_rows, format_row
from .diversity import diversity_line
from .ledger import ledger_writers, run_ledger_show, write_ledgers
from .ledger_diff import run_ledger_diff
from .warm import run_warm, warm_line

__all__ = ["DISTRIBUTION", "STATE_FILE", "main", "run_hashes", "version_line"]


def _state_file(resume: str) -> str:
    """The state file ``--resume`` names (a folder written by --save-at, or the file itself),
    refused with a message when it is not there."""
    path = os.path.join(resume, STATE_FILE) if os.path.isdir(resume) else resume
    if not os.path.exists(resume):
        raise ValueError(f"--resume {resume!r} does not exist; give the folder that --save-at N --checkpoint DIR wrote")
    if not os.path.isfile(path):
        raise ValueError(
            f"--resume {resume!r} has no {STATE_FILE}; it is written by `zephon hashes ... --save-at N --checkpoint DIR`"
        )
    return path


def _workers(recipe: Recipe, count: int | None, backend: str | None) -> WorkerConfig | None:
    """``--workers`` / ``--backend``: they reach every pool of the recipe (see ``WorkersSpec.override``)."""
    return recipe.spec.workers.override(recipe.multimodal, count, backend)


def _resumed_state(recipe: Any, resume: str, err: Any) -> dict[str, Any]:
    """The state ``--resume`` names, as this recipe loads it: a fork's parent run's checkpoint
    (taken at or before the fork step) is continued as the fork (``Recipe.continue_state``)."""
    state = load_state(_state_file(resume), lanes=recipe.lanes)
    fork = getattr(recipe, "fork", None) is not None
    if fork and state.get("fingerprint") == recipe.parent.fingerprint:
        state = recipe.continue_state(state)
        print(
            f"zephon hashes: {resume} is the parent run's checkpoint: continuing it as the fork", file=err, flush=True
        )
    return state


def run_hashes(
    recipe: Any,
    *,
    world_size: int = 1,
    steps: int = 10,
    workers: Any = None,
    save_at: int | None = None,
    checkpoint: str | None = None,
    resume: str | None = None,
    out: Any = None,
    digest: str = "batch",
    err: Any = None,
    ledger: str | None = None,
    recipe_path: str = "",
) -> list[str]:
    """Print ``step <t> <sha256>`` for each global batch; optionally save or resume lane-keyed state.

    Why: comparing these lines between runs on different world sizes (or after a resume) is the
    end-to-end check of elastic determinism. ``digest="batch"``: :func:`zephon.batch_sha256` of
    the global batch; ``"ledger"``: the digest a run's batch ledger records for the step
    (:func:`zephon.engine.digest.ledger_digest` of the lanes' digests). A finite recipe that ends
    before ``steps`` prints every step there is and says on ``err`` (stderr) where it ended, as it
    says records skipped and samples cut to fit a row. ``steps`` counts the steps computed by this
    call: after a ``resume``, that many *more*. ``ledger``: a folder to write the batch ledger a
    training run on ``world_size`` ranks would write (one file per rank; ``zephon ledger show`` /
    ``diff`` read it), on a CPU.

    >>> import io, tempfile
    >>> from zephon.tools.demo import demo_recipe
    >>> recipe = demo_recipe(tempfile.mkdtemp(), scale=0.01).replace(lanes=4, global_batch_size=8, shuffle={"buffer": 1})
    >>> out = io.StringIO()
    >>> on_1 = run_hashes(recipe, world_size=1, steps=2, out=out)
    >>> out.getvalue().split()[:2] == ["step", "0"], on_1 == run_hashes(recipe, world_size=4, steps=2, out=io.StringIO())
    (True, True)
    """
    out = sys.stdout if out is None else out  # looked up per call (redirected stdout, doctest)
    err = sys.stderr if err is None else err
    if digest not in ("batch", "ledger"):
        raise ValueError(f"digest must be 'batch' or 'ledger', got {digest!r}")
    hashes = []
    state = _resumed_state(recipe, resume, err) if resume else None
    digests = digest == "ledger" or ledger is not None
    with RankBatches(recipe, world_size, None, workers=workers, digests=digests) as g:
        start = 0
        if state is not None:
            g.load_state_dict(state)
            start = g.step
            say = f"resumed after step {start - 1} from {resume}; --steps {steps} computes the next {steps} steps"
            print(f"zephon hashes: {say} ({start}..{start + steps - 1})", file=err, flush=True)
        writers = ledger_writers(recipe, world_size, ledger, recipe_path) if ledger is not None else []
        if save_at is not None and not start < save_at <= start + steps:
            raise ValueError(
                f"--save-at {save_at} is not one of the steps this run computes ({start + 1}..{start + steps}): "
                "nothing would be saved; give a step in that range"
            )
        for t in range(start, start + steps):
            try:
                batch = g.next_step()
            except StopIteration:
                shown = f"printed steps {start}..{t - 1}" if t > start else "printed no step"
                print(
                    f"zephon hashes: {g.end.describe() if g.end else 'the data ended'}; {shown} "
                    f"of the {steps} asked for (steps {start}..{start + steps - 1})",
                    file=err,
                    flush=True,
                )
                if save_at is not None and save_at > t:
                    print(f"zephon hashes: no state saved: the data ended before step {save_at}", file=err)
                break
            h = g.step_digest() if digest == "ledger" else batch_sha256(batch)
            hashes.append(h)
            print(f"step {t} {h}", file=out, flush=True)
            if writers:
                write_ledgers(writers, recipe, t, g.lane_digests(), batch, g.lane_counts())
            if save_at is not None and checkpoint is not None and t + 1 == save_at:
                _save(g, checkpoint, t, err)
        _finish_run(g, recipe, writers, err)
        if writers:
            print(f"zephon hashes: wrote the batch ledger of {world_size} rank(s) to {ledger}", file=err, flush=True)
    return hashes


def _finish_run(g: RankBatches, recipe: Any, writers: list[Any], err: Any) -> None:
    """Close the ledger ``writers``; say the run's skipped records and the samples its packers
    cut, one line on ``err`` (nothing when there were none), so a user sees what was left out."""
    for w in writers:
        w.close()
    said = skips_line(summary_of(g), [d.name for d in recipe.datasets])
    if said:
        print(f"zephon hashes: {said}", file=err, flush=True)


def _save(g: RankBatches, checkpoint: str, t: int, err: Any) -> None:
    """``--save-at``: the state after step ``t``, written durably, and a line saying where."""
    os.makedirs(checkpoint, exist_ok=True)
    path = os.path.join(checkpoint, STATE_FILE)
    save_state(path, g.state_dict())
    print(
        f"zephon hashes: saved the state after step {t} to {path}; --resume {checkpoint} continues at step {t + 1} "
        "on any valid world size",
        file=err,
        flush=True,
    )


def _demo(args: argparse.Namespace) -> int:
    t0 = time.time()
    recipe = demo_recipe(args.root)
    p = recipe.prepare(progress=None)
    names = [d.name for d in recipe.datasets]
    print(f"zephon demo: {recipe}")
    print(f"data and recipe: {recipe.base_dir}")
    print()
    steps = args.steps
    with recipe.global_loader(1, workers=WorkerConfig(0)) as g:
        first = next(g)
    print("first rows of global batch 0 (documents separated by ‖):")
    for i in range(3):
        print(f"  row {i}: " + format_row(p.tokenizer, {k: v[i] for k, v in first.items()}, names, width=240))
    print()
    table: dict[str, list[str]] = {}
    for world in (1, 2, 4, 8):
        for workers in (WorkerConfig(0), WorkerConfig(2, "thread")):
            with recipe.global_loader(world, workers=workers) as g:
                table[f"W={world} workers={workers.count}"] = [batch_sha256(next(g))[:10] for _ in range(steps)]
    with recipe.global_loader(4) as g:
        hs = [batch_sha256(next(g))[:10] for _ in range(steps // 2)]
        state = decode_state(encode_state(g.state_dict()))
    with recipe.global_loader(2) as g:
        g.load_state_dict(state)
        hs += [batch_sha256(next(g))[:10] for _ in range(steps - steps // 2)]
    table[f"W=4 -> resume W=2 at step {steps // 2}"] = hs
    print(f"{'run':<32}" + "".join(f" step {t:<5}" for t in range(steps)))
    for k, v in table.items():
        print(f"{k:<32} " + " ".join(f"{h:<10}" for h in v))
    same = len({tuple(v) for v in table.values()}) == 1
    print()
    print(
        f"global-batch SHA-256 identical across world sizes, workers and resume: {'YES' if same else 'NO'} "
        f"({time.time() - t0:.1f} s)"
    )
    print()
    print("\n".join(what_you_saw(recipe, first, list(table), steps, same)))
    return 0 if same else 1


def main(argv: list[str] | None = None) -> int:
    """Run the ``zephon`` command with ``argv`` (default: ``sys.argv[1:]``); the exit status.

    >>> import tempfile
    >>> from zephon.tools.demo import write_demo_recipe
    >>> path = write_demo_recipe(tempfile.mkdtemp(), scale=0.01)
    >>> toml = open(path).read().replace("buffer = 32", "buffer = 1")   # no shuffle window: fast
    >>> _ = open(path, "w").write(toml)
    >>> main(["hashes", path, "--world-size", "2", "--steps", "1", "--workers", "0"])
    step 0 ...
    0
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = bool(getattr(args, "debug", False)) or os.environ.get("ZEPHON_DEBUG", "") not in ("", "0")

    # SIGTERM (a scheduler's preemption) unwinds like Ctrl-C: pipelines cancelled, pools
    # closed, nothing left behind, and a watchdog ends the process if that takes too long
    try:
        with stop_on_signals(f"zephon {args.cmd}"), _warnings_as_lines(args.cmd):
            return _run(parser, args)
    except Terminated:
        print(f"zephon {args.cmd}: terminated (SIGTERM); workers stopped", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print(f"zephon {args.cmd}: interrupted; workers stopped", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of our output went away (`zephon hashes ... | head`): quietly
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (RecipeError, StateError, DataError, PipelineError, ValueError, OSError) as e:
        if debug:
            traceback.print_exc()
        tb = str(getattr(e, "worker_traceback", "") or "")
        if debug and tb:
            print("worker traceback:\n" + tb, file=sys.stderr)
        print(f"zephon {args.cmd}: error: {e}", file=sys.stderr)
        if not debug and tb:
            print("(run with --debug or ZEPHON_DEBUG=1 for the worker's traceback)", file=sys.stderr)
        return 2


@contextlib.contextmanager
def _warnings_as_lines(cmd: str) -> Any:
    """Warnings (bad records estimation sampled, skips shifting the mix) as one line each on
    stderr, ``zephon CMD: warning: ...``, not Python's two-line form with a source line."""
    with warnings.catch_warnings():

        def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
            print(f"zephon {cmd}: warning: {message}", file=sys.stderr)

        warnings.showwarning = show
        yield


#: a realized token share this far (absolute) from the declared one is reported as a warning
SHARE_DRIFT = 0.05


def share_report(recipe: Recipe, realized: Any, steps: int) -> list[str]:
    """Declared vs realized token shares of the first ``steps`` steps, and a warning line for
    each dataset whose realized share drifts from its declared one by more than
    :data:`SHARE_DRIFT` (skipped records deliver no tokens; by = "samples" weighs samples)."""
    w = np.asarray(recipe.schedule.weights(0), dtype=np.float64)
    declared = w / w.sum()
    names = [d.name for d in recipe.datasets]
    out = [
        "declared vs realized token shares: "
        + ", ".join(f"{n} {d:.3f} -> {r:.3f}" for n, d, r in zip(names, declared, realized))
    ]
    if recipe.spec.mixing.by != "tokens":
        return out  # weights are shares of samples: token shares differ by design
    for n, d, r, s in zip(names, declared, realized, recipe.datasets):
        if abs(r - d) > SHARE_DRIFT:
            why = " (its bad records are skipped: they deliver no tokens)" if s.on_error == "skip" else ""
            out.append(
                f"warning: dataset {n!r}: realized token share {r:.3f} over the first {steps} steps, declared "
                f"{d:.3f}{why}; over so few steps a share drifts by up to a document per lane"
            )
    return out


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.cmd == "demo":
        return _demo(args)
    if args.cmd == "ledger":
        if args.ledger_cmd == "show":
            return run_ledger_show(args.ledger)
        return run_ledger_diff(
            args.a,
            args.b,
            steps=args.steps,
            world_size=args.world_size,
            recipe_a=args.recipe_a,
            recipe_b=args.recipe_b,
        )
    if args.cmd == "warm":
        return run_warm(args.recipe, steps=args.steps, threads=args.threads, use_ray=args.ray, ray_address=args.address)
    recipe = Recipe.from_toml(args.recipe)
    if args.cmd == "hashes":
        if (args.save_at is None) != (args.checkpoint is None):
            parser.error("--save-at and --checkpoint go together")
        if args.checkpoint is not None and os.path.exists(args.checkpoint) and not os.path.isdir(args.checkpoint):
            raise ValueError(f"--checkpoint {args.checkpoint!r} is a file; name a folder (it is created if missing)")
        if args.resume is not None:
            _state_file(args.resume)  # before anything is prepared
        elif args.save_at is not None and args.save_at > args.steps:
            raise ValueError(
                f"--save-at {args.save_at} is past the last step this run computes ({args.steps}): nothing would "
                f"be saved; use --save-at <= --steps"
            )
        if args.workers is not None and args.workers > max_workers():
            raise ValueError(f"--workers {args.workers} is above the limit of {max_workers()} (4 x CPUs, at least 64)")
        check_world_size(recipe.lanes, args.world_size)
        run_hashes(
            recipe,
            world_size=args.world_size,
            steps=args.steps,
            workers=_workers(recipe, args.workers, args.backend),
            save_at=args.save_at,
            checkpoint=args.checkpoint,
            resume=args.resume,
            digest=args.digest,
            ledger=args.ledger,
            recipe_path=args.recipe,
        )
        return 0
    if args.cmd == "inspect":
        return _inspect(recipe, args)
    return 2


def _inspect(recipe: Recipe, args: argparse.Namespace) -> int:
    """``zephon inspect``: the plan, the memory budget, warnings, and what the first steps deliver."""
    print(describe_plan(recipe, args.world_size))
    world = args.world_size or 1
    print(recipe.memory_budget().describe(recipe.lanes // world, recipe.prefetch_depth(world)))
    for s, est in zip(recipe.datasets, recipe.estimates.values()):
        said = bad_samples_message(s, est, weighed=recipe.spec.data_version >= 5)
        if said is not None:
            print(f"warning: {said}")
    said = warm_line(recipe, args.warm_steps)  # before the measuring run below warms the cache
    if said:
        print(said)
    names = [d.name for d in recipe.datasets]
    with recipe.global_loader(1, workers=WorkerConfig(0)) as g:
        batches = [next(g) for _ in range(args.measure_steps)]
    valid = sum(int((b["document_ids"] >= 0).sum()) for b in batches)
    total = sum(b["document_ids"].size for b in batches)
    per_ds = np.bincount(
        np.concatenate([b["dataset"][b["dataset"] >= 0].ravel() for b in batches]), minlength=len(names)
    ) / max(valid, 1)
    print(
        f"packing efficiency over the first {len(batches)} steps: {valid / max(total, 1):.2%} non-padding tokens; "
        "realized token shares: " + ", ".join(f"{n} {s:.3f}" for n, s in zip(names, per_ds))
    )
    for line in share_report(recipe, per_ds, len(batches)):
        print(line)
    if any(d.kind == "chat" for d in recipe.spec.datasets):
        trained = np.sum([trained_counts(b, len(names)) for b in batches], axis=0)
        have = np.bincount(
            np.concatenate([b["dataset"][b["dataset"] >= 0].ravel() for b in batches]), minlength=len(names)
        )
        print(
            "trained tokens (label not -100) as a share of each dataset's tokens: "
            + ", ".join(f"{n} {t / max(h, 1):.3f}" for n, t, h in zip(names, trained, have))
        )
    print(diversity_line(recipe, batches))
    if args.show:
        b = batches[0]
        print()
        for line in format_batch_rows(recipe, b, args.show, width=2000):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
