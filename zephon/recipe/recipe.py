"""The :class:`Recipe`: one object that reads, validates, prepares and builds a pipeline.

A recipe is a pure description (:class:`~zephon.recipe.spec.RecipeSpec`): seed, lanes, sequence
length, global batch, tokenizer, datasets with token-share weights, packing, shuffling and
workers. ``Recipe.from_toml(path)`` checks every key before any worker starts;
:meth:`Recipe.prepare` reads what must be read once (:mod:`zephon.recipe.prepare`);
:meth:`Recipe.router` / :meth:`Recipe.global_loader` build the per-lane pipelines
(:mod:`zephon.recipe.build`). Workers are a performance setting only: they are not part of the
recipe's fingerprint.
"""

from __future__ import annotations

import copy
import html
import os
import stat
import sys
import threading
from collections.abc import Mapping
from typing import Any

from torchdata.nodes import BaseNode

from zephon.data import TextTokenizer
from zephon.engine import LaneContext, WorkerConfig
from zephon.engine.lanes import check_world_size
from zephon.engine.router import GlobalLoader, Router
from zephon.nodes import VisionConfig, WeightSchedule

from .budget import MemoryBudget, memory_budget, size
from .build import RecipeLanes, build_lane, prefetch_depth
from .estimate import TokenEstimate
from .filters import FilterSpec
from .fork import ForkLanes, ForkSpec, check_fork, fork_checkpoint
from .parse import parse_recipe
from .phases import describe_phases
from .prepare import Prepared, prepare, with_tokenizer
from .spec import DatasetSpec, RecipeError, RecipeSpec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["MAX_RECIPE_BYTES", "Recipe"]

#: the largest recipe file read: a recipe describes data and holds none (a 10 MB string in one is a
#: mistake, and would be copied into every fingerprint and message)
MAX_RECIPE_BYTES = 1 << 20


class Recipe:
    """A validated pipeline description. Build with :meth:`from_toml` or :meth:`from_dict`.

    Why a recipe: the data a run sees is a function of the recipe (and the files) alone, so it
    is validated up front, fingerprinted into every checkpoint, and every rank builds the same
    lanes from it. Nothing is read until :meth:`prepare` (or a loader) needs it.

    >>> from zephon.data import BUNDLED_TOKENIZER
    >>> cfg = {"seed": 1, "lanes": 4, "seq_len": 64, "global_batch_size": 8, "tokenizer": {"path": BUNDLED_TOKENIZER},
    ...        "datasets": [{"name": "web", "path": "web/*.jsonl", "weight": 1.0}]}
    >>> Recipe.from_dict(cfg).rows_per_lane, Recipe.from_dict(cfg).spec.pack
    (2, PackSpec(algorithm='greedy', flush_every=512, max_open=8, labels='document'))
    >>> Recipe.from_dict(dict(cfg, shufle={"buffer": 8}))
    Traceback (most recent call last):
    ...
    zephon.recipe.spec.RecipeError: recipe: unknown key 'shufle' in the recipe's top level. Did you mean 'shuffle'? ...
    """

    def __init__(self, config: Mapping[str, Any], base_dir: str = ".") -> None:
        try:
            self.raw = copy.deepcopy(dict(config))
        except RecursionError:
            raise RecipeError("recipe: it nests tables or lists too deeply to be a recipe") from None
        self.base_dir = os.path.abspath(base_dir)
        self.spec: RecipeSpec = parse_recipe(self.raw, self.base_dir)
        #: the ``[[filters]]`` entries (:mod:`zephon.recipe.filters`), in order
        self.filters: tuple[FilterSpec, ...] = self.spec.filters
        #: the ``[fork]`` section (:mod:`zephon.recipe.fork`): the run this recipe continues, and from which step
        self.fork: ForkSpec | None = self.spec.fork
        self._parent: Recipe | None = None
        self._prepared: Prepared | None = None
        self._own_tokenizer: TextTokenizer | None = None
        self._lock = threading.Lock()

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def from_toml(cls, path: str | os.PathLike) -> Recipe:
        """Read and validate a TOML recipe; relative paths are relative to its folder."""
        path = os.fspath(path)
        try:
            st = os.stat(path)
            if stat.S_ISREG(st.st_mode) and st.st_size > MAX_RECIPE_BYTES:
                raise RecipeError(
                    f"recipe file {path!r} is {st.st_size} bytes; a recipe is at most {MAX_RECIPE_BYTES} bytes "
                    "(it describes data, it holds none): is this the right file?"
                )
            if not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode):
                raise RecipeError(
                    f"recipe path {path!r} is not a regular file (a FIFO, socket or device); name the file"
                )
            with open(path, "rb") as f:
                data = tomllib.loads(f.read(MAX_RECIPE_BYTES + 1).decode("utf-8"))
        except RecursionError:
            raise RecipeError(f"recipe file {path!r} nests tables or arrays too deeply to be a recipe") from None
        except FileNotFoundError:
            raise RecipeError(f"recipe file {path!r} does not exist") from None
        except IsADirectoryError:
            raise RecipeError(f"recipe path {path!r} is a directory, not a TOML file; name the recipe file") from None
        except PermissionError:
            raise RecipeError(f"recipe file {path!r} is not readable (permission denied)") from None
        except OSError as e:
            raise RecipeError(f"recipe file {path!r} cannot be read: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise RecipeError(
                f"recipe file {path!r} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at byte {e.start}); "
                "save it as UTF-8"
            ) from None
        except tomllib.TOMLDecodeError as e:
            raise RecipeError(f"recipe file {path!r} is not valid TOML: {e}") from None
        return cls(data, base_dir=os.path.dirname(os.path.abspath(path)))

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], base_dir: str = ".") -> Recipe:
        """Validate a recipe given as a dict (the TOML's structure); relative paths are
        relative to ``base_dir``."""
        return cls(config, base_dir)

    def replace(self, **changes: Any) -> Recipe:
        """A copy with top-level keys replaced (sections are dicts), re-validated."""
        raw = copy.deepcopy(self.raw)
        raw.update(changes)
        return Recipe(raw, self.base_dir)

    # -- the description (read-only views of :attr:`spec`) ------------------------------------
    @property
    def seed(self) -> int:
        """The run's seed (every random stream derives from it, the lane and the operator)."""
        return self.spec.seed

    @property
    def lanes(self) -> int:
        """The lane count, fixed for the life of a run; the valid world sizes are its divisors."""
        return self.spec.lanes

    @property
    def seq_len(self) -> int:
        """Tokens per training row (rows are packed to ``seq_len + 1`` for the shifted labels)."""
        return self.spec.seq_len

    @property
    def global_batch_size(self) -> int:
        """Packed rows per step, all ranks together."""
        return self.spec.global_batch_size

    @property
    def rows_per_lane(self) -> int:
        """Rows each lane contributes to a step."""
        return self.spec.rows_per_lane

    def rows_per_lane_at(self, step: int) -> int:
        """Rows each lane contributes to ``step`` (``[[batch_schedule]]`` applied)."""
        return self.spec.rows_per_lane_at(step)

    def global_batch_size_at(self, step: int) -> int:
        """Rows of global batch ``step``, all ranks together."""
        return self.spec.rows_per_lane_at(step) * self.spec.lanes

    def seq_len_at(self, step: int) -> int:
        """Tokens per row at ``step``."""
        return self.spec.seq_len_at(step)

    def describe_phases(self) -> list[str]:
        """The ``[[batch_schedule]]`` phases as table lines (steps, rows, tokens, memory per lane); [] without one."""
        return describe_phases(self.spec)

    @property
    def batch_phases(self) -> list[tuple[int, int, int]]:
        """``(first step, global_batch_size, seq_len)`` of each phase of ``[[batch_schedule]]`` (one without)."""
        return self.spec.batch_phases

    @property
    def datasets(self) -> tuple[DatasetSpec, ...]:
        """The ``[[datasets]]`` entries, in recipe order (their index is the ``dataset`` field)."""
        return self.spec.datasets

    @property
    def multimodal(self) -> bool:
        """Whether the recipe has image-text datasets (its lanes pack with MMPack)."""
        return self.spec.multimodal

    @property
    def schedule(self) -> WeightSchedule:
        """The mixture weights per phase (a curriculum when ``[[schedule]]`` is given)."""
        return self.spec.schedule

    @property
    def workers(self) -> WorkerConfig:
        """The ``[workers]`` setting (see :class:`~zephon.recipe.spec.WorkersSpec` for per-stage ones)."""
        return self.spec.workers.default

    @property
    def vision(self) -> VisionConfig:
        """Image preprocessing and budgets (``[vision]``)."""
        return self.spec.vision.config

    def data_definition(self) -> dict[str, Any]:
        """Everything that defines the data (see :meth:`RecipeSpec.data_definition`), with the
        ``[[filters]]`` when there are any."""
        out = self.spec.data_definition()
        if self.filters:
            out["filters"] = [f.definition() for f in self.filters]
        if self.fork is not None:
            out["fork"] = {"parent": os.path.basename(self.fork.parent), "step": self.fork.step}
        return with_tokenizer(out, self._loaded_tokenizer()) if self.spec.data_version >= 4 else out

    def _loaded_tokenizer(self) -> TextTokenizer:
        """The run's tokenizer, loaded without the rest of :meth:`prepare` if not prepared yet."""
        if self._prepared is not None:
            return self._prepared.tokenizer
        if self._own_tokenizer is None:
            t = self.spec.tokenizer
            try:
                self._own_tokenizer = TextTokenizer(
                    t.path, t.add_bos, t.add_eos, t.bos_token, t.eos_token, t.special_tokens_in_text
                )
            except (OSError, ValueError) as e:
                raise RecipeError(f"recipe: [tokenizer]: {e}") from None
        return self._own_tokenizer

    @property
    def parent(self) -> Recipe:
        """The recipe a ``[fork]`` continues (read once, checked: its fingerprint if the fork gives
        one, and that it differs from this recipe only in what a fork may change)."""
        if self.fork is None:
            raise RecipeError("recipe: this recipe has no [fork] section, so no parent")
        if self._parent is None:
            parent = Recipe.from_toml(self.fork.parent)
            if parent.fork is not None:
                raise RecipeError(f"recipe: [fork] parent {self.fork.parent!r} is a fork itself; fork its parent")
            if self.fork.fingerprint is not None and parent.fingerprint != self.fork.fingerprint:
                raise RecipeError(
                    f"recipe: [fork] parent {self.fork.parent!r} has fingerprint {parent.fingerprint!r}, not the "
                    f"{self.fork.fingerprint!r} the fork names: the parent recipe or its data changed since the run"
                )
            mine, theirs = self._loaded_tokenizer(), parent._loaded_tokenizer()
            if mine.identity != theirs.identity:
                raise RecipeError(
                    f"recipe: [fork]: the tokenizer differs from the parent recipe's ({theirs.path!r}, identity "
                    f"{theirs.identity} -> {mine.path!r}, identity {mine.identity}): a fork keeps the tokenizer "
                    "(every document would be split into other ids); point [tokenizer] path at the parent's "
                    "tokenizer, or start a new run"
                )
            check_fork(parent.data_definition(), self.data_definition())
            self._parent = parent
        return self._parent

    # -- preparation (I/O: indexing, tokenizer, estimation) ---------------------------------
    def prepare(self, progress: bool | None = None, group: Any = None) -> Prepared:
        """Index the datasets, load the tokenizer and estimate tokens (once per Recipe object).
        ``group`` (a ``torch.distributed`` process group, or ``"world"``: the default one): the
        ranks index the datasets together, each a slice of the shards; every rank of the group
        must call it, first (later calls, and the properties that prepare, reuse the result)."""
        with self._lock:
            if self._prepared is None:
                fork = None if self.fork is None else (self.parent.fingerprint, self.fork.step)
                self._prepared = prepare(self.spec, progress, group, self.filters, fork)
            return self._prepared

    @property
    def fingerprint(self) -> str:
        """Hash of the data definition (recipe, data files, tokenizer): a checkpoint made under
        another fingerprint is refused."""
        return self.prepare().fingerprint

    @property
    def tokenizer(self) -> TextTokenizer:
        """The run's tokenizer (loaded on first use)."""
        return self.prepare().tokenizer

    @property
    def special_tokens(self) -> dict[str, int]:
        """Ids of the vision placeholders (``image``, ``video``, ``vision_start``, ``vision_end``)
        of a vision-language recipe; empty for a text recipe."""
        return dict(self.prepare().special)

    @property
    def pad_id(self) -> int:
        """The id of padding in the batches (the tokenizer's pad token, else its EOS, else 0)."""
        return self.prepare().pad_id

    @property
    def estimates(self) -> dict[str, TokenEstimate]:
        """Measured tokens per byte per dataset."""
        return dict(self.prepare().estimates)

    @property
    def indexes(self) -> list[Any]:
        """The datasets' shard indexes, in recipe order."""
        return list(self.prepare().indexes)

    # -- pipelines --------------------------------------------------------------------------
    def continue_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """A fork's start from its parent run: the parent's checkpoint ``state`` (a
        ``state_dict()``, decoded, all ranks merged) taken at or before the fork step, as a state
        this recipe's loaders load (see :func:`zephon.recipe.fork.fork_checkpoint`)."""
        if self.fork is None:
            raise RecipeError("recipe: continue_state needs a [fork] section naming the parent and the step")
        return fork_checkpoint(
            state,
            parent=self.parent.fingerprint,
            fork=self.fingerprint,
            step=self.fork.step,
            shared=self.lane_set().shared_state(),
        )

    def lane_set(self, workers: WorkerConfig | None = None) -> RecipeLanes | ForkLanes:
        """The lanes of this recipe for a router (``workers`` overrides every stage's); a fork's
        run the parent's lanes before the fork step."""
        own = RecipeLanes(self.prepare(), workers, self._respec)
        if self.fork is None:
            return own
        parent = self.parent.lane_set(workers)
        if not isinstance(parent, RecipeLanes):  # refused by `parent` already: a fork of a fork
            raise RecipeError("recipe: a [fork] parent must be a recipe without [fork]")
        return ForkLanes(parent, own, self.fork.step)

    def _respec(self, data_version: int) -> RecipeSpec:
        """This recipe's spec under another data version (its own keys kept)."""
        return parse_recipe(dict(self.raw) | {"data_version": data_version}, self.base_dir)

    def build_lane(self, ctx: LaneContext) -> BaseNode:
        """The pipeline of one lane (a torchdata node yielding micro-batches)."""
        if self.fork is not None:
            return self.lane_set()(ctx)
        return build_lane(self.prepare(), ctx)

    def lane_context(self, lane: int, workers: WorkerConfig | None = None) -> LaneContext:
        """The context ``build_lane`` needs for ``lane`` of this recipe (seed and lanes filled in)."""
        if not 0 <= lane < self.lanes:
            raise ValueError(f"lane must be in [0, {self.lanes}), got {lane}")
        return LaneContext(seed=self.seed, lane=lane, lanes=self.lanes, workers=workers or self.workers)

    def prefetch_depth(self, world_size: int) -> int:
        """Local batches a rank computes ahead (see :func:`zephon.recipe.build.prefetch_depth`)."""
        return prefetch_depth(self.spec, world_size)

    def memory_budget(self) -> MemoryBudget:
        """The most bytes one lane holds, worst case (the shuffle window's rows with their
        pixels, the micro-batch being built, samples in flight); ``describe`` says it in a line."""
        return memory_budget(self.spec)

    def check_memory(self, world_size: int, lanes: int | None = None, prefetch: int | None = None) -> None:
        """Refuse a loader whose ``lanes`` (default: one rank's share at ``world_size``) with
        ``prefetch`` local batches ahead would hold more than the memory limit, worst case."""
        b = memory_budget(self.spec)
        lanes = self.lanes // world_size if lanes is None else lanes
        prefetch = self.prefetch_depth(world_size) if prefetch is None else prefetch
        need = b.rank_bytes(lanes, prefetch)
        if need > b.limit_gb * 1e9:
            raise RecipeError(
                f"recipe: {lanes} lane(s) in this process hold up to {size(need)} ({size(b.lane_bytes)} "
                f"per lane, {prefetch} local batches prefetched), above the memory limit of {b.limit_gb:g} GB; run "
                "more ranks (fewer lanes each), lower [shuffle] buffer or [workers] prefetch, or raise the limit "
                "with memory_gb = N at the recipe's top level or $ZEPHON_MEMORY_GB"
            )

    def _loader_kwargs(self, world_size: int, workers: WorkerConfig | None, kw: dict[str, Any]) -> dict[str, Any]:
        kw.setdefault("prefetch", self.prefetch_depth(world_size))
        return dict(
            lanes=self.lanes, seed=self.seed, fingerprint=self.fingerprint, workers=workers or self.workers, **kw
        )

    def router(self, world_size: int = 1, rank: int = 0, workers: WorkerConfig | None = None, **kw: Any) -> Router:
        """This rank's loader (a torchdata node yielding its local batches). ``workers``
        overrides every worker setting of the recipe (performance only)."""
        check_world_size(self.lanes, world_size)
        self.check_memory(world_size, prefetch=kw.get("prefetch"))
        return Router(
            self.lane_set(workers), world_size=world_size, rank=rank, **self._loader_kwargs(world_size, workers, kw)
        )

    def global_loader(self, world_size: int = 1, workers: WorkerConfig | None = None, **kw: Any) -> GlobalLoader:
        """All ``world_size`` ranks in this process: yields global batches (tests, hashes)."""
        check_world_size(self.lanes, world_size)
        self.check_memory(world_size, lanes=self.lanes, prefetch=kw.get("prefetch"))
        return GlobalLoader(
            self.lane_set(workers), world_size=world_size, **self._loader_kwargs(world_size, workers, kw)
        )

    def _repr_html_(self) -> str:
        s = self.spec
        rows = "".join(
            f"<tr><td>{html.escape(d.name)}</td><td>{html.escape(d.kind)}</td>"
            f"<td>{html.escape(d.format)}</td><td>{d.weight:g}</td><td>{html.escape(d.policy)}</td>"
            f"<td>{html.escape(d.on_error)}</td><td><code>{html.escape(str(d.path))}</code></td></tr>"
            for d in s.datasets
        )
        return (
            f'<div class="zephon-recipe"><b>Recipe</b>: seed {s.seed} &middot; {s.lanes} lanes &middot; '
            f"seq_len {s.seq_len} &middot; global batch {s.global_batch_size} rows "
            f"({s.rows_per_lane} per lane) &middot; pack {s.pack.algorithm} (flush every {s.pack.flush_every}) "
            f"&middot; shuffle {s.shuffle.buffer} &middot; mixing by {s.mixing.by} &middot; workers "
            f"{self.workers.count} {self.workers.backend}"
            "<table><tr><th>dataset</th><th>kind</th><th>format</th><th>weight</th><th>policy</th><th>on_error</th>"
            f"<th>path</th></tr>{rows}</table></div>"
        )

    def __repr__(self) -> str:
        s = self.spec
        ds = ", ".join(f"{d.name}={d.weight:g}" for d in s.datasets)
        return (
            f"Recipe(seed={s.seed}, lanes={s.lanes}, seq_len={s.seq_len}, global_batch_size={s.global_batch_size}, "
            f"datasets=[{ds}], pack={s.pack.algorithm}, shuffle={s.shuffle.buffer}, "
            f"workers={self.workers.count} {self.workers.backend})"
        )
