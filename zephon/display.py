"""``zephon.display`` is :mod:`zephon.tools.display` (batch display and provenance) under its short public path: the same
module object, so every name (and a monkeypatch) is shared."""

import sys

from zephon.tools import display as _module

sys.modules[__name__] = _module
