"""Building blocks of draft networks and verifiers, shared with the engine: the target's layers,
the paged-attention forward context, and the kernels' public launchers. Re-exported by
:mod:`speculant.drafting`; see docs/drafting.md for what each one is for."""

from __future__ import annotations

from speculant.engine.cuda_graph import gc_paused
from speculant.kernels.gemv import gemv
from speculant.kernels.logprobs import row_argmax
from speculant.kernels.stage_copy import pinned_copy
from speculant.models import fused
from speculant.models.loader import load_config
from speculant.models.weights import WeightLoader, WeightLoadError

__all__ = [
    "WeightLoadError",
    "WeightLoader",
    "fused",
    "gc_paused",
    "gemv",
    "load_config",
    "pinned_copy",
    "row_argmax",
]
