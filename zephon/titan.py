"""``zephon.titan`` is :mod:`zephon.integrations.torchtitan` (TorchTitan integration) under its short public path: the same
module object, so every name (and a monkeypatch) is shared."""

import sys

from zephon.integrations import torchtitan as _module

sys.modules[__name__] = _module
