"""Building blocks of draft networks and verifiers, shared with the engine: the target's layers,
the paged-attention forward context, and the kernels' public launchers. Re-exported by
:mod:`speculant.drafting`; see docs/drafting.md for what each one is for."""

from __future__ import annotations

from speculant.engine.cuda_graph import gc_paused
from speculant.engine.sampler import (
    Row,
    params_need_processing,
    process_logits,
    target_probs,
    uniforms,
)
from speculant.engine.staging import read_back, to_device
from speculant.kernels.gemv import gemv
from speculant.kernels.logprobs import row_argmax, token_logprobs
from speculant.kernels.rejection_sampling import rejection_sample
from speculant.kernels.stage_copy import pinned_copy
from speculant.models import fused
from speculant.models.loader import load_config
from speculant.models.weights import WeightLoader, WeightLoadError

__all__ = [
    "Row",
    "WeightLoadError",
    "WeightLoader",
    "fused",
    "gc_paused",
    "gemv",
    "load_config",
    "params_need_processing",
    "pinned_copy",
    "process_logits",
    "read_back",
    "rejection_sample",
    "row_argmax",
    "target_probs",
    "to_device",
    "token_logprobs",
    "uniforms",
]
