"""Building blocks of draft networks and verifiers, shared with the engine: the target's layers,
the paged-attention forward context, and the kernels' public launchers. Re-exported by
:mod:`speculant.drafting`; see docs/drafting.md for what each one is for."""

from __future__ import annotations

from speculant.drafting.draft_graph import capture_all as capture_draft_graphs
from speculant.drafting.draft_graph import fused_greedy as draft_fused_greedy
from speculant.engine.block_manager import BlockManager
from speculant.engine.cuda_graph import gc_paused, max_prefill_tokens
from speculant.engine.model_runner import ModelRunner, kv_bytes_per_block
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
from speculant.models.loader import load_config, load_model, load_tokenizer, resolve_model
from speculant.models.weights import WeightLoader, WeightLoadError

__all__ = [
    "BlockManager",
    "ModelRunner",
    "Row",
    "WeightLoadError",
    "WeightLoader",
    "capture_draft_graphs",
    "draft_fused_greedy",
    "fused",
    "gc_paused",
    "gemv",
    "kv_bytes_per_block",
    "load_config",
    "load_model",
    "load_tokenizer",
    "max_prefill_tokens",
    "params_need_processing",
    "pinned_copy",
    "process_logits",
    "read_back",
    "rejection_sample",
    "resolve_model",
    "row_argmax",
    "target_probs",
    "to_device",
    "token_logprobs",
    "uniforms",
]
