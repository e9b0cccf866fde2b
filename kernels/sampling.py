"""Sampling distribution: temperature, top-k, top-p and min-p applied to logits.

``sampling_probs(logits, temperature, top_k, top_p, min_p) -> probs [rows, vocab] fp32``

Semantics (vLLM's order):

1. Rows with ``temperature <= 1e-5`` are greedy rows: they get ``softmax(logits)`` of the raw
   logits and no filtering (the caller takes the argmax).
2. Other rows: ``x = logits / temperature``.
3. top-k (``0 < k < vocab``): keep tokens with ``x >= x_(k)``, the k-th largest value (ties at
   the boundary are kept).
4. min-p (``min_p > 0``): keep tokens with ``p >= min_p * max(p)`` where ``p = softmax(x)``,
   i.e. ``exp(x - max(x)) >= min_p``. min-p and top-k both keep a top set of ``x``, so their
   order does not matter.
5. top-p (``top_p < 1``) on the renormalised survivors: keep the smallest set of most probable
   tokens whose mass is ``>= top_p`` (a token is kept iff the mass of survivors strictly more
   probable than it is ``< top_p``; ties at the boundary are kept). At least one token always
   survives.
6. Renormalise.

Two implementations, identical semantics (they agree to fp32 rounding; a boundary decision can
differ only when a cumulative mass lands within rounding of ``top_p``):

* ``sampling_probs_ref``: torch ops, one descending sort per row gives both the k-th value and
  the top-p prefix; no host synchronisation.
* ``_sampling_probs_kernel`` (Triton): one program per row, no sort. The k-th largest value is
  found by bisection on the order-preserving integer image of the fp32 values (exact, <= 32
  passes over the row, stops early when the count hits k exactly); the top-p threshold by
  bisection on the bits of ``exp(x - max)`` (fp32 >= 0, so the bits are ordered), <= 30 passes
  over the row that was written once into the output buffer. Passes are skipped per row when
  the filter is off, so plain temperature sampling is three passes.

Which one ``sampling_probs`` uses on CUDA is set by ``DEFAULT_IMPL`` from the GPU benchmark
(``bench/bench_kernels.py``; see docs/kernels.md).
"""

from __future__ import annotations

import torch

from ._triton_utils import check_tensor, lazy_jit, tl, use_triton

__all__ = ["sampling_probs", "sampling_probs_ref", "GREEDY_EPS", "DEFAULT_IMPL"]

GREEDY_EPS = 1e-5
# chosen from measurements on an H100 (docs/kernels.md): the Triton kernel was faster in every
# case measured, 128k vocab, 64 and 384 rows (1.2x with top-k + top-p on 64 rows, 29x with
# temperature only on 384 rows; bench/results/kernels_h100.json)
DEFAULT_IMPL = "triton"

_LOGIT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def sampling_probs_ref(
    logits: torch.Tensor,  # [rows, vocab] any float dtype
    temperature: torch.Tensor,  # [rows] fp32
    top_k: torch.Tensor,  # [rows] int32 (<= 0 or >= vocab: off)
    top_p: torch.Tensor,  # [rows] fp32 (>= 1: off)
    min_p: torch.Tensor,  # [rows] fp32 (<= 0: off)
) -> torch.Tensor:  # [rows, vocab] fp32
    """Torch-ops implementation (also the reference)."""
    rows, V = logits.shape
    dev = logits.device
    raw = logits.float()
    temp = temperature.float()
    greedy = temp <= GREEDY_EPS
    t = torch.where(greedy, torch.ones_like(temp), temp)
    x = torch.where(greedy[:, None], raw, raw / t[:, None])
    m = x.max(dim=1, keepdim=True).values
    e = torch.exp(x - m)  # [rows, V]; p = e / sum(e)

    sorted_x = torch.sort(x, dim=1, descending=True).values
    k = top_k.to(device=dev, dtype=torch.int64)
    k_on = (k > 0) & (k < V) & ~greedy
    k_idx = torch.where(k_on, k, torch.full_like(k, V)) - 1
    kth = sorted_x.gather(1, k_idx[:, None])  # [rows, 1]
    mp = min_p.to(device=dev, dtype=torch.float32)
    mp = torch.where(greedy, torch.zeros_like(mp), mp.clamp(max=1.0))
    keep = (x >= kth) & (e >= mp[:, None])
    # survivors of top-k / min-p are a prefix of the sorted order (both are value thresholds)
    sorted_e = torch.exp(sorted_x - m)
    sorted_keep = (sorted_x >= kth) & (sorted_e >= mp[:, None])
    sorted_e = torch.where(sorted_keep, sorted_e, torch.zeros_like(sorted_e))
    z1 = sorted_e.sum(dim=1, keepdim=True)
    sorted_p = sorted_e / z1
    c_excl = torch.cumsum(sorted_p, dim=1) - sorted_p
    tp = top_p.to(device=dev, dtype=torch.float32)
    p_on = (tp < 1.0) & ~greedy
    n_keep = ((c_excl < tp[:, None]) & sorted_keep).sum(dim=1).clamp(min=1)
    n_keep = torch.where(p_on, n_keep, torch.full_like(n_keep, V))
    tau = sorted_x.gather(1, (n_keep - 1)[:, None])
    keep = keep & (x >= tau)
    ek = torch.where(keep, e, torch.zeros_like(e))
    return ek / ek.sum(dim=1, keepdim=True)


if tl is not None:

    @lazy_jit
    def _sampling_probs_kernel(
        logits_ptr,  # [rows, V] any float dtype
        temp_ptr,  # [rows] fp32
        topk_ptr,  # [rows] int32
        topp_ptr,  # [rows] fp32
        minp_ptr,  # [rows] fp32
        out_ptr,  # [rows, V] fp32 (also the scratch for exp(x - max))
        V,
        stride_l,
        stride_o,
        GREEDY_EPS_C: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        r = tl.program_id(0).to(tl.int64)
        lrow = logits_ptr + r * stride_l
        orow = out_ptr + r * stride_o
        temp = tl.load(temp_ptr + r)
        greedy = temp <= GREEDY_EPS_C
        t = tl.where(greedy, 1.0, temp)
        k = tl.load(topk_ptr + r)
        k_on = (k > 0) & (k < V) & (greedy == 0)
        top_p = tl.load(topp_ptr + r)
        p_on = (top_p < 1.0) & (greedy == 0)
        min_p = tl.where(greedy, 0.0, tl.minimum(tl.load(minp_ptr + r), 1.0))

        # pass: max of x
        m = tl.full([], float("-inf"), tl.float32)
        for b in range(0, V, BLOCK):
            offs = b + tl.arange(0, BLOCK)
            x = tl.load(lrow + offs, mask=offs < V, other=float("-inf")).to(tl.float32) / t
            m = tl.maximum(m, tl.max(x, axis=0))

        # top-k: largest key K with count(key >= K) >= k (key = ordered int image of x)
        lo = tl.full([], -2147483648, tl.int64)
        if k_on:
            hi = tl.full([], 2147483647, tl.int64)
            done = lo > hi  # False
            while (lo < hi) & (done == 0):
                mid = lo + (hi - lo + 1) // 2
                cnt = tl.zeros([], tl.int32)
                for b in range(0, V, BLOCK):
                    offs = b + tl.arange(0, BLOCK)
                    x = tl.load(lrow + offs, mask=offs < V, other=0.0).to(tl.float32) / t
                    bits = x.to(tl.int32, bitcast=True)
                    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
                    cnt += tl.sum(((key >= mid) & (offs < V)).to(tl.int32), axis=0)
                ge = cnt >= k
                done = cnt == k  # {key >= mid} is exactly the top-k set
                lo = tl.where(ge, mid, lo)
                hi = tl.where(ge, hi, mid - 1)

        # pass: e = exp(x - m) for survivors of top-k / min-p, into out; z1 = their mass
        z1 = tl.zeros([], tl.float32)
        for b in range(0, V, BLOCK):
            offs = b + tl.arange(0, BLOCK)
            msk = offs < V
            x = tl.load(lrow + offs, mask=msk, other=0.0).to(tl.float32) / t
            bits = x.to(tl.int32, bitcast=True)
            key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
            e = tl.exp(x - m)
            keep = (key >= lo) & (e >= min_p) & msk
            e = tl.where(keep, e, 0.0)
            z1 += tl.sum(e, axis=0)
            tl.store(orow + offs, e, mask=msk)

        # top-p: largest tau (fp32 bits, e >= 0) with mass(e >= tau) >= top_p * z1
        tau = tl.zeros([], tl.int32)
        z2 = z1
        if p_on:
            need = top_p * z1
            plo = tl.zeros([], tl.int32)
            phi = tl.full([], 0x3F800000, tl.int32)  # bits of 1.0 = max e
            while plo < phi:
                pmid = plo + (phi - plo + 1) // 2
                mass = tl.zeros([], tl.float32)
                for b in range(0, V, BLOCK):
                    offs = b + tl.arange(0, BLOCK)
                    e = tl.load(orow + offs, mask=offs < V, other=0.0)
                    ebits = e.to(tl.int32, bitcast=True)
                    mass += tl.sum(tl.where(ebits >= pmid, e, 0.0), axis=0)
                ok = mass >= need
                plo = tl.where(ok, pmid, plo)
                phi = tl.where(ok, phi, pmid - 1)
                z2 = tl.where(ok, mass, z2)
            tau = plo

        # pass: normalise
        inv = 1.0 / z2
        for b in range(0, V, BLOCK):
            offs = b + tl.arange(0, BLOCK)
            msk = offs < V
            e = tl.load(orow + offs, mask=msk, other=0.0)
            ebits = e.to(tl.int32, bitcast=True)
            tl.store(orow + offs, tl.where(ebits >= tau, e, 0.0) * inv, mask=msk)


def _check_sampling_args(logits, temperature, top_k, top_p, min_p) -> None:
    check_tensor("logits", logits, ndim=2, dtypes=_LOGIT_DTYPES, last_contiguous=True)
    rows = logits.shape[0]
    dev = logits.device
    check_tensor("temperature", temperature, shape=(rows,), dtypes=(torch.float32,), device=dev)
    check_tensor("top_k", top_k, shape=(rows,), dtypes=(torch.int32, torch.int64), device=dev)
    check_tensor("top_p", top_p, shape=(rows,), dtypes=(torch.float32,), device=dev)
    check_tensor("min_p", min_p, shape=(rows,), dtypes=(torch.float32,), device=dev)


def _sampling_probs_triton(logits, temperature, top_k, top_p, min_p) -> torch.Tensor:
    rows, V = logits.shape
    out = torch.empty((rows, V), dtype=torch.float32, device=logits.device)
    if rows == 0 or V == 0:
        return out
    block = 4096 if V >= 4096 else max(16, 1 << (V - 1).bit_length())
    _sampling_probs_kernel[(rows,)](
        logits if logits.dtype != torch.float64 else logits.float(),
        temperature,
        top_k.to(torch.int32),
        top_p,
        min_p,
        out,
        V,
        logits.stride(0) if logits.dtype != torch.float64 else V,
        out.stride(0),
        GREEDY_EPS_C=GREEDY_EPS,
        BLOCK=block,
        num_warps=8 if block >= 4096 else 4,
    )
    return out


def sampling_probs(
    logits: torch.Tensor,  # [rows, vocab] any float dtype
    temperature: torch.Tensor,  # [rows] fp32
    top_k: torch.Tensor,  # [rows] int32
    top_p: torch.Tensor,  # [rows] fp32
    min_p: torch.Tensor,  # [rows] fp32
    *,
    impl: str | None = None,
    force_triton: bool = False,
) -> torch.Tensor:  # [rows, vocab] fp32
    """Probabilities to sample from, after temperature / top-k / top-p / min-p (module doc).

    ``impl`` = ``"torch"`` or ``"triton"`` overrides ``DEFAULT_IMPL`` on CUDA;
    ``force_triton`` runs the Triton kernel (under ``TRITON_INTERPRET=1`` on CPU for tests).
    """
    _check_sampling_args(logits, temperature, top_k, top_p, min_p)
    if impl not in (None, "torch", "triton"):
        raise ValueError(f"impl must be None, 'torch' or 'triton', got {impl!r}")
    tensors = [logits, temperature, top_k, top_p, min_p]
    if force_triton:
        use_triton(tensors, True)  # raises when the kernel cannot run
        return _sampling_probs_triton(logits, temperature, top_k, top_p, min_p)
    want = impl or DEFAULT_IMPL
    if want == "triton" and use_triton(tensors, False):
        return _sampling_probs_triton(logits, temperature, top_k, top_p, min_p)
    return sampling_probs_ref(logits, temperature, top_k, top_p, min_p)
