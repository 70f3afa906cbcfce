"""``zephon.plots`` is :mod:`zephon.tools.plots` (plots of mixtures and lanes) under its short public path: the same
module object, so every name (and a monkeypatch) is shared."""

import sys

from zephon.tools import plots as _module

sys.modules[__name__] = _module
