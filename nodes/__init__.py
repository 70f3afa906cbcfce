"""zephon.nodes: the operator library (pack, shuffle, batch, tokenize, ...).

Every operator is a :class:`zephon.engine.ZNode`: the torchdata ``BaseNode`` contract plus ``close()``,
a tagged JSON state with the same keys at every step, and flush-and-replay checkpointing.
Operators use only zephon's public API, so a user's own operator is a first-class citizen.

Tokenized documents packed into rows of ``seq_len + 1`` tokens, then batched:

    >>> import numpy as np
    >>> from zephon.engine.testing import ListSource
    >>> docs = [TokDoc(np.arange(1, n + 1, dtype=np.int32), 0, None) for n in (5, 3, 6)]
    >>> batch = next(Batch(Pack(ListSource(docs), seq_len=4), batch_size=2))
    >>> batch["input"].tolist(), batch["document_ids"].tolist()
    ([[1, 2, 3, 4], [1, 2, 3, 1]], [[0, 0, 0, 0], [0, 0, 0, 1]])
"""

from .batch import Batch
from .blockorder import OPEN_BLOCKS, BlockOrder, expected_distinct, global_batch_diversity
from .chat import LONG, ChatDoc, ChatOptions, ChatPack, FetchChat, fit_conversation
from .filters import FILTER_KINDS, FilterCounter
from .images import DECODE_RULES, VisionConfig
from .mmpack import MMPack, mm_pad_batch
from .pack import ALGORITHMS, Pack, pad_row, pad_rows
from .phases import BatchSchedule, Carry, PhasedLane, ScheduledBatch, SegmentPack
from .policy import ON_ERROR, skip_hint
from .rows import IGNORE_INDEX, LABELS, PartProvenance, Provenance, provenance_entry, row_spans
from .shuffle import WindowShuffle
from .skips import MAX_DETAIL_ROWS, SKIP_SHARE_WARNING, SkipCounter, SkipShareWarning, lane_share, reason_class
from .stages import Carried, FieldError, FilteredDoc, FilterRule, FilterVerdict, RecordPipeline, duplicate_records
from .tokenize import SPLIT_MODES, FetchTokenize, TokDoc, check_token_widths, part_span
from .userfn import STATEFUL_METHODS, FilterError, StatefulFunction, call_bound, call_user, resolve_function
from .vision import FetchVision, LayoutSpan, MMDoc, sample_layout
from .vlchat import FetchVisionChat
from .worksource import POLICIES, DatasetPlan, LaneWorkSource, WeightSchedule, WorkItem, WorkPlan

__all__ = [
    "ALGORITHMS",
    "DECODE_RULES",
    "FILTER_KINDS",
    "IGNORE_INDEX",
    "LABELS",
    "LONG",
    "MAX_DETAIL_ROWS",
    "ON_ERROR",
    "OPEN_BLOCKS",
    "POLICIES",
    "SKIP_SHARE_WARNING",
    "SPLIT_MODES",
    "STATEFUL_METHODS",
    "Batch",
    "BatchSchedule",
    "BlockOrder",
    "Carried",
    "Carry",
    "ChatDoc",
    "ChatOptions",
    "ChatPack",
    "DatasetPlan",
    "FetchChat",
    "FetchTokenize",
    "FetchVision",
    "FetchVisionChat",
    "FieldError",
    "FilterCounter",
    "FilterError",
    "FilterRule",
    "FilterVerdict",
    "FilteredDoc",
    "LaneWorkSource",
    "LayoutSpan",
    "MMDoc",
    "MMPack",
    "Pack",
    "PartProvenance",
    "PhasedLane",
    "Provenance",
    "RecordPipeline",
    "ScheduledBatch",
    "SegmentPack",
    "SkipCounter",
    "SkipShareWarning",
    "StatefulFunction",
    "TokDoc",
    "VisionConfig",
    "WeightSchedule",
    "WindowShuffle",
    "WorkItem",
    "WorkPlan",
    "call_bound",
    "call_user",
    "check_token_widths",
    "duplicate_records",
    "expected_distinct",
    "fit_conversation",
    "global_batch_diversity",
    "lane_share",
    "mm_pad_batch",
    "pad_row",
    "pad_rows",
    "part_span",
    "provenance_entry",
    "reason_class",
    "resolve_function",
    "row_spans",
    "sample_layout",
    "skip_hint",
]
