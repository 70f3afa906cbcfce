"""Each layer's face (its ``__all__``) holds what a user composes with; worker functions,
constants and helpers stay public in their own modules (issue #34: 197 names in the faces).

The lists below are the faces: a name added to a face is a decision (add it here, and to the
CHANGELOG), and a name removed from one is a move recorded in CHANGELOG.md. ``zephon.nodes`` is
narrowed on its own (its operators and their row types).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

FACES = {
    "zephon": [
        "DataError",
        "GlobalLoader",
        "PipelineError",
        "Recipe",
        "RecipeError",
        "StateError",
        "WorkerConfig",
        "WorkerError",
        "batch_sha256",
    ],
    "zephon.engine": [
        "Accumulator",
        "IndexPermutation",
        "LaneContext",
        "OrderedMapper",
        "PipelineError",
        "ProcessLocal",
        "StateError",
        "WorkerConfig",
        "WorkerError",
        "WorkerPool",
        "ZNode",
        "lane_rng",
    ],
    "zephon.data": [
        "BUNDLED_TOKENIZER",
        "BadRecord",
        "ChatRenderer",
        "ConversationError",
        "DataError",
        "DatasetIndex",
        "ImageTextShardIndex",
        "MultimodalIndex",
        "NodeCache",
        "ShardIndex",
        "TextTokenizer",
        "TokenCache",
        "TokenIndex",
        "index_dataset",
        "index_multimodal",
        "index_tokens",
        "node_cache",
        "token_cache",
        "write_mds",
        "write_megatron",
        "write_tokens",
    ],
    "zephon.recipe": [
        "DATA_VERSION",
        "BadSamplesWarning",
        "LoaderMetrics",
        "MemoryBudget",
        "Prepared",
        "RankBatches",
        "Recipe",
        "RecipeError",
        "RecipeSpec",
        "TokenEstimate",
        "parse_recipe",
        "prepare",
    ],
}

#: names that left a face this round, and the module that keeps them public
MOVED = {
    "zephon.engine.node": ["ANCHOR", "EXTRA", "SINCE", "UPSTREAM", "check_state_keys", "close_node", "state_int"],
    "zephon.engine.seeding": ["seed_sequence", "stable_u64"],
    "zephon.engine.checkpoint": ["FORMAT_VERSION", "decode_state", "encode_state", "lane_key", "merge_states"],
    "zephon.engine.lanes": ["divisors", "lanes_of_rank"],
    "zephon.engine.router": ["Router"],
    "zephon.engine.workers": ["PoolSet"],
    "zephon.engine.collate": ["collate"],
    "zephon.data.datasets": ["KINDS", "FORMATS", "read_fields", "default_cache_dir", "ShardMeta"],
    "zephon.data.chat": ["CHAT_TOKENIZER", "CHAT_FORMATS", "load_chat_template", "parse_conversation"],
    "zephon.data.tokenizer": ["set_tokenizers_parallelism"],
    "zephon.recipe.spec": ["DatasetSpec", "PackSpec", "ShuffleSpec", "VISION_TOKENS"],
    "zephon.recipe.keys": ["LIMITS", "max_workers"],
    "zephon.recipe.ledger": ["LEDGER_DIR", "LedgerWriter", "ledger_file"],
    "zephon.recipe.peers": ["LeaderBatches", "FollowerBatches", "PeerLink", "definition_digest"],
    "zephon.recipe.build": ["RecipeLanes", "build_lane"],
    "zephon.recipe.migrations": ["LANE_MIGRATIONS"],
    "zephon.recipe.loader_metrics": ["metered"],
    "zephon.recipe.estimate": ["estimate_tokens", "bad_samples_message"],
}


@pytest.mark.parametrize("face", sorted(FACES))
def test_each_face_is_what_a_user_composes_with(face):
    names = importlib.import_module(face).__all__
    assert sorted(names) == sorted(FACES[face]), (
        f"{face}.__all__ changed: added {sorted(set(names) - set(FACES[face]))}, "
        f"removed {sorted(set(FACES[face]) - set(names))}; a face holds what a user composes with "
        "(constants and helpers stay public in their own module): update tests/system/test_faces.py and CHANGELOG.md"
    )


@pytest.mark.parametrize("module", sorted(MOVED))
def test_moved_names_stay_public_in_their_own_module(module):
    mod = importlib.import_module(module)
    for name in MOVED[module]:
        assert name in mod.__all__, f"{module}.{name} left its face but is not public in its own module"


def test_the_changelog_records_the_moves():
    text = (Path(__file__).resolve().parents[2] / "CHANGELOG.md").read_text(encoding="utf-8")
    for module in MOVED:
        assert f"`{module}`" in text, f"CHANGELOG.md does not say that names moved to {module}"
