"""One-shot all-reduce over symmetric memory, fused with the residual add and RMSNorm that follow
every row-parallel projection of a tensor-parallel layer (``o_proj``, ``down_proj``).

At batch 1 a tensor-parallel decode step of Llama-3-8B at TP 2 runs 64 all-reduces of one
[1, 4096] bf16 row against ~2.5 ms of compute, so their latency, not their bandwidth, matters.
NCCL in a CUDA graph takes ~10 us per call for such a row and torch's symmetric-memory one-shot
all-reduce ~7 us (lent H200 pair, docs/tensor_parallel.md), and the RMSNorm kernel after it
another launch. This kernel does all of it in one launch (up to ``max_programs`` programs, each
over rows ``pid, pid + programs, ...``):

1. copy this rank's partial row into this rank's symmetric buffer (one of two, alternating per
   call, so a peer still reading the previous call's buffer is never overwritten);
2. barrier with the same program on every peer through the signal pads: a release
   compare-and-swap 0 -> 1 on each peer's flag ``[program, my rank]``, then an acquire
   compare-and-swap 1 -> 0 on each of its own flags ``[program, peer]`` (system scope);
3. sum the rows of every rank in rank order (0, 1, ...) in fp32, round to the dtype, then, as
   ``speculant.models.fused.rms_norm``, add the residual in the dtype and normalise.

Every rank sums in the same order, so all ranks hold bit-identical results. Two buffers with one
barrier per call are enough: a rank writes buffer ``b`` for call ``n + 1`` only after it passed
the barrier of call ``n``, which a peer enters only after finishing call ``n - 1``, the last
reader of ``b``. Callers pick the buffer by the call's position in the forward (``slot``: the
layer's first or second all-reduce), which a CUDA graph keeps.

NVLink multicast is not used (plain loads and stores through peer mappings): it stays off on
the machines we run on. The multi-GPU kernel is tested on two GPUs (tests/test_tp_allreduce.py,
``gpu``); its single-rank form (``world == 1``: no barrier) and the reference run everywhere.
"""

from __future__ import annotations

import torch

from speculant.kernels._triton_utils import lazy_jit, next_pow2, tl


def allreduce_rms_norm_ref(
    partials: list[torch.Tensor],  # world x [rows, N]: each rank's partial, in rank order
    residual: torch.Tensor | None,  # [rows, N]
    weight: torch.Tensor | None,  # [N]: the RMSNorm weight; None: no norm
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed or the sum, sum + residual)
    """The torch reference: ``s = sum(partials)`` in fp32 (rank order), rounded to the dtype;
    ``x = s + residual`` in the dtype; returns ``(rms_norm(x) * weight, x)`` or ``(x, x)``
    without a weight."""
    acc = torch.zeros_like(partials[0], dtype=torch.float32)
    for p in partials:
        acc += p.float()
    x = acc.to(partials[0].dtype)
    if residual is not None:
        x = x + residual
    if weight is None:
        return x, x
    xf = x.float()
    inv = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * inv).to(x.dtype) * weight, x


@lazy_jit(do_not_specialize=("rows",))
def _allreduce_norm_kernel(
    x_ptr,  # [rows, N]: this rank's partial
    bufs_ptr,  # [world] int64: each rank's symmetric buffer (2 * max_rows * N elements)
    sigs_ptr,  # [world] int64: each rank's signal pad (int32 flags [programs, world])
    r_ptr,  # [rows, N]: the residual stream (HAS_RES)
    w_ptr,  # [N]: the norm weight (NORM)
    out_ptr,  # [rows, N]: normed (NORM) or the sum (+ residual)
    res_out_ptr,  # [rows, N]: sum + residual (HAS_RES and NORM)
    stride_x, stride_r, stride_o, stride_ro,
    rows, N, buf_off, eps,
    RANK: tl.constexpr, WORLD: tl.constexpr, HAS_RES: tl.constexpr, NORM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dt = x_ptr.dtype.element_ty
    if WORLD > 1:
        # this program's rows (pid, pid + nprog, ...) into this rank's buffer, then one barrier
        # with the same program of every peer
        # the buffers are 16-byte aligned allocations: say so, or the loads and stores through
        # these pointers go out one element at a time (slower at 64 rows)
        own = tl.multiple_of(tl.load(bufs_ptr + RANK).to(tl.pointer_type(dt), bitcast=True), 16)
        for row in range(pid, rows, nprog):
            x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
            tl.store(own + buf_off + row * N + cols, x, mask=mask)
        tl.debug_barrier()  # every thread's store before the release below
        for p in tl.static_range(WORLD):
            if p != RANK:
                peer_sig = tl.load(sigs_ptr + p).to(tl.pointer_type(tl.int32), bitcast=True)
                flag = peer_sig + pid * WORLD + RANK
                while tl.atomic_cas(flag, 0, 1, sem="release", scope="sys") != 0:
                    pass
        my_sig = tl.load(sigs_ptr + RANK).to(tl.pointer_type(tl.int32), bitcast=True)
        for p in tl.static_range(WORLD):
            if p != RANK:
                flag = my_sig + pid * WORLD + p
                while tl.atomic_cas(flag, 1, 0, sem="acquire", scope="sys") != 1:
                    pass
        tl.debug_barrier()
    for row in range(pid, rows, nprog):
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if WORLD > 1:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for p in tl.static_range(WORLD):
                if p == RANK:
                    acc += x.to(tl.float32)
                else:  # .cg: through L2, never a stale L1 line of an earlier call
                    peer = tl.multiple_of(
                        tl.load(bufs_ptr + p).to(tl.pointer_type(dt), bitcast=True), 16)
                    acc += tl.load(peer + buf_off + row * N + cols, mask=mask, other=0.0,
                                   cache_modifier=".cg").to(tl.float32)
            s = acc.to(dt)
        else:
            s = x
        if HAS_RES:
            s = s + tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
        if NORM:
            if HAS_RES:
                tl.store(res_out_ptr + row * stride_ro + cols, s, mask=mask)
            sf = s.to(tl.float32)
            inv = tl.rsqrt(tl.sum(sf * sf, axis=0) / N + eps)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0)
            tl.store(out_ptr + row * stride_o + cols, (sf * inv).to(dt) * w, mask=mask)
        else:
            tl.store(out_ptr + row * stride_o + cols, s, mask=mask)


class SymmetricAllReduce:
    """A rank's side of the fused one-shot all-reduce for one TP group: two symmetric buffers
    of ``max_rows x hidden`` elements of ``dtype`` and the signal pads, set up collectively
    (every rank of ``group`` constructs it at the same time). ``max_rows``: the most rows a
    call may have (callers route larger calls elsewhere, e.g. NCCL)."""

    def __init__(self, group, device: torch.device, max_rows: int, hidden: int,
                 dtype: torch.dtype, max_programs: int = 32) -> None:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.max_rows, self.hidden, self.dtype = max_rows, hidden, dtype
        self.max_programs = max_programs  # rows per program grow past it: one barrier each
        self.buffer = symm_mem.empty(2 * max_rows * hidden, dtype=dtype, device=device)
        handle = symm_mem.rendezvous(self.buffer, group)
        need = max_programs * self.world * 4
        if handle.signal_pad_size < need:
            raise ValueError(f"symmetric-memory signal pad of {handle.signal_pad_size} bytes, "
                             f"{need} needed for {max_programs} programs; lower max_programs")
        self.handle = handle
        # [world] int64: peer base addresses, as tensors the kernel reads
        self.bufs = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
        self.sigs = torch.tensor(list(handle.signal_pad_ptrs), dtype=torch.int64, device=device)
        handle.barrier()

    def fits(self, x: torch.Tensor) -> bool:
        return (x.dim() == 2 and x.shape[0] <= self.max_rows and x.shape[1] == self.hidden
                and x.dtype == self.dtype and x.stride(1) == 1)

    def __call__(
        self,
        x: torch.Tensor,  # [rows, hidden]: this rank's partial sum
        slot: int,  # which of the two buffers: alternate between consecutive calls
        residual: torch.Tensor | None = None,  # [rows, hidden]
        weight: torch.Tensor | None = None,  # [hidden]: RMSNorm weight
        eps: float = 1e-6,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (normed or sum, sum + residual)
        """The all-reduced ``x`` (plus ``residual``), normalised with ``weight`` if given:
        as :func:`allreduce_rms_norm_ref` over every rank's ``x``."""
        if not self.fits(x):
            raise ValueError(f"SymmetricAllReduce: x {tuple(x.shape)} {x.dtype} stride "
                             f"{x.stride()} does not fit [<= {self.max_rows}, {self.hidden}] "
                             f"{self.dtype} with unit column stride")
        rows, n = x.shape
        out = torch.empty_like(x)
        norm = weight is not None
        res_out = torch.empty_like(x) if (norm and residual is not None) else out
        r = residual if residual is not None else x
        if rows:
            block = next_pow2(n)
            _allreduce_norm_kernel[(min(rows, self.max_programs),)](
                x, self.bufs, self.sigs, r, weight if norm else x, out, res_out,
                x.stride(0), r.stride(0), out.stride(0), res_out.stride(0),
                rows, n, (slot % 2) * self.max_rows * n, eps,
                RANK=self.rank, WORLD=self.world, HAS_RES=residual is not None, NORM=norm,
                BLOCK=block, num_warps=8 if block >= 4096 else 4)
        if norm:
            return out, (res_out if residual is not None else out)
        return out, out
