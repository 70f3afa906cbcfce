"""zephon.nodes.stages: per-record work as one list, built once from the recipe.

``read -> rules -> encode``: :class:`RecordPipeline` is the lane mapper's batch function; each
rule kind is one file (:mod:`.length`, :mod:`.regex`, :mod:`.dedup`, :mod:`.field`,
:mod:`.user`, :mod:`.imagesize`) with the small contract of :class:`RuleStage`; a user's own
rule is a subclass registered with :func:`rule_class`.
"""

from .dedup import DedupRule, duplicate_records
from .field import FieldError, FieldRule, field_in
from .imagesize import ImageSizeRule, decoded_size
from .length import LengthRule
from .pipeline import Carried, FilteredDoc, RecordPipeline, UnviewableError
from .regex import RegexRule
from .rule import SEES, FilterRule, FilterVerdict, Record, RuleStage, rule_class
from .user import StatefulRule, UserRule

__all__ = [
    "SEES",
    "Carried",
    "DedupRule",
    "FieldError",
    "FieldRule",
    "FilterRule",
    "FilterVerdict",
    "FilteredDoc",
    "ImageSizeRule",
    "LengthRule",
    "Record",
    "RecordPipeline",
    "RegexRule",
    "RuleStage",
    "StatefulRule",
    "UnviewableError",
    "UserRule",
    "decoded_size",
    "duplicate_records",
    "field_in",
    "rule_class",
]
