"""GPU kernels of speculant (Triton, with plain torch fallbacks).

Each module has a torch reference ``*_ref``, the Triton kernel(s), a checking launcher and a
public dispatch function that uses Triton for CUDA tensors and torch otherwise. Triton is
optional: without it every function runs its torch path. See docs/kernels.md.
"""

from .gemv import gemv
from .kv_cache import store_kv
from .logprobs import token_logprobs
from .paged_attention import paged_attention
from .rejection_sampling import rejection_sample, sample_from_probs
from .sampling import sampling_probs

__all__ = [
    "gemv",
    "store_kv",
    "token_logprobs",
    "paged_attention",
    "sampling_probs",
    "rejection_sample",
    "sample_from_probs",
]
