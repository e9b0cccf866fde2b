"""One-shot all-reduce over symmetric memory, fused with the residual add and RMSNorm that follow
every row-parallel projection of a tensor-parallel layer (``o_proj``, ``down_proj``).

At batch 1 a tensor-parallel decode step of Llama-3-8B at TP 2 runs 64 all-reduces of one
[1, 4096] bf16 row against ~2.5 ms of compute, so their latency, not their bandwidth, matters.
NCCL in a CUDA graph takes ~10 us per call for such a row and torch's symmetric-memory one-shot
all-reduce ~7 us (lent H200 pair, docs/tensor_parallel.md), and the RMSNorm kernel after it
another launch. This kernel does all of it in one launch (up to ``max_programs`` programs, each
over rows ``pid, pid + programs, ...``):

1. push this rank's partial rows into every peer's symmetric buffer, at this rank's place
   (``[slot, rank, row]``: each buffer holds every rank's rows; two slots, alternating per call,
   so a peer still reading the previous call's slot is never overwritten);
2. signal every peer at once (one atomic exchange per peer, from different threads, release,
   system scope) with this program's *epoch*, a per-program call counter kept in this rank's
   own signal pad, then wait until every peer's flag in this rank's pad has reached the epoch
   (acquire). The flags only grow (modulo 2^30), so no flag has to be reset and no rank waits
   for a peer to consume a signal: one NVLink round trip for all peers together, not one per
   peer, and the rows are then read from local memory;
3. sum the rows of every rank in rank order (0, 1, ...) in fp32, round to the dtype, then, as
   ``speculant.models.fused.rms_norm``, add the residual in the dtype and normalise.

That is the flag form, kept for calls of more than ``lamport_rows`` rows; the Lamport form
below takes the others.

Every rank sums in the same order, so all ranks hold bit-identical results. Two slots with one
barrier per call are enough: a rank pushes into slot ``b`` for call ``n + 2`` only after it
passed the barrier of call ``n + 1``, which a peer signals only after finishing call ``n``, the
last reader of ``b``; a peer can be at most one epoch ahead. Callers pick the slot by the call's
position in the forward (``slot``: the layer's first or second all-reduce), which a CUDA graph
keeps. Measured against the earlier pull form (a compare-and-swap per peer, one after the
other, then remote reads): docs/tensor_parallel.md.

Programmatic dependent launch (Hopper, ``_triton_utils.pdl_launch``): the kernel lets the next
one launch first thing, then waits for the one before, so the next GEMV's programs are resident
and issue their first weight loads while the ranks exchange rows. 8B TP 2 on an H100 pair, one
machine: plain batch 1 266.4 / 266.5 tok/s without PDL, 274.7 / 274.6 with it, 273.6 waiting
before the trigger; batch 16 3947 -> 3990 (docs/tensor_parallel.md).

Lamport form (calls of up to ``lamport_rows`` = 32 rows: decode and short verification steps).
The flags above cost a release fence (every push acknowledged over NVLink) before the signal.
Here the data is its own signal: a buffer of three slots ``[3, world, rows, N]``, every element
``-0.0`` (the *empty* marker) until written; a value pushed as ``-0.0`` goes as ``+0.0`` (the
fp32 sum starts from ``+0.0``, so no sum changes). Each rank polls its own buffer (volatile
loads) until no element of a peer's row is the marker, sums in rank order, marks its copy of
the previous call's slot empty and moves the slot on (slot ``n % 3``: a peer can be at most one
call ahead, and the slot it writes next was emptied by this rank's call before). The slot of
each row is a counter in this rank's memory (``[rows, 8]``: one per column chunk; every rank
moves its counters the same way). A row's columns are spread over up to 8 programs (chunks),
each pushing its columns and polling the whole row for the norm: 5.5 us at one row against 7.4
with one program (4 H200s). ``gemv(push=...)`` (``gemv_all_reduce``) goes further: the
row-parallel GEMV's own programs store their outputs into every rank's buffer, this rank's
included, and the poll kernel, launched early, never waits for the GEMV. Measured against the
flag form on 4 H200s (docs/tensor_parallel.md): faster up to 32 rows, slower past them (64
rows 21.3 against 19.6 us), so larger calls keep the flag form.

NVLink multicast is not used (plain loads and stores through peer mappings): it stays off on
the machines we run on. The multi-GPU kernels are tested on two and four GPUs
(tests/kernels/test_tp_allreduce.py, ``gpu``); the flag form's single-rank path, both forms'
rank-0 branch of two ranks in one process (the interpreter) and the reference run everywhere.
"""

from __future__ import annotations

import torch

from speculant.kernels._triton_utils import lazy_jit, next_pow2, pdl_launch, tl
from speculant.kernels.gemv import GemvPush, gemv, gemv_split


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


# flags count calls modulo 2^30 (a constexpr: a jitted kernel reads no other globals)
EPOCH_MASK = tl.constexpr((1 << 30) - 1) if tl is not None else (1 << 30) - 1
LAMPORT_COUNTERS = 8  # Lamport slot counters a row: a program pushes 1, 2, 4 or 8 column chunks


@lazy_jit(do_not_specialize=("rows",))
def _allreduce_norm_kernel(
    x_ptr,  # [rows, N]: this rank's partial (not read when PUSHED)
    bufs_ptr,  # [world] int64: each rank's symmetric buffer of the form (below)
    sync_ptr,  # flags: [world] int64, each rank's signal pad (int32 flags [1 + programs,
    # world]; row 0 is left to torch's own barrier); LAMPORT: [max_rows, FC] int32, this
    # rank's slot (0, 1, 2) of each row's column chunk
    own_ptr,  # LAMPORT: this rank's buffer as ints as wide as the dtype (else unused)
    r_ptr,  # [rows, N]: the residual stream (HAS_RES)
    w_ptr,  # [N]: the norm weight (NORM)
    out_ptr,  # [rows, N]: normed (NORM) or the sum (+ residual)
    res_out_ptr,  # [rows, N]: sum + residual (HAS_RES and NORM)
    stride_x, stride_r, stride_o, stride_ro,
    rows, N, buf_off, max_rows, eps,  # buf_off: the flag slot's first element; max_rows: rows
    # per rank of the form's buffer
    RANK: tl.constexpr, WORLD: tl.constexpr, HAS_RES: tl.constexpr, NORM: tl.constexpr,
    BLOCK: tl.constexpr,  # next_pow2(N): the row
    LAMPORT: tl.constexpr = False,  # the Lamport form ([3, world, max_rows, N]); else flags
    # ([2, world, max_rows, N])
    WP2: tl.constexpr = 1,  # flags: next_pow2(WORLD)
    FC: tl.constexpr = 1,  # LAMPORT: counters (column chunks) a row, LAMPORT_COUNTERS
    FPP: tl.constexpr = 1,  # LAMPORT: of them a program pushes: FC / num_programs(1)
    CB: tl.constexpr = 1,  # LAMPORT: next_pow2(FPP * cw): the columns a program pushes
    SENT: tl.constexpr = 0,  # LAMPORT: the empty marker, -0.0's bits as a signed int
    PUSHED: tl.constexpr = False,  # LAMPORT: the GEMV before pushed every rank's rows
    GDC: tl.constexpr = False,  # launched with PDL (module doc): trigger, then wait
):
    if GDC:  # the next kernel may launch now; then wait for the one before (it wrote x)
        tl.extra.cuda.gdc_launch_dependents()
        if not PUSHED:  # else x is never read: the rows are polled as they land
            tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dt = x_ptr.dtype.element_ty
    if LAMPORT:  # this program pushes (and writes out) columns [lo, hi); it sums whole rows
        cw = tl.cdiv(N, FC * 16) * 16  # a counter's columns: a multiple of 16 (vector stores)
        lo = tl.program_id(1) * FPP * cw
        hi = tl.minimum(lo + FPP * cw, N)
        ccols = lo + tl.arange(0, CB)
        cmask = ccols < hi
        it = own_ptr.dtype.element_ty
    else:
        lo = 0
        hi = N
    if WORLD > 1 and not LAMPORT:
        # push this program's rows (pid, pid + nprog, ...) to [slot, RANK, row] of every peer;
        # the buffers are 16-byte aligned allocations: say so, or the stores go out one element
        # at a time
        for row in range(pid, rows, nprog):
            x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
            for p in tl.static_range(WORLD):
                if p != RANK:
                    peer = tl.multiple_of(
                        tl.load(bufs_ptr + p).to(tl.pointer_type(dt), bitcast=True), 16)
                    tl.store(peer + buf_off + (RANK * max_rows + row) * N + cols, x, mask=mask)
        tl.debug_barrier()  # every thread's stores before the releases below
        my_sig = tl.load(sync_ptr + RANK).to(tl.pointer_type(tl.int32), bitcast=True)
        epoch = (tl.load(my_sig + (pid + 1) * WORLD + RANK, volatile=True) + 1) & EPOCH_MASK  # this call's number
        ranks = tl.arange(0, WP2)
        peers = (ranks < WORLD) & (ranks != RANK)
        peer_sig = tl.load(sync_ptr + ranks, mask=ranks < WORLD, other=0)
        flags = peer_sig.to(tl.pointer_type(tl.int32), bitcast=True) + (pid + 1) * WORLD + RANK
        tl.atomic_xchg(flags, tl.zeros([WP2], tl.int32) + epoch, mask=peers, sem="release",
                       scope="sys")
        mine = my_sig + (pid + 1) * WORLD + ranks  # [WP2]: the flags the peers set here
        seen = tl.full([], 0, tl.int32)
        while seen < WORLD - 1:
            v = tl.atomic_add(mine, tl.zeros([WP2], tl.int32), mask=peers, sem="acquire",
                              scope="sys")
            ok = peers & (((v - epoch) & EPOCH_MASK) < (1 << 29))  # v >= epoch
            seen = tl.sum(ok.to(tl.int32), axis=0)
        tl.store(my_sig + (pid + 1) * WORLD + RANK, epoch)
        tl.debug_barrier()
    for row in range(pid, rows, nprog):
        if LAMPORT and WORLD > 1:
            slot = tl.load(sync_ptr + row * FC + tl.program_id(1) * FPP, cache_modifier=".cg")
            if not PUSHED:  # this program's columns to [slot, RANK, row] of every peer, -0.0
                # as +0.0 (the sums start from +0.0: none changes)
                xi = tl.load(x_ptr + row * stride_x + ccols, mask=cmask, other=0.0).to(
                    it, bitcast=True)
                xi = tl.where(xi == SENT, tl.zeros_like(xi), xi)
                for p in tl.static_range(WORLD):
                    if p != RANK:
                        peer = tl.multiple_of(
                            tl.load(bufs_ptr + p).to(tl.pointer_type(it), bitcast=True), 16)
                        tl.store(peer + ((slot * WORLD + RANK) * max_rows + row) * N + ccols,
                                 xi, mask=cmask)
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for p in tl.static_range(WORLD):  # the whole row, in rank order
                if p == RANK and not PUSHED:
                    acc += tl.load(x_ptr + row * stride_x + cols, mask=mask,
                                   other=0.0).to(tl.float32)
                else:  # wait until no element of rank p's row is the marker (volatile: L2)
                    src = own_ptr + ((slot * WORLD + p) * max_rows + row) * N + cols
                    v = tl.load(src, mask=mask, other=0, volatile=True)
                    while tl.max((v == SENT).to(tl.int32), axis=0) > 0:
                        v = tl.load(src, mask=mask, other=0, volatile=True)
                    acc += v.to(dt, bitcast=True).to(tl.float32)
            # the previous call's slot was read by every program of that call (a kernel
            # before): mark this program's columns of it empty for the call after next (own
            # rows too: a PUSHED call writes them), then move the slot on
            prev = (slot + 2) % 3
            for p in tl.static_range(WORLD):
                tl.store(own_ptr + ((prev * WORLD + p) * max_rows + row) * N + ccols,
                         tl.full([CB], SENT, it), mask=cmask)
            tl.store(sync_ptr + row * FC + tl.program_id(1) * FPP + tl.arange(0, FPP),
                     tl.zeros([FPP], tl.int32) + (slot + 1) % 3)
            s = acc.to(dt)
        elif WORLD > 1:  # flags: every rank's rows are in this rank's buffer now
            own = tl.multiple_of(tl.load(bufs_ptr + RANK).to(tl.pointer_type(dt), bitcast=True),
                                 16)
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for p in tl.static_range(WORLD):
                if p == RANK:
                    acc += tl.load(x_ptr + row * stride_x + cols, mask=mask,
                                   other=0.0).to(tl.float32)
                else:  # .cg: through L2, never a stale L1 line of an earlier call
                    acc += tl.load(own + buf_off + (p * max_rows + row) * N + cols, mask=mask,
                                   other=0.0, cache_modifier=".cg").to(tl.float32)
            s = acc.to(dt)
        else:
            s = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        omask = mask & (cols >= lo) & (cols < hi)  # LAMPORT: every program normalises the row
        if HAS_RES:
            s = s + tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
        if NORM:
            if HAS_RES:
                tl.store(res_out_ptr + row * stride_ro + cols, s, mask=omask)
            sf = s.to(tl.float32)
            inv = tl.rsqrt(tl.sum(sf * sf, axis=0) / N + eps)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0)
            tl.store(out_ptr + row * stride_o + cols, (sf * inv).to(dt) * w, mask=omask)
        else:
            tl.store(out_ptr + row * stride_o + cols, s, mask=omask)


class SymmetricAllReduce:
    """A rank's side of the fused one-shot all-reduce for one TP group, set up collectively
    (every rank of ``group`` constructs it at the same time). ``max_rows``: the most rows a
    call may have (callers route larger calls elsewhere, e.g. NCCL). Two forms, each where it
    measured faster (docs/tensor_parallel.md): up to ``lamport_rows`` rows the Lamport kernel
    (a symmetric buffer of ``[3, world, lamport_rows, hidden]``, polled on the data), past
    them the flag kernel (``[2, world, max_rows, hidden]`` and the signal pads)."""

    def __init__(self, group, device: torch.device, max_rows: int, hidden: int,
                 dtype: torch.dtype, max_programs: int = 32, lamport_rows: int = 32) -> None:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.max_rows, self.hidden, self.dtype = max_rows, hidden, dtype
        self.max_programs = max_programs  # rows per program grow past it: one barrier each
        self.lamport_rows = min(lamport_rows, max_rows)
        self.buffer = symm_mem.empty(2 * self.world * max_rows * hidden, dtype=dtype,
                                     device=device)
        handle = symm_mem.rendezvous(self.buffer, group)
        need = (max_programs + 1) * self.world * 4
        if handle.signal_pad_size < need:
            raise ValueError(f"symmetric-memory signal pad of {handle.signal_pad_size} bytes, "
                             f"{need} needed for {max_programs} programs; lower max_programs")
        self.handle = handle
        # [world] int64: peer base addresses, as tensors the kernel reads
        self.bufs = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
        self.sigs = torch.tensor(list(handle.signal_pad_ptrs), dtype=torch.int64, device=device)
        # the Lamport form's buffer, as ints as wide as the dtype, all -0.0 (empty) at first
        # (lamport_rows=0: the flag form alone, one row of it unused)
        bits = torch.finfo(dtype).bits
        lam = symm_mem.empty(3 * self.world * max(self.lamport_rows, 1) * hidden, dtype=dtype,
                             device=device)
        lam_handle = symm_mem.rendezvous(lam, group)
        self.lam_buffer, self.lam_handle = lam, lam_handle
        self.ints = lam.view({16: torch.int16, 32: torch.int32}[bits])
        self.lam_bufs = torch.tensor(list(lam_handle.buffer_ptrs), dtype=torch.int64,
                                     device=device)
        self.sent = -(1 << (bits - 1))  # -0.0's bits: the empty marker
        self.ints.fill_(self.sent)
        self.counters = torch.zeros(max(self.lamport_rows, 1), LAMPORT_COUNTERS,
                                    dtype=torch.int32, device=device)  # [rows, FC]: slots 0-2
        # where gemv(..., push=...) stores its rows for gemv_all_reduce
        self.push = GemvPush(self.lam_bufs, self.ints, self.counters, self.rank, self.world,
                             self.sent)
        torch.cuda.synchronize(device)
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
        if 0 < rows <= self.lamport_rows:
            self._lamport(x, rows, r, weight, out, res_out, residual is not None, eps, False)
        elif rows:
            block = next_pow2(n)
            _allreduce_norm_kernel[(min(rows, self.max_programs),)](
                x, self.bufs, self.sigs, x, r, weight if norm else x, out, res_out,
                x.stride(0), r.stride(0), out.stride(0), res_out.stride(0),
                rows, n, (slot % 2) * self.world * self.max_rows * n, self.max_rows, eps,
                RANK=self.rank, WORLD=self.world, HAS_RES=residual is not None, NORM=norm,
                BLOCK=block, WP2=next_pow2(self.world), num_warps=8 if block >= 4096 else 4,
                **pdl_launch(x.device))
        if norm:
            return out, (res_out if residual is not None else out)
        return out, out

    def _lamport(self, x, rows, r, weight, out, res_out, has_res, eps, pushed) -> None:
        """Launch the Lamport kernel over ``rows`` rows (``pushed``: the rows are already on
        their way, ``x`` only names the dtype)."""
        n = self.hidden
        programs = min(rows, self.max_programs)
        # column chunks a row: 8 at one row (5.5 us against 7.4 with one program, H200s)
        chunks = min(LAMPORT_COUNTERS, max(1, self.max_programs // programs))
        chunks = 1 << (chunks.bit_length() - 1)  # a power of two <= LAMPORT_COUNTERS
        fpp = LAMPORT_COUNTERS // chunks
        block = next_pow2(n)
        norm = weight is not None
        _allreduce_norm_kernel[(programs, chunks)](
            x, self.lam_bufs, self.counters, self.ints, r, weight if norm else x, out, res_out,
            x.stride(0), r.stride(0), out.stride(0), res_out.stride(0),
            rows, n, 0, self.lamport_rows, eps,
            RANK=self.rank, WORLD=self.world, HAS_RES=has_res, NORM=norm, BLOCK=block,
            LAMPORT=True, FC=LAMPORT_COUNTERS, FPP=fpp,
            CB=next_pow2(fpp * 16 * -(-n // (16 * LAMPORT_COUNTERS))), SENT=self.sent,
            PUSHED=pushed, num_warps=8 if block >= 4096 else 4, **pdl_launch(x.device))

    def gemv_all_reduce(
        self,
        x: torch.Tensor,  # [rows, K] ([rows, 2K] gate_up for prologue="silu_mul")
        weight: torch.Tensor,  # [hidden, K]: this rank's row-parallel shard
        bias: torch.Tensor | None,  # [hidden]
        prologue: str,  # "none" or "silu_mul" (kernels/gemv.py)
        residual: torch.Tensor | None = None,  # [rows, hidden]
        norm_weight: torch.Tensor | None = None,  # [hidden]
        eps: float = 1e-6,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # (normed or sum, sum + residual)
        """``self(gemv(x, weight, bias, prologue=prologue), ...)`` with the exchange started by
        the GEMV: each of its programs stores its outputs straight into every rank's buffer
        (``gemv(push=...)``) and this kernel, launched early (PDL) and never waiting for the
        GEMV, sums the rows as they land. None where the GEMV would split K or ``x`` does not
        fit (the caller then runs the two separately)."""
        rows = x.shape[0]
        if (self.world < 2 or not 0 < rows <= self.lamport_rows
                or weight.shape[0] != self.hidden or x.dtype != self.dtype
                or gemv_split(x, weight, prologue=prologue) != 1):
            return None
        gemv(x, weight, bias, prologue=prologue, push=self.push)
        out = torch.empty(rows, self.hidden, dtype=x.dtype, device=x.device)
        norm = norm_weight is not None
        res_out = torch.empty_like(out) if (norm and residual is not None) else out
        r = residual if residual is not None else out
        self._lamport(out, rows, r, norm_weight, out, res_out, residual is not None, eps, True)
        if norm:
            return out, (res_out if residual is not None else out)
        return out, out
