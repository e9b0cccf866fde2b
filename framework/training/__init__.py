"""speculant.training: train a speculation head on its target by self-distillation, and measure
any strategy's acceptance (docs/training.md).

The names below load on first use (PEP 562), so ``speculant --help`` (whose parser includes
``speculant.training.cli``) does not import torch."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "make_head": "api", "train": "api",
    "Batch": "data", "Dataset": "data", "Example": "data", "build_dataset": "data",
    "collate": "data",
    "eval_acceptance": "evaluate",
    "HEADS": "heads", "Eagle1Head": "heads", "HeadLoss": "heads", "MedusaHead": "heads",
    "MLPSpeculatorHead": "heads", "TargetInfo": "heads", "Trainable": "heads",
    "TrainConfig": "loop", "TrainResult": "loop", "train_head": "loop",
    "CATEGORIES": "prompts", "Prompt": "prompts", "prompt_set": "prompts",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'speculant.training' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"speculant.training.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
