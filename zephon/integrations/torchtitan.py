"""TorchTitan integration: a ``BaseDataLoader`` whose global batches survive a change of DP degree.

Import this module explicitly (``import zephon.integrations.torchtitan``); ``import zephon`` never imports
TorchTitan. Requires ``torchtitan==0.3.0`` (from a clone of the repository: ``pip install ".[titan]"``).

Use it with any TorchTitan model config
---------------------------------------
Write a config function (TorchTitan's ``--module`` / ``--config`` registry) that takes the model's
own config and swaps in zephon with :func:`with_zephon`::

    # my_configs.py
    from torchtitan.models.llama3.config_registry import llama3_8b
    from zephon.integrations.torchtitan import with_zephon

    def llama3_8b_zephon():
        return with_zephon(llama3_8b(), "/data/recipes/pretrain.toml", local_batch_size=2)

    # torchrun --nproc_per_node=8 -m torchtitan.train --module my_configs --config llama3_8b_zephon

:func:`with_zephon` sets ``dataloader``, ``training.seq_len`` and ``training.global_batch_size``
from the recipe (the global batch is fixed by the recipe; ``training.local_batch_size`` is then
yours to pick per DP degree: ``global = local x dp x grad-accum``). Point ``hf_assets_path`` at a
tokenizer with the same vocabulary as the recipe's (the loader checks). The bundled example
(:mod:`zephon.integrations.torchtitan_demo`)::

    torchrun --standalone --nproc_per_node=2 -m torchtitan.train \\
        --module zephon.integrations.torchtitan_demo --config zephon_llama3_debug --training.local_batch_size 8

Fields of :class:`ZephonDataLoader.Config` override recipe values from the command line, e.g.
``--dataloader.workers 4 --dataloader.backend process`` (performance only: the data is the same)
or ``--dataloader.lanes 64`` (a new data definition: a checkpoint of the old one refuses to load).

Vision-language recipes
-----------------------
With a recipe whose datasets include ``kind = "image_text"`` or ``"interleaved"``, ``next()`` yields
TorchTitan 0.3.0's multimodal batch (what ``MultiModalCollator`` yields, see :func:`titan_mm_batch`):
``input``, ``positions``, ``mrope_positions``, ``pixel_values`` ``[images, max_patches, patch_dim]``,
``grid_thw``, ``pixel_values_videos=None``, ``grid_thw_videos=None``, ``special_tokens`` (ids of the
recipe tokenizer's ``<|image_pad|>``, ``<|video_pad|>``, ``<|vision_start|>``, ``<|vision_end|>``
and padding), so Qwen3.5's ``forward`` takes it unchanged. Use it with the Qwen3.5 configs through
:func:`with_zephon` (the trainer's ``MultiModalTokenizer`` must have the same special-token ids;
the loader checks). A microbatch slice of a step carries exactly the images of its rows.

Resuming on another number of ranks
-----------------------------------
``state_dict()`` holds one JSON ``bytes`` value per lane this rank owns (``"lane_00007"``) and
one rank-independent entry (``"zephon"``: format version, lane count, seed, recipe fingerprint,
step). DCP keeps every key once, and on load asks the *new* loader for its keys, so a checkpoint
saved on 4 ranks loads on 1, 2 or 8: each rank picks up the lanes it now owns. Tensor-, pipeline- and
context-parallel peers of one DP rank get identical batches: by default only the lowest of them
reads and broadcasts each step to the others (``read_once``, :mod:`zephon.recipe.peers`), and
only its state holds the lanes (the others' is empty); with ``read_once = False`` every peer reads
and writes identical values under identical keys. Either checkpoint loads in either mode.

Gradient accumulation and pipeline microbatches
-----------------------------------------------
A recipe step is one optimizer step: ``global_batch_size`` rows, of which DP rank r of W gets the
``global_batch_size / W`` rows of its lanes (in lane order). The trainer asks for
``local_batch_size`` rows per ``next()``, so the loader fetches one recipe step and hands it out
in ``global_batch_size / (W x local_batch_size)`` consecutive slices (grad-accum steps x pipeline
microbatches). A checkpoint can only be taken between recipe steps (TorchTitan saves after the
optimizer step, which is exactly there); ``state_dict()`` in the middle of a recipe step raises,
because the rows still owed by a half-used step cannot be redistributed to another DP degree.
Built from a :func:`with_zephon` trainer config, the loader also checks at build time that the
trainer's step equals the recipe's global batch, and says which flag to change when it does not.

Validation on one fixed set, on every DP degree
-----------------------------------------------
``ZephonDataLoader`` also works as TorchTitan's ``validator.dataloader``. Give it a finite recipe
(every dataset ``policy = "stop"``, ``[shuffle] buffer = 1``): on any number of DP ranks it yields
the same rows in total, every rank the same number of steps, and all ranks stop on the same
``next()`` call (the end of the data is a global step boundary, see ``end`` in the recipe), so
``validator.steps = -1`` (the whole set) never hangs and the validation loss of a model is the
same on 1, 2 or 64 ranks. ``with_zephon(config, train_recipe, validation="val.toml")`` sets it up.
TorchTitan's own loader splits a validation set by rank into unequal parts (each rank a different
number of steps: with ``steps = -1`` the ranks' collectives no longer match).

The batch ledger
----------------
The trainer's loader writes one line per step to ``<dump_folder>/zephon_ledger/rank_NNNNN.jsonl``:
the digest of each of the rank's lane micro-batches and its tokens per dataset (each rank hashes
only its own lanes; nothing crosses ranks). ``zephon ledger show DUMP_FOLDER`` prints the digest
of every global batch, ``zephon hashes RECIPE --digest ledger`` prints the same digests from the
recipe alone (a CPU can check what a GPU job consumed), and ``zephon ledger diff A B`` compares
two runs, or a run and a recipe (the format: :mod:`zephon.recipe.ledger`; reading and diffing:
:mod:`zephon.tools.ledger`, :mod:`zephon.tools.ledger_diff`). A resumed run appends.
``--dataloader.ledger false`` turns it off.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import numpy as np
import torch
import tyro
from torchtitan.components.dataloader import BaseDataLoader

from zephon.engine import StateError, WorkerConfig
from zephon.engine.checkpoint import SHARED_KEY, decode_state, encode_state, is_lane_key
from zephon.engine.lanes import divisors
from zephon.recipe import LoaderMetrics, RankBatches, Recipe, RecipeError
from zephon.recipe.ledger import LEDGER_DIR, LedgerWriter, dataset_tokens
from zephon.recipe.peers import FollowerBatches, LeaderBatches

from .peers import DistPeerLink
from .titan_metrics import register_loader, zephon_metrics_config

__all__ = ["RECIPE_NAMES", "ZephonDataLoader", "titan_mm_batch", "with_zephon"]

_LOG = logging.getLogger("zephon")

#: keys of a batch that TorchTitan's decoder models (llama3, qwen3, ...) accept besides ``input``
MODEL_KEYS = ("positions",)

#: named recipes ``ZephonDataLoader.Config.recipe`` accepts besides a path: name -> a function
#: returning the TOML path (:mod:`zephon.integrations.torchtitan_demo` adds ``"demo"``)
RECIPE_NAMES: dict[str, Callable[[], str]] = {}


def titan_mm_batch(
    batch: dict[str, np.ndarray],
    lo: int,
    hi: int,
    *,
    special_tokens: dict[str, int],
    merge_size: int,
    with_positions: bool = True,
    with_mrope: bool = True,
) -> tuple[dict[str, Any], torch.Tensor]:
    """Rows ``lo:hi`` of a zephon multimodal batch in TorchTitan 0.3.0's multimodal batch format
    (what ``MultiModalCollator`` yields, so Qwen3.5's ``forward`` takes it as is)::

        input            int64 [rows, seq_len]
        positions        int64 [rows, seq_len]   (reset per document)
        mrope_positions  int64 [rows, seq_len, 3] (T/H/W rotary positions)
        pixel_values     float32 [images, max_patches, patch_dim] (zero-padded per image; max_patches
                         rounded up to a multiple of merge_size**2), or None without images
        grid_thw         int64 [images, 3], or None
        pixel_values_videos, grid_thw_videos: None
        special_tokens   {"image_id", "video_id", "vision_start_id", "vision_end_id", "pad_id"}

    and labels int64 [rows, seq_len] (already shifted; -100 on vision tokens and padding).
    Images are in token order (row-major), as the model's ``get_vision_positions`` expects.
    zephon-only fields (``provenance``, ``document_ids``, ``dataset``) are left out: use
    :meth:`ZephonDataLoader.on_local_batch` to see them.

    >>> z = np.zeros((2, 8), np.int64)
    >>> batch = {"input": z, "labels": z, "positions": z, "mrope_positions": np.zeros((2, 8, 3), np.int64),
    ...          "images_per_row": np.array([0, 2]), "grid_thw": np.array([[1, 2, 2], [1, 2, 4]]),
    ...          "pixel_values": np.ones((12, 1536), np.float32), "provenance": [(), ()]}
    >>> inputs, labels = titan_mm_batch(batch, 1, 2, special_tokens={"image_id": 9}, merge_size=2)
    >>> tuple(inputs["pixel_values"].shape), inputs["grid_thw"].tolist(), tuple(labels.shape)
    ((2, 8, 1536), [[1, 2, 2], [1, 2, 4]], (1, 8))
    >>> "provenance" in inputs, inputs["pixel_values_videos"], inputs["special_tokens"]
    (False, None, {'image_id': 9})
    """
    per_row = batch["images_per_row"]
    starts = np.concatenate([[0], np.cumsum(per_row)])
    i0, i1 = int(starts[lo]), int(starts[hi])
    grids = batch["grid_thw"]
    patches = grids.prod(axis=1) if len(grids) else np.zeros(0, np.int64)
    pstart = np.concatenate([[0], np.cumsum(patches)])
    out: dict[str, Any] = {"input": torch.from_numpy(np.ascontiguousarray(batch["input"][lo:hi], dtype=np.int64))}
    if with_positions:
        out["positions"] = torch.from_numpy(np.ascontiguousarray(batch["positions"][lo:hi], dtype=np.int64))
    if i1 > i0:
        counts = patches[i0:i1]
        unit = merge_size * merge_size
        width = int(counts.max())
        width = -(-width // unit) * unit
        pv = np.zeros((i1 - i0, width, batch["pixel_values"].shape[1]), dtype=np.float32)
        for j in range(i1 - i0):
            a, b = int(pstart[i0 + j]), int(pstart[i0 + j + 1])
            pv[j, : b - a] = batch["pixel_values"][a:b]
        out["pixel_values"] = torch.from_numpy(pv)
        out["grid_thw"] = torch.from_numpy(np.ascontiguousarray(grids[i0:i1], dtype=np.int64))
    else:
        out["pixel_values"] = None
        out["grid_thw"] = None
    out["pixel_values_videos"] = None
    out["grid_thw_videos"] = None
    if with_mrope and "mrope_positions" in batch:
        out["mrope_positions"] = torch.from_numpy(np.ascontiguousarray(batch["mrope_positions"][lo:hi], dtype=np.int64))
    out["special_tokens"] = dict(special_tokens)
    labels = torch.from_numpy(np.ascontiguousarray(batch["labels"][lo:hi], dtype=np.int64))
    return out, labels


class ZephonDataLoader(BaseDataLoader):
    """One DP rank's zephon loader for TorchTitan: yields ``({"input", "positions"}, labels)``.

    Built by the trainer as ``config.build(dp_world_size=, dp_rank=, tokenizer=, seq_len=,
    local_batch_size=, ...)``; the steps, slices, checkpoint rule and end of the data are a
    :class:`zephon.recipe.RankBatches`. See the module docstring for the contract.

    >>> import tempfile
    >>> from zephon.tools.demo import write_demo_recipe
    >>> path = write_demo_recipe(tempfile.mkdtemp(), scale=0.01)
    >>> loader = ZephonDataLoader(ZephonDataLoader.Config(recipe=path, workers=0), dp_world_size=2, dp_rank=1,
    ...                           local_batch_size=4)
    >>> inputs, labels = next(loader)
    >>> sorted(inputs), tuple(inputs["input"].shape), loader.microbatches_per_step
    (['input', 'positions'], (4, 256), 4)
    >>> for _ in range(3):   # the rest of the recipe step: a checkpoint falls between steps
    ...     _ = next(loader)
    >>> sorted(loader.state_dict())[:2]   # rank 1 of 2 owns lanes 8..15 of 16
    ['lane_00008', 'lane_00009']
    >>> loader.close()
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        recipe: str = ""
        """Path of the zephon recipe (TOML), or a name of ``RECIPE_NAMES`` ("demo" with
        ``--module zephon.integrations.torchtitan_demo``)."""

        seed: int | None = None
        """Override the recipe's seed (a new data definition)."""

        lanes: int | None = None
        """Override the recipe's lane count (a new data definition; every DP degree must divide it)."""

        recipe_seq_len: int | None = None
        """Override the recipe's seq_len (a new data definition; must equal training.seq_len)."""

        global_batch_size: int | None = None
        """Override the recipe's global batch in rows (a new data definition)."""

        workers: int | None = None
        """Override the recipe's worker count (performance only: never changes the data)."""

        backend: Literal["thread", "process"] | None = None
        """Override the recipe's worker backend (performance only)."""

        with_positions: bool = True
        """Pass per-document ``positions`` to the model (RoPE and document masks)."""

        check_tokenizer: bool = True
        """Refuse a trainer tokenizer whose vocabulary differs from the recipe's."""

        log_every: int = 100
        """Log the pipeline's metrics (records/s per node, time waiting on workers, skipped
        records, packing efficiency) every N recipe steps through the ``zephon`` logger; 0 = never."""

        infinite: bool = True
        """Set by TorchTitan's validator (False for ``validator.steps = -1``: the whole set). How
        long the data lasts is the recipe's choice (dataset ``policy``); False needs a finite
        recipe (every dataset ``policy = "stop"``)."""

        read_once: bool = True
        """Model-parallel peers of a DP rank (the ranks with the same ``dp_rank``: TP, PP, CP) share one
        pipeline: the lowest rank reads and broadcasts each step to the others over gloo
        (:mod:`zephon.integrations.peers`); False = every peer reads alone (same batches, N x CPU)."""

        ledger: bool = True
        """Write the batch ledger (one line per step: the digest of each of this rank's lane
        micro-batches and its tokens per dataset) to ``<dump_folder>/zephon_ledger/`` when built
        by TorchTitan's trainer, or to ``ledger_dir``."""

        dashboard: bool = True
        """Add this loader's metrics to TorchTitan's metrics logger (TensorBoard / W&B) at each of its
        log steps (needs the trainer's ``metrics`` from :func:`with_zephon`; see
        :mod:`zephon.integrations.titan_metrics`)."""

        ledger_dir: str = ""
        """Folder for the batch ledger ("" = ``<dump_folder>/zephon_ledger`` inside the trainer;
        outside a trainer no ledger is written unless this is set)."""

        # The trainer's facts, passed in by a with_zephon config once the command line is parsed:
        # internal plumbing, so not command-line flags (tyro.conf.Suppress, as TorchTitan's own
        # Trainer.Config.model_spec); set --dump_folder and --training.* instead.
        dump_folder: Annotated[str, tyro.conf.Suppress] = ""
        """The trainer's ``dump_folder`` ("" = not built by a trainer); leave it unset."""

        trainer_global_batch_size: Annotated[int, tyro.conf.Suppress] = 0
        """The trainer's ``training.global_batch_size``: the loader refuses a trainer step that
        is not one recipe step (0 = no trainer)."""

        trainer_local_batch_size: Annotated[int, tyro.conf.Suppress] = 0
        """The trainer's ``training.local_batch_size``."""

        def recipe_file(self) -> str:
            """The recipe's TOML path (a name of ``RECIPE_NAMES`` resolved)."""
            if not self.recipe:
                raise RecipeError(
                    "ZephonDataLoader.Config.recipe is empty: set it to a recipe TOML path "
                    '(--dataloader.recipe path/to/recipe.toml), or "demo" for the bundled demo data'
                )
            named = RECIPE_NAMES.get(self.recipe)
            return named() if named is not None else self.recipe

        def load_recipe(self) -> Recipe:
            """The recipe with this config's overrides applied (validated)."""
            recipe = Recipe.from_toml(self.recipe_file())
            fields = {"seed": self.seed, "lanes": self.lanes, "seq_len": self.recipe_seq_len}
            fields["global_batch_size"] = self.global_batch_size
            changes = {k: v for k, v in fields.items() if v is not None}
            return recipe.replace(**changes) if changes else recipe

        def worker_override(self, recipe: Recipe) -> WorkerConfig | None:
            """The workers every pool of the recipe uses when ``workers`` / ``backend`` are set
            (they win over ``[workers]``, ``[tokenize]`` and ``[vision]``); None keeps the recipe's."""
            return recipe.spec.workers.override(recipe.multimodal, self.workers, self.backend)

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int = 1,
        dp_rank: int = 0,
        tokenizer: Any = None,
        seq_len: int | None = None,
        local_batch_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.config = config
        self.recipe = r = config.load_recipe()
        self.dp_world_size, self.dp_rank = int(dp_world_size), int(dp_rank)
        longest = max(n for _, _, n in r.batch_phases)  # a [[batch_schedule]]: the model sees its longest rows
        if seq_len is not None and seq_len != longest:
            raise ValueError(
                f"zephon.integrations.torchtitan: training.seq_len = {seq_len} but the recipe has seq_len = {longest}. Set "
                f"--training.seq_len {longest}, or change the recipe (seq_len = {seq_len} in the TOML, or "
                f"--dataloader.recipe_seq_len {seq_len}; either is a new data definition)."
            )
        if not config.infinite and not r.spec.finite:
            repeating = [d.name for d in r.datasets if d.policy != "stop"]
            raise ValueError(
                f"zephon.integrations.torchtitan: the loader was asked for a finite pass (infinite = False: TorchTitan's "
                f"validator.steps = -1) but the recipe {config.recipe!r} never ends: dataset {repeating[0]!r} has "
                'policy = "repeat". Set policy = "stop" on every dataset (and [shuffle] buffer = 1 for a fixed '
                "validation set), or set --validator.steps N."
            )
        self.batches = self._open(local_batch_size)
        self.rows_per_step = self.batches.rows_per_step  # this rank's rows of one recipe step
        self.local_batch_size = self.batches.local_batch_size
        #: ``next()`` calls per recipe step (= grad-accum steps x pipeline microbatches)
        self.microbatches_per_step = self.batches.microbatches_per_step
        try:
            self._check_trainer()
            if tokenizer is not None and config.check_tokenizer and not isinstance(self.batches, FollowerBatches):
                self._check_tokenizer(tokenizer)
        except ValueError:
            self.close()
            raise
        self.special_tokens: dict[str, int] = {}
        if r.multimodal:
            self.special_tokens = {f"{k}_id": v for k, v in r.special_tokens.items()}
            self.special_tokens["pad_id"] = r.pad_id
        self._tensors: dict[str, torch.Tensor] = {}  # the current step as tensors (text recipes)
        #: per-step metrics for dashboards (:meth:`dashboard_metrics`)
        self.step_metrics = LoaderMetrics(r)
        self.step_metrics.step = self.batches.step
        if config.dashboard:
            register_loader(self)

    def _open(self, local_batch_size: int | None) -> RankBatches:
        r, W = self.recipe, self.dp_world_size
        G = r.global_batch_size
        hints = {
            "world_size": f"Run with a DP degree in {divisors(r.lanes)}, or start a new run with a lane count that "
            f"every DP degree you will use divides (e.g. lanes = {math.lcm(r.lanes, max(W, 1))}; --dataloader.lanes N, "
            "which changes the data definition).",
            "local_batch_size": f"Set --training.local_batch_size to one of {divisors(max(G // max(W, 1), 1))} (with "
            f"--training.global_batch_size {G}; gradient accumulation = rows per step / local_batch_size).",
            "between_steps": "Make one trainer step consume exactly the recipe's global batch "
            f"(--training.global_batch_size {G}).",
        }
        if W < 1 or not 0 <= self.dp_rank < W:
            raise ValueError(
                f"zephon.integrations.torchtitan: dp_rank must be in [0, dp_world_size), got {self.dp_rank} of {W}"
            )
        cfg = self.config
        folder = cfg.ledger_dir or (os.path.join(cfg.dump_folder, LEDGER_DIR) if cfg.dump_folder else "")
        #: the model-parallel peers sharing this DP rank's pipeline (None: this rank reads alone)
        self.peers = DistPeerLink.for_dp_rank(self.dp_rank, W) if cfg.read_once else None
        kind: type[RankBatches] = RankBatches
        extra: dict[str, Any] = {}
        if self.peers is not None:
            kind, extra = (LeaderBatches if self.peers.leader else FollowerBatches), {"link": self.peers}
        try:
            batches = kind(
                r,
                W,
                self.dp_rank,
                local_batch_size=local_batch_size,
                workers=cfg.worker_override(r),
                digests=bool(cfg.ledger and folder),
                hints=hints,
                **extra,
            )
        except ValueError as e:
            raise ValueError(f"zephon.integrations.torchtitan: {e}") from None
        #: this rank's batch ledger (None: not written), see :mod:`zephon.recipe.ledger`
        self.ledger = self._open_ledger(folder, batches.lanes) if cfg.ledger and folder else None
        return batches

    def _open_ledger(self, folder: str, lanes: range) -> LedgerWriter:
        r = self.recipe
        return LedgerWriter(
            folder,
            rank=int(os.environ.get("RANK", self.dp_rank)),
            world_size=self.dp_world_size,
            lane_range=lanes,
            lanes=r.lanes,
            recipe=os.path.abspath(self.config.recipe_file()),
            fingerprint=r.fingerprint,
            datasets=[d.name for d in r.datasets],
        )

    # -- checks ------------------------------------------------------------------------------
    def _check_trainer(self) -> None:
        cfg, G, W = self.config, self.recipe.global_batch_size, self.dp_world_size
        if cfg.trainer_local_batch_size < 1:
            return  # not built by a with_zephon trainer config
        theirs = cfg.trainer_global_batch_size
        theirs = theirs if theirs > 0 else cfg.trainer_local_batch_size * W  # TorchTitan's rule for -1
        if theirs != G:
            raise ValueError(
                f"zephon.integrations.torchtitan: TorchTitan's optimizer step is {theirs} rows (training.global_batch_size, "
                f"{cfg.trainer_local_batch_size} rows per DP rank and microbatch step x {W} DP ranks x gradient "
                f"accumulation) but the recipe's global batch is {G} rows. Set --training.global_batch_size {G} (or use "
                "zephon.integrations.torchtitan.with_zephon, which does), so that one trainer step is one recipe step; otherwise "
                "checkpoints fall in the middle of a recipe step and cannot resume on another DP degree."
            )

    def _check_tokenizer(self, tokenizer: Any) -> None:
        get = getattr(tokenizer, "get_vocab_size", None)
        if get is None:
            return
        r = self.recipe
        ours = r.tokenizer
        for name, ours_id in r.special_tokens.items():
            theirs_id = getattr(tokenizer, f"{name}_id", None)
            if theirs_id is not None and int(theirs_id) != ours_id:
                raise ValueError(
                    f"zephon.integrations.torchtitan: the trainer's tokenizer has {name}_id = {theirs_id}, the recipe's placeholder "
                    f"[vision].{name}_token has id {ours_id}; use the same tokenizer (hf_assets_path) and tokens"
                )
        theirs = int(get())
        if theirs != ours.vocab_size or getattr(tokenizer, "eos_id", ours.eos_id) != ours.eos_id:
            raise ValueError(
                f"zephon.integrations.torchtitan: the trainer's tokenizer (hf_assets_path) has {theirs} tokens and eos_id "
                f"{getattr(tokenizer, 'eos_id', None)}, the recipe's tokenizer at {r.spec.tokenizer.path!r} has "
                f"{ours.vocab_size} tokens and eos_id {ours.eos_id}. Set --hf_assets_path to the recipe's tokenizer "
                "folder (or the same vocabulary), or --dataloader.check_tokenizer false if you know they agree."
            )

    # -- iteration ---------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Recipe steps fetched by this rank."""
        return self.batches.step

    def accumulation_steps(self, pp_microbatches: int = 1) -> int:
        """The trainer's gradient-accumulation steps for the next optimizer step: the next recipe
        step's slices over ``pp_microbatches`` pipeline microbatches each. A ``[[batch_schedule]]``
        changes it from a step on (:class:`~zephon.integrations.titan_schedule.ZephonTrainer` asks
        before every step); without one it is the same every step."""
        n = self.batches.microbatches_at(self.batches.step)
        if pp_microbatches < 1 or n % pp_microbatches:
            raise ValueError(
                f"zephon.integrations.torchtitan: recipe step {self.batches.step} has {n} microbatches of "
                f"{self.local_batch_size} rows on this rank, which {pp_microbatches} pipeline microbatches do not divide"
            )
        return n // pp_microbatches

    def on_local_batch(self, step: int, batch: dict[str, np.ndarray]) -> None:
        """Hook: called once per recipe step with this rank's whole local batch (numpy, all fields,
        lanes in order, ``rows_per_step`` rows). ``step`` counts from 1. Default: nothing."""

    def _fetched(self, batch: dict[str, Any]) -> None:
        """A new recipe step: the ledger line, the hook, the metrics line, the tensors."""
        step = self.batches.step
        if self.ledger is not None:
            r = self.recipe
            tokens = dataset_tokens(batch["dataset"], r.rows_per_lane_at(step - 1), len(r.datasets))
            shape = (r.global_batch_size_at(step - 1), r.seq_len_at(step - 1))
            self.ledger.write(step - 1, self.batches.lane_digests(), tokens, self.batches.lane_counts(), shape)
        self.on_local_batch(step, batch)
        if self.config.log_every and step % self.config.log_every == 0:
            self.log_metrics()
        if not self.recipe.multimodal:
            keys = ("input", "labels") + (MODEL_KEYS if self.config.with_positions else ())
            self._tensors = {k: torch.from_numpy(np.ascontiguousarray(batch[k], dtype=np.int64)) for k in keys}

    def __next__(self) -> tuple[dict[str, Any], torch.Tensor]:
        if self.batches.ended:
            raise StopIteration
        t0 = time.perf_counter()
        try:
            batch, lo, hi = self.batches.next_slice()
        except StopIteration:
            if self.ledger is not None:
                self.ledger.close()
            end = self.batches.end
            if self.config.log_every and end is not None:
                _LOG.info("zephon rank %d: %s", self.dp_rank, end.describe())
            raise
        if lo == 0:
            self.step_metrics.record(batch, time.perf_counter() - t0, step=self.batches.step)
            self._fetched(batch)
        else:
            self.step_metrics.add_time(time.perf_counter() - t0)
        if self.recipe.multimodal:
            merge = self.recipe.vision.merge_size
            sp, pos = self.special_tokens, self.config.with_positions
            return titan_mm_batch(batch, lo, hi, special_tokens=sp, merge_size=merge, with_positions=pos)
        b = self._tensors
        return {k: b[k][lo:hi] for k in ("input",) + MODEL_KEYS if k in b}, b["labels"][lo:hi]

    def __iter__(self) -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
        return self

    # -- metrics and checkpointing -----------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        """This rank's pipeline metrics, summed over its lanes, per node type."""
        return self.batches.router.summary_metrics()

    def dashboard_metrics(self) -> dict[str, float]:
        """:class:`zephon.recipe.LoaderMetrics` of the recipe steps since the last call (flat, for
        TorchTitan's TensorBoard / W&B logger; see :mod:`zephon.integrations.titan_metrics`)."""
        return self.step_metrics.collect(self.metrics())

    def log_metrics(self) -> str:
        """Log (and return) a one-line summary of :meth:`metrics` via the ``zephon`` logger."""
        m = self.metrics()
        parts = [f"step {self.batches.step}"]
        for name, v in m.items():
            rate = v.get("items_per_s")
            parts.append(f"{name} {v.get('items', 0)} items" + (f" {rate:,.0f}/s" if rate else ""))
        by_type = {v.get("node_type"): v for v in m.values()}
        if "ordered_map" in by_type:
            parts.append(f"waited on workers {by_type['ordered_map'].get('wait_workers_s', 0):.2f} s")
        packer = by_type.get("pack") or by_type.get("mm_pack") or {}
        if "efficiency" in packer:
            parts.append(f"packing {packer['efficiency']:.1%}")
        skipped = by_type.get("skip_counter", {}).get("skipped", {})
        if any(skipped.values()):
            parts.append("skipped " + ", ".join(f"{k}={v}" for k, v in skipped.items() if v))
        line = f"zephon rank {self.dp_rank}: " + "; ".join(parts)
        _LOG.info(line)
        return line

    def state_dict(self) -> dict[str, Any]:
        """``{"zephon": bytes, "lane_NNNNN": bytes, ...}``: one JSON value per owned lane (``{}`` on a
        read-once follower: its leader's state is the DP rank's)."""
        try:
            state = self.batches.state_dict()  # refused in the middle of a step, on every peer
            return encode_state(state) if state else {}
        except StateError as e:
            raise StateError(f"zephon.integrations.torchtitan: {e}") from None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore this rank's lanes from a (DCP-merged) lane-keyed state; empty = keep fresh."""
        if not state_dict:
            return
        foreign = [k for k in state_dict if k != SHARED_KEY and not is_lane_key(k)]
        if foreign or SHARED_KEY not in state_dict:
            raise StateError(
                f"zephon.integrations.torchtitan: the checkpoint's dataloader state has keys {sorted(state_dict)[:4]}..., not zephon's "
                f"({SHARED_KEY!r} and lane_NNNNN): it was written by another dataloader. Resume with the loader that "
                "wrote it, or load the model only (--checkpoint.exclude_from_loading dataloader)."
            )
        # a value that came back as a uint8 tensor (a storage layer that tensorises bytes) is read as its bytes
        entries = {k: (v.numpy().tobytes() if isinstance(v, torch.Tensor) else v) for k, v in state_dict.items()}
        try:
            self.batches.load_state_dict(decode_state(entries))
        except StateError as e:
            raise StateError(
                f"zephon.integrations.torchtitan: cannot restore the dataloader from this checkpoint: {e}"
            ) from None

    def close(self) -> None:
        """Stop this rank's workers and close its ledger file (idempotent)."""
        self.batches.close()
        if self.ledger is not None:
            self.ledger.close()

    def __del__(self) -> None:  # pragma: no cover - best effort; close() is the real API
        try:
            batches = self.__dict__.get("batches")
            if batches is not None:
                batches.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (
            f"ZephonDataLoader(rank {self.dp_rank}/{self.dp_world_size}, lanes={self.recipe.lanes}, "
            f"global_batch_size={self.recipe.global_batch_size}, local_batch_size={self.local_batch_size}, "
            f"microbatches_per_step={self.microbatches_per_step})"
        )


# -- config functions ------------------------------------------------------------------------
def _pass_trainer_facts(trainer_config: Any) -> None:
    """Give the trainer's own loader config what it checks against and where its ledger goes:
    the dump folder and the trainer's batch, as they stand once the command line is parsed."""
    dl = getattr(trainer_config, "dataloader", None)
    if isinstance(dl, ZephonDataLoader.Config):
        dl.dump_folder = str(trainer_config.dump_folder)
        dl.trainer_global_batch_size = int(trainer_config.training.global_batch_size)
        dl.trainer_local_batch_size = int(trainer_config.training.local_batch_size)


_WIRED: dict[type, type] = {}


def _wire(trainer_config: Any) -> None:
    """Make ``trainer_config`` pass the trainer's facts to its zephon loader config after every
    construction (TorchTitan builds a new config from the command line, then ``replace()``\\ s it).

    Its class becomes a subclass of its own class that only adds that step to ``__post_init__``
    (same fields, slots and name), so TorchTitan and tyro see the same config."""
    cls = type(trainer_config)
    if cls not in _WIRED and cls not in _WIRED.values():
        base_post = getattr(cls, "__post_init__", None)

        def __post_init__(self: Any) -> None:  # noqa: N807 - the dataclass hook
            if base_post is not None:
                base_post(self)
            _pass_trainer_facts(self)

        ns = {"__slots__": (), "__post_init__": __post_init__, "__module__": cls.__module__}
        _WIRED[cls] = type(cls.__name__, (cls,), dict(ns, __qualname__=cls.__qualname__))
    trainer_config.__class__ = _WIRED.get(cls, cls)
    _pass_trainer_facts(trainer_config)


def with_zephon(
    trainer_config: Any,
    recipe: str,
    *,
    local_batch_size: int | None = None,
    validation: str | None = None,
    **overrides: Any,
) -> Any:
    """Make any TorchTitan ``Trainer.Config`` train on a zephon recipe; returns the same object.

    Sets ``dataloader``, ``training.seq_len`` and ``training.global_batch_size`` from the recipe
    (``overrides`` are :class:`ZephonDataLoader.Config` fields, e.g. ``workers=4``), and
    ``checkpoint.last_save_model_only = False`` so the last checkpoint keeps the loader state, and
    makes ``metrics`` a :class:`~zephon.integrations.titan_metrics.ZephonMetricsProcessor.Config`
    (the loader's metrics in TensorBoard / W&B next to the loss). For a recipe whose
    ``[[batch_schedule]]`` changes the global batch it returns a copy, a
    :class:`~zephon.integrations.titan_schedule.ZephonTrainer.Config` (gradient accumulation per
    step follows the schedule): use the config it returns. ``training.seq_len`` is the recipe's
    longest (a schedule's rows are shorter before its long phase).
    The config then passes its final ``dump_folder`` and batch (after the command line) to its
    ``dataloader`` when that is a :class:`ZephonDataLoader.Config` (the ledger's folder, the
    check that one trainer step is one recipe step), also when ``dataloader`` is replaced later.
    ``local_batch_size`` (rows per ``next()``) defaults to the config's own if it divides the
    global batch, else to the global batch.

    ``validation``: a finite recipe (every dataset ``policy = "stop"``) to validate on, the same
    set on every DP degree: sets ``validator.enable``, ``validator.steps = -1`` (the whole set,
    which never hangs with it) and ``validator.dataloader`` (no ledger, no metrics lines; the
    workers of ``overrides``). ``validator.freq`` stays the config's. The validator asks for
    ``training.local_batch_size`` rows per ``next()``, so that must divide the validation
    recipe's ``global_batch_size / W`` on every DP degree W.
    """
    cfg = ZephonDataLoader.Config(recipe=recipe, **overrides)
    r = cfg.load_recipe()
    trainer_config.dataloader = cfg
    _wire(trainer_config)
    trainer_config.training.seq_len = max(n for _, _, n in r.batch_phases)  # the longest rows of a schedule
    trainer_config.training.global_batch_size = r.global_batch_size
    if local_batch_size is not None:
        trainer_config.training.local_batch_size = local_batch_size
    elif r.global_batch_size % trainer_config.training.local_batch_size:
        trainer_config.training.local_batch_size = r.global_batch_size
    if getattr(trainer_config, "checkpoint", None) is not None and hasattr(
        trainer_config.checkpoint, "last_save_model_only"
    ):
        trainer_config.checkpoint.last_save_model_only = False
    if getattr(trainer_config, "metrics", None) is not None:
        trainer_config.metrics = zephon_metrics_config(trainer_config.metrics)
    if validation is not None:
        perf = {k: overrides[k] for k in ("workers", "backend") if k in overrides}
        vcfg = ZephonDataLoader.Config(
            recipe=validation, ledger=False, log_every=0, infinite=False, dashboard=False, **perf
        )
        vr = vcfg.load_recipe()
        if not vr.spec.finite:
            repeating = next(d.name for d in vr.datasets if d.policy != "stop")
            raise ValueError(
                f"zephon.integrations.torchtitan: the validation recipe {validation!r} never ends (dataset {repeating!r} has "
                'policy = "repeat"); a validation set is finite: set policy = "stop" on every dataset'
            )
        if vr.seq_len != trainer_config.training.seq_len:
            raise ValueError(
                f"zephon.integrations.torchtitan: the validation recipe has seq_len = {vr.seq_len}, the training recipe "
                f"{r.seq_len}; TorchTitan validates with training.seq_len: make them equal"
            )
        lbs = trainer_config.training.local_batch_size
        if vr.global_batch_size % lbs:
            raise ValueError(
                f"zephon.integrations.torchtitan: the validator asks for training.local_batch_size = {lbs} rows per next(), which "
                f"does not divide the validation recipe's global_batch_size = {vr.global_batch_size}; use a "
                "multiple of it"
            )
        trainer_config.validator.enable = True
        trainer_config.validator.steps = -1
        trainer_config.validator.dataloader = vcfg
    return _follow_schedule(trainer_config, r)


def _follow_schedule(trainer_config: Any, r: Recipe) -> Any:
    """The config, or for a recipe whose global batch changes, a ZephonTrainer's copy of it."""
    if len({g for _, g, _ in r.batch_phases}) == 1:
        return trainer_config
    # imported here: torchtitan.trainer takes seconds to import (and triton), and only this needs it
    from .titan_schedule import scheduled_trainer_config

    trainer_config = scheduled_trainer_config(trainer_config)
    _wire(trainer_config)
    return trainer_config
