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

from speculant._extensions import import_extension

_ext = None


def staging_ext():
    """The C staging of CUDA-graph int inputs (``speculant._staging``, framework/csrc/staging.c:
    the one-graph proposes' ``draft_ints`` and ``eagle_ints``, the engine forwards'
    ``ring_ints``), or None where it was not built (it is an optional extension; read once).
    Without it ``drafting.draft_graph`` and ``drafting.head_graph``'s ``fused_ints`` and
    ``CudaGraphRunner._fill_small`` build the same inputs in Python, which the tests compare with
    the C value for value."""
    global _ext
    if _ext is None:
        _ext = import_extension("speculant._staging") or False
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
    the driver's synchronous copy: after a blocking wait the host's bookkeeping ran several times
    slower than in a loop (a cold core; ``bench/spec_timeline.py``, docs/perf.md), and the poll
    keeps the core busy while the GPU computes."""
    if not t.is_cuda:
        return t.tolist()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    query = done.query
    while not query():
        pass
    return host.tolist()
