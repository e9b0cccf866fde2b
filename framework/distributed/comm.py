"""Setting up and tearing down tensor parallelism, and the all-reduce of the sharded layers.

torch.distributed only: one process group of ``size`` ranks (``env://`` under torchrun, or the
``init_method`` given), a device group for the all-reduces (NCCL on CUDA, gloo on the CPU) and a
gloo group for host-side control messages. On CUDA a small all-reduce (decode and verification
steps) is a one-shot all-reduce over torch symmetric memory (peer-to-peer reads, no NVLink
multicast: ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and ``NCCL_NVLS_ENABLE=0`` are set before any
group exists); larger ones, or where symmetric memory is unavailable, NCCL's. Both can be captured
in a CUDA graph.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from speculant.distributed.parallel import (
    NO_TENSOR_PARALLEL,
    TensorParallel,
    set_tensor_parallel,
    tensor_parallel,
)

logger = logging.getLogger("speculant")

# the largest all-reduce (bytes) that takes the one-shot symmetric-memory path: a decode or
# verification step's hidden rows (a 70B model's 32 rows of 8192 bf16 are 512 KiB)
ONE_SHOT_MAX_BYTES = 1 << 20
_ONE_SHOT_DTYPES = (torch.bfloat16, torch.float32)
# the timeout of the control group (cpu_group): a worker waits there for rank 0's next call
CONTROL_TIMEOUT = timedelta(days=365)

_owns_process_group = False  # init_tensor_parallel called init_process_group
_symm_mem_used = False  # this process rendezvoused symmetric memory (for an earlier LLM)
_one_shot: _OneShot | None = None
# the fused all-reduce + residual add + RMSNorm of the target's layers (kernels/tp_allreduce.py)
_fused = None
# the most rows it takes (decode and verification steps; larger prefills take all_reduce)
FUSED_MAX_ROWS = 512


class _OneShot:
    """A one-shot all-reduce over a symmetric-memory buffer of ``ONE_SHOT_MAX_BYTES``: one kernel
    copies this rank's input into its buffer, waits for the peers, then reads every peer's
    buffer and sums into a new tensor (``torch.ops.symm_mem.one_shot_all_reduce_copy_out``;
    peer-to-peer loads, no multicast). The buffer is made and rendezvoused once, at set-up
    (neither may happen during a CUDA graph capture)."""

    def __init__(self, group, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.buffer = symm_mem.empty(ONE_SHOT_MAX_BYTES, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, group)
        self.group_name = group.group_name
        self.op = torch.ops.symm_mem.one_shot_all_reduce_copy_out

    def fits(self, x: torch.Tensor) -> bool:
        n = x.numel() * x.element_size()
        return (x.dtype in _ONE_SHOT_DTYPES and n <= ONE_SHOT_MAX_BYTES and n % 16 == 0
                and x.is_contiguous() and x.data_ptr() % 16 == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        buf = self.buffer.view(x.dtype)[: x.numel()].view(x.shape)  # the symmetric slot
        out = torch.empty_like(x)  # not x: other blocks of the kernel may still be copying it
        return self.op(buf, x, "sum", self.group_name, out)


def _all_ranks(tp: TensorParallel, ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (MIN over the gloo group)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=tp.cpu_group)
    return bool(flag.item())


def _setup_one_shot(tp: TensorParallel, device: torch.device) -> _OneShot | None:
    """The one-shot all-reduce where every rank could set it up and a probe sums right (each
    step agreed over the gloo group, so no rank takes a path the others do not, nor waits in a
    kernel for a peer that never launches it), else None: NCCL for every size."""
    global _symm_mem_used
    one_shot, why = None, ""
    # torch numbers a process's symmetric-memory rendezvous (the keys of their store exchange):
    # rank 0 of a second LLM, which made an earlier one, and its new workers would wait on
    # different keys forever. So that LLM takes NCCL (under torchrun every rank is as old).
    if not _all_ranks(tp, not (_symm_mem_used and _owns_process_group)):
        logger.warning("tensor parallel: this process set up symmetric memory for an earlier "
                       "tensor-parallel LLM, so this one all-reduces with NCCL (slower at small "
                       "batches: docs/tensor_parallel.md); make each tensor-parallel LLM in a "
                       "process of its own for the fast path")
        return None
    try:
        if torch.cuda.get_device_capability(device)[0] < 9:
            why = "needs compute capability 9.0+"
        else:
            _symm_mem_used = True
            one_shot = _OneShot(tp.group, device)
    except Exception as e:  # noqa: BLE001 - no P2P, an old driver, a torch without symm_mem
        one_shot, why = None, f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    if _all_ranks(tp, one_shot is not None):
        try:
            probe = torch.full((64,), float(tp.rank + 1), device=device)  # [64] float32
            if not bool((one_shot(probe) == tp.size * (tp.size + 1) / 2).all()):
                one_shot, why = None, "a probe all-reduce gave a wrong sum"
        except Exception as e:  # noqa: BLE001
            one_shot, why = None, f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
        if _all_ranks(tp, one_shot is not None):
            return one_shot
    logger.info("tensor parallel: one-shot symmetric-memory all-reduce off (%s); NCCL "
                "all-reduce for every size", why or "off on another rank")
    return None


def init_tensor_parallel(
    rank: int, size: int, device: torch.device | str, init_method: str | None = None
) -> TensorParallel:
    """Join ``size`` ranks as rank ``rank``, with this process's model on ``device`` (rank r on
    ``cuda:r`` on CUDA), and make the result the current :func:`tensor_parallel`.

    ``init_method`` is torch.distributed's (``"file:///tmp/x"``, ``"tcp://host:port"``); None
    reads ``MASTER_ADDR`` / ``MASTER_PORT`` from the environment (``env://``, as torchrun sets).
    A process group that already exists (a script under torchrun that made its own) is used as
    it is. At size 1 nothing is set up and ``TensorParallel(0, 1, None, None)`` is returned."""
    global _owns_process_group, _one_shot
    device = torch.device(device)
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {size}")
    if not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank {rank} is not one of the {size} ranks (0..{size - 1})")
    if tensor_parallel().enabled:
        raise RuntimeError(
            "tensor parallelism is already set up in this process; call "
            "speculant.distributed.shutdown_tensor_parallel() (LLM.shutdown()) before setting "
            "it up again")
    if size == 1:
        set_tensor_parallel(NO_TENSOR_PARALLEL)
        return NO_TENSOR_PARALLEL
    cuda = device.type == "cuda"
    if cuda:
        count = torch.cuda.device_count()
        index = device.index if device.index is not None else rank
        if index >= count:
            raise ValueError(
                f"tensor-parallel rank {rank} needs device cuda:{index} but {count} CUDA "
                f"device(s) are visible; use a tensor_parallel_size of at most {count}")
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
        # never NVLink multicast (NVLS): it can take a shared host's GPUs out of service
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    backend = "nccl" if cuda else "gloo"
    if dist.is_initialized():
        if dist.get_world_size() != size or dist.get_rank() != rank:
            raise RuntimeError(
                f"a torch.distributed process group of {dist.get_world_size()} ranks (this one "
                f"rank {dist.get_rank()}) already exists, but tensor parallelism asks for rank "
                f"{rank} of {size}; make tensor_parallel_size the world size")
        _owns_process_group = False
    else:
        dist.init_process_group(backend, init_method=init_method or "env://", rank=rank,
                                world_size=size, timeout=timedelta(minutes=30),
                                device_id=device if cuda else None)
        _owns_process_group = True
    ranks = list(range(size))
    group = dist.new_group(ranks, backend=backend)
    # the runner's control broadcasts wait for rank 0's next call however long it idles (a
    # server without requests): no timeout ends them (a dead peer is noticed by gloo at once)
    cpu_group = dist.new_group(ranks, backend="gloo", timeout=CONTROL_TIMEOUT)
    # CUDA: the runner's messages (engine/tp_runner.Channel); a worker waits in it while rank 0
    # idles, so it has the control groups' time-out
    messages = dist.new_group(ranks, backend=backend, timeout=CONTROL_TIMEOUT) if cuda else None
    tp = TensorParallel(rank, size, group, cpu_group, messages)
    if cuda:
        warm = torch.ones(1, device=device)
        dist.all_reduce(warm, group=group)  # the NCCL communicator made now, not in a capture
        dist.all_reduce(warm, group=messages)
        torch.cuda.synchronize(device)
        _one_shot = _setup_one_shot(tp, device)
    set_tensor_parallel(tp)
    return tp


def shutdown_tensor_parallel() -> None:
    """Destroy the groups (and the process group, when :func:`init_tensor_parallel` made it)
    and return to size 1, so an ``LLM`` can be made again in this process. A no-op at size 1.
    Destroy (``CUDAGraph.reset()``) every CUDA graph that captured an NCCL collective of these
    groups first: NCCL's communicator destruction waits for such graphs, forever while one is
    still referenced (an ``LLM``'s own graphs are destroyed by its ``close()``)."""
    global _owns_process_group, _one_shot, _fused
    tp = tensor_parallel()
    set_tensor_parallel(NO_TENSOR_PARALLEL)
    _one_shot = _fused = None
    if not tp.enabled or not dist.is_initialized():
        return
    for g in (tp.group, tp.cpu_group, tp.message_group):
        if g is not None:
            dist.destroy_process_group(g)
    if _owns_process_group:
        dist.destroy_process_group()
    _owns_process_group = False


def all_reduce(x: torch.Tensor, tp: TensorParallel | None = None) -> torch.Tensor:
    """The sum of ``x`` over the ranks of ``tp`` (default: the current one); ``x`` itself at
    size 1 (no kernel, no copy). Use the returned tensor: the one-shot path returns a new one,
    the NCCL and gloo paths ``x`` summed in place (a contiguous copy when ``x`` is not).

    On CUDA: the one-shot symmetric-memory all-reduce for contiguous bf16 / fp32 tensors of up
    to ``ONE_SHOT_MAX_BYTES``, else NCCL's; either can be captured in a CUDA graph. On the CPU:
    gloo's; over more than two
    ranks an all-gather summed in rank order, so every rank gets the same bits and each
    element's sum does not depend on the tensor's size (a batch-invariant forward stays so)."""
    tp = tensor_parallel() if tp is None else tp
    if tp.size == 1:
        return x
    if x.is_cuda and _one_shot is not None and _one_shot.fits(x):
        return _one_shot(x)
    if not x.is_contiguous():
        x = x.contiguous()
    if not x.is_cuda and tp.size > 2:  # in rank order: the same bits on every rank, per element
        parts = [torch.empty_like(x) for _ in range(tp.size)]
        dist.all_gather(parts, x, group=tp.group)
        x.copy_(parts[0])
        for part in parts[1:]:
            x.add_(part)
        return x
    dist.all_reduce(x, group=tp.group)
    return x


def all_gather_columns(x: torch.Tensor, tp: TensorParallel | None = None) -> torch.Tensor:
    """Every rank's ``x`` side by side: ``[rows, cols]`` on each rank -> ``[rows, size * cols]``
    with rank r's columns at ``[r * cols, (r + 1) * cols)`` (a vocab-parallel LM head's logits);
    ``x`` itself at size 1. Collective: every rank calls it with the same shape. One
    ``all_gather_into_tensor`` (NCCL: capturable in a CUDA graph) on CUDA, gloo's
    ``all_gather`` on the CPU."""
    tp = tensor_parallel() if tp is None else tp
    if tp.size == 1:
        return x
    x = x.contiguous()
    if x.is_cuda:
        out = torch.empty((tp.size, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=tp.group)  # [size, rows, cols]
    else:
        parts = [torch.empty_like(x) for _ in range(tp.size)]
        dist.all_gather(parts, x, group=tp.group)
        out = torch.stack(parts)  # [size, rows, cols]
    if x.shape[0] == 1:
        return out.view(1, -1)
    return out.permute(1, 0, 2).reshape(x.shape[0], -1)


def setup_fused_all_reduce(hidden: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Set up the fused one-shot all-reduce (``kernels/tp_allreduce.py``) for rows of ``hidden``
    ``dtype`` elements: collective, every rank of the current group calls it at the same point
    (``ModelRunner`` does, for the sharded target, after every rank loaded). On CUDA with
    symmetric memory on every rank (agreed over the gloo group, as the one-shot path); False
    (and :func:`fused_all_reduce` returns None) elsewhere."""
    global _fused
    tp = tensor_parallel()
    _fused = None
    if not tp.enabled or torch.device(device).type != "cuda":
        return False
    from speculant.kernels.tp_allreduce import SymmetricAllReduce

    made, why = None, ""
    try:
        if _one_shot is None:
            why = "no symmetric memory"
        else:
            made = SymmetricAllReduce(tp.group, torch.device(device), FUSED_MAX_ROWS, hidden, dtype)
    except Exception as e:  # noqa: BLE001 - an old torch or driver: all_reduce + RMSNorm then
        why = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    ok = torch.tensor([1 if made is not None else 0], dtype=torch.int64)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=tp.cpu_group)
    if not int(ok.item()):
        logger.info("tensor parallel: fused all-reduce + RMSNorm off (%s)",
                    why or "off on another rank")
        return False
    _fused = made
    return True


def fused_all_reduce(
    x: torch.Tensor,  # [rows, hidden]: this rank's partial sum
    slot: int,  # 0 or 1: a layer's first (o_proj) or second (down_proj) all-reduce
    residual: torch.Tensor | None = None,  # [rows, hidden]
    weight: torch.Tensor | None = None,  # [hidden]: the RMSNorm that follows, or None
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The sum of ``x`` over the ranks plus ``residual``, normalised with ``weight`` when given,
    in one kernel: ``(normed or sum, sum + residual)``; None where the fused path is not set up
    or ``x`` does not fit it (the caller then runs :func:`all_reduce` and its RMSNorm). Two
    consecutive calls must pass different ``slot`` values unless another collective runs
    between them (the kernel's two buffers: kernels/tp_allreduce.py)."""
    if _fused is None or not x.is_cuda or not _fused.fits(x):
        return None
    return _fused(x, slot, residual, weight, eps)


def fused_gemv_all_reduce(
    x: torch.Tensor,  # [rows, K] ([rows, 2K] gate_up for prologue="silu_mul")
    weight: torch.Tensor,  # [hidden, K]: a row-parallel shard (o_proj, down_proj)
    bias: torch.Tensor | None,  # [hidden]
    prologue: str,  # "none" or "silu_mul"
    residual: torch.Tensor | None = None,  # [rows, hidden]
    norm_weight: torch.Tensor | None = None,  # [hidden]: the RMSNorm that follows, or None
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``fused_all_reduce(gemv(x, weight, bias, prologue=prologue), ...)`` with the exchange
    started inside the GEMV (kernels/tp_allreduce.py ``gemv_all_reduce``); None where the fused
    path is not set up or the product does not fit it (the caller then runs the two)."""
    if _fused is None or not x.is_cuda:
        return None
    return _fused.gemv_all_reduce(x, weight, bias, prologue, residual, norm_weight, eps)
