"""``zephon.synth`` is :mod:`zephon.tools.synth` (synthetic corpora) under its short public path: the same
module object, so every name (and a monkeypatch) is shared."""

import sys

from zephon.tools import synth as _module

sys.modules[__name__] = _module
