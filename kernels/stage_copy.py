"""A CUDA graph's own input copy: read this step's inputs from a pinned host ring buffer.

``stage_copy(ring64, ring32, dst64, dst32, count, ack, err, layout)``

A decode or verification step that depends on the previous step's result (every speculative
step) leaves the GPU idle from the moment the previous result is read back until the next
forward starts. Staging the next step's inputs with a host-to-device ``cudaMemcpyAsync`` and an
event to know when the pinned buffer may be rewritten put two CUDA calls in that window, ~100 us
on the H100 machine (``bench/spec_timeline.py``: ``filled -> stage<``). Instead, the first node
of each small step's CUDA graph is this kernel: it reads the inputs straight from pinned host
memory (mapped into the GPU's address space: zero-copy) into the graph's static device buffers,
so staging costs the host only its own writes into the pinned buffer.

The host writes launch ``s`` (1, 2, ...) into slot ``(s - 1) % R`` of a ring of ``R`` slots and
may rewrite a slot only once its ``ack`` says the launch that used it has copied it, so it never
waits for the GPU unless it is ``R`` launches ahead. The kernel finds its slot from a device
counter of the launches it has consumed (``count``; graphs replay in stream order), checks the
slot's header, copies, and then acknowledges: ``ack[slot] = s``, ``count = s``.

Ring slot layout (``StageLayout``; the device buffers have the same layout without the header):

* ``ring64 [R, 4 * n_max + 2]`` int64: ``ids [n_max] | positions [n_max] | slots [n_max] |
  tree bits [n_max] | launch number s | ids_on_device``; the first ``m`` entries of each of the
  ``REGIONS`` regions are copied, except the first ``ids_on_device`` ids, which the caller
  already wrote on the device (a previous step's tokens, fed without a read-back). The tree bits
  (a token-tree step's ancestor bits, ``AttentionMetadata.tree_bits``) ride along in every
  launch, so a tree step needs no copy of its own; other steps' graphs never read them.
* ``ring32 [R, l32]`` int32: ``ctx`` at ``c`` (``b`` entries), ``qsl`` at ``q`` (``b + 1``),
  block ``tables`` at ``t`` (``b * w``); only those entries are copied.

A slot whose header does not hold the expected launch number (the host and the device out of
step: a bug) is not copied; the kernel writes the expected number to ``err`` (pinned), which the
host checks before its next write.

One program does the whole copy (the acknowledgement needs all of it done), so it is meant for
small steps (a few KB). The torch reference below is the same copy on tensors; the launcher
checks shapes, dtypes and the layout.

``pinned_copy(src, dst)`` is the same zero-copy read without the ring: a plain copy of a pinned
host vector into a device vector, as the first node of a proposer's CUDA graph (draft model,
EAGLE, MLPSpeculator). Those graphs' callers read the drafts back before they stage the next
call's inputs, so one pinned buffer suffices and the host's staging is its own writes: no
``cudaMemcpyAsync``, no event (~50-100 us of host time per propose on the H100 machine,
measured in the 1B draft's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._triton_utils import cdiv, check_tensor, lazy_jit, tl, use_triton

__all__ = [
    "StageLayout",
    "stage_copy",
    "stage_copy_reference",
    "HEADER",
    "REGIONS",
    "pinned_copy",
    "pinned_copy_reference",
]

REGIONS = 4  # int64 regions of n_max entries in a ring64 slot: ids, positions, slots, tree bits
HEADER = 2  # int64 entries after the regions of a ring64 slot: launch number, ids on device


@dataclass(frozen=True)
class StageLayout:
    """Where a step's inputs live: ``n_max`` rows per int64 region (``m`` used), and in the int32
    region ``b`` context lengths at ``c``, ``b + 1`` query starts at ``q``, ``b x w`` block-table
    entries at ``t``."""

    n_max: int
    m: int
    c: int
    q: int
    t: int
    b: int
    w: int

    def check(self, l32: int) -> None:
        if not 0 < self.m <= self.n_max:
            raise ValueError(f"stage layout: m={self.m} must be in [1, n_max={self.n_max}]")
        spans = {
            "ctx": (self.c, self.b),
            "qsl": (self.q, self.b + 1),
            "tables": (self.t, self.b * self.w),
        }
        for name, (lo, n) in spans.items():
            if lo < 0 or n < 0 or lo + n > l32:
                raise ValueError(
                    f"stage layout: {name} [{lo}, {lo + n}) is outside the int32 "
                    f"region of {l32} entries"
                )


def stage_copy_reference(
    ring64: torch.Tensor,  # [R, REGIONS * n_max + HEADER] int64
    ring32: torch.Tensor,  # [R, l32] int32
    dst64: torch.Tensor,  # [REGIONS * n_max] int64
    dst32: torch.Tensor,  # [l32] int32
    count: torch.Tensor,  # [1] int64: launches consumed so far
    ack: torch.Tensor,  # [R] int64
    err: torch.Tensor,  # [1] int64
    layout: StageLayout,
) -> None:
    """The kernel's effect, in torch (in place)."""
    R = ring64.shape[0]
    n, m = layout.n_max, layout.m
    s = int(count[0]) + 1
    slot = (s - 1) % R
    src = ring64[slot]
    if int(src[REGIONS * n]) != s:
        err[0] = s
        return
    skip = min(int(src[REGIONS * n + 1]), m)
    dst64[skip:m] = src[skip:m]
    for lo in range(n, REGIONS * n, n):
        dst64[lo : lo + m] = src[lo : lo + m]
    for lo, k in ((layout.c, layout.b), (layout.q, layout.b + 1), (layout.t, layout.b * layout.w)):
        dst32[lo : lo + k] = ring32[slot, lo : lo + k]
    ack[slot] = s
    count[0] = s


if tl is not None:

    # one binary for every step shape: the staging kernel is compiled once, outside captures
    @lazy_jit(do_not_specialize=("N_MAX", "M", "L32", "C", "Q", "T", "B", "BW"))
    def _stage_copy_kernel(
        ring64_ptr,  # [R, 4 * N_MAX + 2] int64, pinned host memory (REGIONS = 4)
        ring32_ptr,  # [R, L32] int32, pinned host memory
        dst64_ptr,  # [4 * N_MAX] int64, device
        dst32_ptr,  # [L32] int32, device
        count_ptr,  # [1] int64, device: launches consumed
        ack_ptr,  # [R] int64, pinned host memory
        err_ptr,  # [1] int64, pinned host memory
        N_MAX,
        M,
        L32,
        C,
        Q,
        T,
        B,
        BW,  # B * W block-table entries
        R: tl.constexpr,
        BLOCK64: tl.constexpr,
        BLOCK32: tl.constexpr,
    ):
        r64 = tl.arange(0, BLOCK64)
        r32 = tl.arange(0, BLOCK32)
        z64 = r64 * 0
        s = tl.load(count_ptr + z64) + 1  # [BLOCK64] this launch's number (all equal)
        slot = (s - 1) % R
        src64 = ring64_ptr + slot * (4 * N_MAX + 2)  # [BLOCK64] pointers to the slot
        ok = tl.load(src64 + 4 * N_MAX) == s  # [BLOCK64] the slot holds this launch
        skip = tl.load(src64 + 4 * N_MAX + 1)  # [BLOCK64] leading ids already on the device
        for lo in range(0, M, BLOCK64):
            o = lo + r64
            mk = ok & (o < M)
            mi = mk & (o >= skip)
            tl.store(dst64_ptr + o, tl.load(src64 + o, mask=mi), mask=mi)
            v = tl.load(src64 + N_MAX + o, mask=mk)
            tl.store(dst64_ptr + N_MAX + o, v, mask=mk)
            v = tl.load(src64 + 2 * N_MAX + o, mask=mk)
            tl.store(dst64_ptr + 2 * N_MAX + o, v, mask=mk)
            v = tl.load(src64 + 3 * N_MAX + o, mask=mk)  # tree bits
            tl.store(dst64_ptr + 3 * N_MAX + o, v, mask=mk)
        # the same scalars as [BLOCK32] blocks for the int32 loops
        s32 = tl.load(count_ptr + r32 * 0) + 1
        slot32 = (s32 - 1) % R
        ok32 = tl.load(ring64_ptr + slot32 * (4 * N_MAX + 2) + 4 * N_MAX) == s32
        src32 = ring32_ptr + slot32 * L32  # [BLOCK32]
        for lo in range(0, B + 1, BLOCK32):  # ctx (B) and qsl (B + 1)
            o = lo + r32
            mc = ok32 & (o < B)
            tl.store(dst32_ptr + C + o, tl.load(src32 + C + o, mask=mc), mask=mc)
            mq = ok32 & (o < B + 1)
            tl.store(dst32_ptr + Q + o, tl.load(src32 + Q + o, mask=mq), mask=mq)
        for lo in range(0, BW, BLOCK32):
            o = lo + r32
            mt = ok32 & (o < BW)
            tl.store(dst32_ptr + T + o, tl.load(src32 + T + o, mask=mt), mask=mt)
        tl.debug_barrier()  # every thread's loads (of ``count`` too) are done
        first = r64 == 0
        tl.store(ack_ptr + slot, s, mask=first & ok)
        tl.store(count_ptr + z64, s, mask=first & ok)
        tl.store(err_ptr + z64, s, mask=first & (ok == 0))


if tl is not None:

    @lazy_jit(do_not_specialize=("n",))
    def _pinned_copy_kernel(
        src_ptr,  # [n] pinned host memory (read over the bus)
        dst_ptr,  # [n] device, same dtype
        n,
        BLOCK: tl.constexpr,
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def pinned_copy_reference(src: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst[:] = src`` (the kernel's effect)."""
    dst.copy_(src)


def pinned_copy(
    src: torch.Tensor,  # [n] (pinned host memory when dst is on CUDA)
    dst: torch.Tensor,  # [n] same dtype (device)
    force_triton: bool = False,
) -> None:
    """``dst[:] = src`` by a kernel that reads the pinned host vector ``src`` directly: CUDA-graph
    capturable, and at replay it reads what the host wrote there last (no host-side copy call).
    The caller must not rewrite ``src`` before the replay that reads it has run. On CPU tensors
    the torch reference runs, unless ``force_triton`` (the interpreter, in tests)."""
    for name, t in (("src", src), ("dst", dst)):
        check_tensor(name, t, ndim=1)
        if t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous, got stride {t.stride(0)}")
    if dst.dtype != src.dtype or dst.shape != src.shape:
        raise ValueError(
            f"pinned_copy: src {tuple(src.shape)} {src.dtype} and dst {tuple(dst.shape)} "
            f"{dst.dtype} must have the same shape and dtype"
        )
    if dst.device.type == "cuda" and not (src.device.type == "cpu" and src.is_pinned()):
        raise ValueError(
            "pinned_copy: src must be pinned host memory (the kernel reads it over the bus); "
            "allocate it with pin_memory=True"
        )
    if not use_triton([dst], force_triton):
        pinned_copy_reference(src, dst)
        return
    n, block = dst.numel(), 1024
    if n:
        _pinned_copy_kernel[(cdiv(n, block),)](src, dst, n, BLOCK=block, num_warps=4)


def _check(ring64, ring32, dst64, dst32, count, ack, err, layout: StageLayout) -> None:
    for name, t in (("ring64", ring64), ("ring32", ring32), ("dst64", dst64), ("dst32", dst32)):
        if isinstance(t, torch.Tensor) and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    check_tensor("ring64", ring64, ndim=2, dtypes=(torch.int64,))
    R = ring64.shape[0]
    n = layout.n_max
    if ring64.shape[1] != REGIONS * n + HEADER:
        raise ValueError(
            f"ring64 must have shape (R, {REGIONS} * n_max + {HEADER}) = "
            f"(R, {REGIONS * n + HEADER}), got {tuple(ring64.shape)}"
        )
    check_tensor("ring32", ring32, ndim=2, dtypes=(torch.int32,))
    if ring32.shape[0] != R:
        raise ValueError(f"ring32 must have {R} slots like ring64, got {ring32.shape[0]}")
    l32 = ring32.shape[1]
    dev = dst64.device
    check_tensor("dst64", dst64, shape=(REGIONS * n,), dtypes=(torch.int64,))
    check_tensor("dst32", dst32, shape=(l32,), dtypes=(torch.int32,), device=dev)
    check_tensor("count", count, shape=(1,), dtypes=(torch.int64,), device=dev)
    check_tensor("ack", ack, shape=(R,), dtypes=(torch.int64,))
    check_tensor("err", err, shape=(1,), dtypes=(torch.int64,))
    if dev.type == "cuda":
        for name, t in (("ring64", ring64), ("ring32", ring32), ("ack", ack), ("err", err)):
            if not t.is_pinned():
                raise ValueError(
                    f"{name} must be pinned host memory (the kernel reads it over "
                    "the bus); allocate it with pin_memory=True"
                )
    layout.check(l32)


def stage_copy(
    ring64: torch.Tensor,  # [R, REGIONS * n_max + HEADER] int64 (pinned host memory on CUDA)
    ring32: torch.Tensor,  # [R, l32] int32 (pinned host memory on CUDA)
    dst64: torch.Tensor,  # [REGIONS * n_max] int64 (device)
    dst32: torch.Tensor,  # [l32] int32 (device)
    count: torch.Tensor,  # [1] int64 (device)
    ack: torch.Tensor,  # [R] int64 (pinned host memory on CUDA)
    err: torch.Tensor,  # [1] int64 (pinned host memory on CUDA)
    layout: StageLayout,
    force_triton: bool = False,
) -> None:
    """Copy the inputs of launch ``count + 1`` from its ring slot into ``dst64`` / ``dst32`` and
    acknowledge it (see the module doc). No host synchronisation: CUDA-graph capturable. On CPU
    tensors the torch reference runs, unless ``force_triton`` (the interpreter, in tests)."""
    _check(ring64, ring32, dst64, dst32, count, ack, err, layout)
    if not use_triton([dst64, dst32, count], force_triton):
        stage_copy_reference(ring64, ring32, dst64, dst32, count, ack, err, layout)
        return
    _stage_copy_kernel[(1,)](
        ring64,
        ring32,
        dst64,
        dst32,
        count,
        ack,
        err,
        layout.n_max,
        layout.m,
        ring32.shape[1],
        layout.c,
        layout.q,
        layout.t,
        layout.b,
        layout.b * layout.w,
        R=ring64.shape[0],
        BLOCK64=256,
        BLOCK32=1024,
        num_warps=4,
    )
