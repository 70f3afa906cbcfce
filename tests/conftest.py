"""Tests mirror the package: engine/, data/, nodes/, recipe/, tools/, integrations/, and system/ for
properties of the whole project (elastic runs through every layer, the layer rules, docs, notebooks).
Helpers shared across folders live in support/ and are importable by name."""

import os
import sys

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))
