"""``zephon.testing`` is :mod:`zephon.engine.testing` (the node test kit) under its short public path: the same
module object, so every name (and a monkeypatch) is shared."""

import sys

from zephon.engine import testing as _module

sys.modules[__name__] = _module
