"""zephon.nodes: the operator library (pack, shuffle, batch, tokenize, ...).

Every operator is a :class:`zephon.ZNode`: the torchdata ``BaseNode`` contract plus ``close()``,
a tagged JSON state with the same keys at every step, and flush-and-replay checkpointing.
Operators use only zephon's public API, so a user's own operator is a first-class citizen.
"""

from .batch import Batch
from .mmpack import MMPack
from .pack import Pack
from .shuffle import WindowShuffle
from .skips import SkipCounter
from .tokenize import FetchTokenize, TokDoc
from .vision import FetchVision, MMDoc, VisionConfig

__all__ = ["Batch", "FetchTokenize", "FetchVision", "MMDoc", "MMPack", "Pack", "SkipCounter", "TokDoc", "VisionConfig",
           "WindowShuffle"]
