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

import os
from collections.abc import Sequence

import torch

from speculant._extensions import import_extension

_ext = None


def staging_ext():
    """The C staging of CUDA-graph int inputs (``speculant._staging``, framework/csrc/staging.c:
    the one-graph proposes' ``draft_ints`` and ``eagle_ints``, the engine forwards'
    ``ring_ints``), or None: not built (it is an optional extension) or ``SPECULANT_C_STAGING=0``
    (read once). Without it ``draft_graph`` and ``eagle_graph``'s ``fused_ints`` and
    ``CudaGraphRunner._fill_small`` build the same inputs in Python, which the tests compare with
    the C value for value."""
    global _ext
    if _ext is None:
        _ext = import_extension("speculant._staging", "SPECULANT_C_STAGING") or False
    return _ext or None


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


def read_back(t: torch.Tensor) -> list:
    """``t.tolist()``, waiting for the GPU by polling an event from Python instead of blocking in
    the driver's synchronous copy. On the H100 machine the host's bookkeeping right after a
    blocking wait of a few milliseconds ran several times slower than the same code measured in
    a loop (``bench/spec_timeline.py``: ~0.25 ms between the read-back and the next launch of a
    verification step, ~0.05 ms of it in isolation); the poll keeps the core busy in the
    interpreter while the GPU computes. ``SPECULANT_SPIN_READBACK=0``: the blocking read."""
    if not t.is_cuda or os.environ.get("SPECULANT_SPIN_READBACK", "1") in ("0", "false", "off"):
        return t.tolist()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    query = done.query
    while not query():
        pass
    return host.tolist()
