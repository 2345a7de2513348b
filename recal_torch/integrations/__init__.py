"""recal in the training frameworks users already run: one callback each, the recipe in, the framework's own loop,
checkpoints, resume and logging used.

- :class:`RecalTrainerCallback` (:mod:`~recal_torch.integrations.huggingface`): Hugging Face ``Trainer``;
- :class:`RecalLightningCallback` (:mod:`~recal_torch.integrations.lightning`): Lightning's ``Trainer``.

Each is imported on first use, so ``import recal_torch`` needs neither framework.
"""

from __future__ import annotations

import importlib

__all__ = ["RecalLightningCallback", "RecalTrainerCallback"]

_HOMES = {"RecalTrainerCallback": "huggingface", "RecalLightningCallback": "lightning"}


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
