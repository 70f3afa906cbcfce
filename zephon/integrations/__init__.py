"""Integrations with training frameworks (TorchTitan, plain torch, the HF Trainer and datasets,
Lightning); imported only when asked for, so
``import zephon`` never imports a trainer."""
