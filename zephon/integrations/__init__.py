"""Integrations with training frameworks (TorchTitan); imported only when asked for, so
``import zephon`` never imports a trainer."""
