"""Host-to-device copies that never stall the GPU stream.

``torch.tensor(values, device="cuda")`` copies from pageable memory, which makes PyTorch wait for
everything queued on the stream (a full synchronisation) before the copy. Inside a speculative
step that wait lands right after the target forward was launched, so the host sits idle for the
whole forward and then launches the small verification kernels one by one on an idle GPU.
:func:`to_device` stages through pinned memory (PyTorch's caching host allocator keeps the block
alive until the copy has run) and copies asynchronously, so the host keeps queueing work while the
GPU computes. On the CPU it is a plain tensor constructor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(
    values: Sequence | torch.Tensor,  # python numbers, or a CPU tensor
    dtype: torch.dtype | None,
    device: torch.device | str,
) -> torch.Tensor:
    """A tensor of ``values`` on ``device``, copied without a stream synchronisation on CUDA."""
    device = torch.device(device)
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if device.type != "cuda":
        return t.to(device)
    if t.device.type == "cuda":
        return t.to(device, non_blocking=True)
    return t.pin_memory().to(device, non_blocking=True)
