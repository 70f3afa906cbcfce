"""``zephon.demo`` is :mod:`zephon.tools.demo` (the bundled demo) under its short public path: the same
module object, so every name (and a monkeypatch) is shared."""

import sys

from zephon.tools import demo as _module

sys.modules[__name__] = _module
