"""zephon.nodes.stages: per-record work as one list, built once from the recipe.

``read -> rules -> encode``: :class:`RecordPipeline` is the lane mapper's batch function; each
rule kind is one file (:mod:`.length`, :mod:`.regex`, :mod:`.dedup`, :mod:`.field`,
:mod:`.user`, :mod:`.imagesize`) with the small contract of :class:`RuleStage`; a user's own
rule is a :class:`RuleStage` subclass: named in a recipe as ``kind = "stage"``, ``function =
"package.module:Class"`` (its code fingerprinted like a user function's), or registered for a
kind of its own with :func:`rule_class` when composing in Python.
"""

from .dedup import DedupRule, duplicate_records
from .field import FieldError, FieldRule, field_in
from .imagesize import ImageSizeRule, decoded_size
from .length import LengthRule
from .pipeline import Carried, FilteredDoc, RecordPipeline, UnviewableError, call_rule
from .regex import RegexRule
from .rule import SEES, FilterRule, FilterVerdict, Record, RuleStage, rule_class, user_stage
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
    "call_rule",
    "decoded_size",
    "duplicate_records",
    "field_in",
    "rule_class",
    "user_stage",
]
