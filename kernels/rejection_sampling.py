"""Lossless speculative verification (rejection sampling) and inverse-CDF sampling.

Algorithm: Leviathan et al. 2023 (arXiv:2211.17192), Chen et al. 2023 (arXiv:2302.01318).

Inputs of :func:`rejection_sample` (``T`` = total drafts, ``B`` = requests, ``V`` = vocab):

* ``draft_token_ids [T]`` int64, the drafts of all requests concatenated.
* ``num_draft_tokens [B]`` int32, ``k_i`` per request (0 allowed).
* ``draft_probs [T, V]`` fp32, or ``None`` for point-mass drafts (``q`` = one-hot).
* ``target_probs [T + B, V]`` fp32: request after request, its ``k_i`` draft positions then one
  bonus position.
* ``is_greedy [B]`` bool, ``uniform_accept [T]`` fp32 and ``uniform_sample [B]`` fp32 in [0, 1).

Rules (both implementations, bit for bit):

* Greedy request: accept draft ``j`` while it equals ``argmax`` of its target row (lowest index
  on ties); the next token is the argmax at the first mismatch, else the bonus row's argmax.
* Random request: accept ``x`` at position ``j`` iff ``p(x) > 0`` and ``u * q(x) <= p(x)``
  (that is ``u <= min(1, p(x)/q(x))`` without a division, ``q(x) = 1`` for point-mass drafts).
  At the first rejection the next token is sampled from ``max(p - q, 0)``; if that residual has
  no mass, from ``p``. If all drafts are accepted it is sampled from the bonus row.
* Sampling by inverse CDF with integer weights: ``w_i = int64(min(r_i, 1) * 2**40)`` (exact in
  fp32, so both implementations see the same weights), ``S = sum(w)``,
  ``thr = min(int64(floor(float64(u) * float64(S))), S - 1)``; the token is the first index whose
  cumulative weight exceeds ``thr``. Integer sums do not depend on summation order, which is
  what makes the Triton kernel and the torch reference agree exactly. Entries below ``2**-40``
  get weight 0 (never sampled); a row whose total weight is 0 yields its argmax.

Output: ``output_token_ids [B, max_k + 1]`` int64 padded with -1, ``num_output [B]`` int32
(= accepted + 1).

Triton path (no host synchronisation; ``max_num_draft_tokens`` should be passed when
``num_draft_tokens`` lives on the GPU, otherwise one ``.item()`` is needed to size the output):

1. ``_row_argmax_partial_kernel`` grid ``(B, max_k + 1, n_chunks)``: per-chunk max/argmax of the
   target rows of greedy requests (random requests exit at once).
2. ``_verify_kernel`` grid ``(B,)``: gathers ``p(x)``, ``q(x)`` (or merges the argmax partials),
   finds the first rejection, writes the accepted drafts / padding / greedy tokens, and records
   which row (and which residual) random requests must sample from.
3. ``_cdf_partial_kernel`` grid ``(rows, n_chunks)``: per-chunk integer weight sums of the
   residual and of ``p`` plus the chunk max/argmax of ``p`` (fallback), one pass over the row.
4. ``_cdf_select_kernel`` grid ``(rows,)``: chooses residual or ``p``, finds the chunk holding
   ``thr`` from the chunk sums and scans only that chunk.

Only the one sampled row per random request gets a full-vocab pass (plus the draft row for the
residual); greedy requests need the argmax of each of their rows.
"""

from __future__ import annotations

import torch

from ._triton_utils import cdiv, check_tensor, lazy_jit, next_pow2, tl, use_triton

__all__ = [
    "rejection_sample",
    "rejection_sample_ref",
    "sample_from_probs",
    "sample_from_probs_ref",
    "QUANT_SCALE",
]

QUANT_SCALE = 2.0**40  # weight of probability 1.0 in the integer inverse CDF


# --------------------------------------------------------------------------------------------
# Reference (vectorised torch; also the CPU path)
# --------------------------------------------------------------------------------------------
def _quantize(x: torch.Tensor) -> torch.Tensor:
    """[rows, V] fp32 >= 0 -> int64 weights (exact: power-of-two scale, truncation)."""
    return (x.clamp(max=1.0) * QUANT_SCALE).to(torch.int64)


def _inverse_cdf(w: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, V] int64, u [rows] fp32 -> (index [rows] int64, total [rows] int64)."""
    total = w.sum(dim=1)
    thr = torch.floor(u.double() * total.double()).to(torch.int64)
    thr = torch.minimum(thr, total - 1)
    cum = torch.cumsum(w, dim=1)
    idx = (cum <= thr[:, None]).sum(dim=1)
    return idx.clamp(max=w.shape[1] - 1), total


def sample_from_probs_ref(
    probs: torch.Tensor,  # [rows, vocab] fp32
    uniform: torch.Tensor,  # [rows] fp32 in [0, 1)
) -> torch.Tensor:  # [rows] int64
    p = probs.float()
    idx, total = _inverse_cdf(_quantize(p.clamp(min=0.0)), uniform.float())
    return torch.where(total > 0, idx, p.argmax(dim=1))


def _resolve_max_k(num_draft_tokens: torch.Tensor, max_num_draft_tokens: int | None) -> int:
    if max_num_draft_tokens is not None:
        return int(max_num_draft_tokens)
    if num_draft_tokens.numel() == 0:
        return 0
    # one host read; pass max_num_draft_tokens to avoid it when the tensor is on the GPU
    return int(num_draft_tokens.max().item())


def rejection_sample_ref(
    draft_token_ids: torch.Tensor,  # [total_draft] int64
    num_draft_tokens: torch.Tensor,  # [batch] int32
    draft_probs: torch.Tensor | None,  # [total_draft, vocab] fp32 or None (point mass)
    target_probs: torch.Tensor,  # [total_draft + batch, vocab] fp32
    is_greedy: torch.Tensor,  # [batch] bool
    uniform_accept: torch.Tensor,  # [total_draft] fp32
    uniform_sample: torch.Tensor,  # [batch] fp32
    max_num_draft_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectorised torch reference. Returns (output_token_ids [B, max_k+1], num_output [B])."""
    dev = target_probs.device
    B = num_draft_tokens.shape[0]
    T = draft_token_ids.shape[0]
    max_k = _resolve_max_k(num_draft_tokens, max_num_draft_tokens)
    nd = num_draft_tokens.to(device=dev, dtype=torch.int64)
    if B > 0 and int(nd.max()) > max_k:
        raise ValueError("max_num_draft_tokens is smaller than max(num_draft_tokens)")
    cu_end = torch.cumsum(nd, 0)
    cu_start = cu_end - nd
    ar_b = torch.arange(B, device=dev)
    req = torch.repeat_interleave(ar_b, nd, output_size=T)  # [T] request of each draft
    ar_t = torch.arange(T, device=dev)
    pos = ar_t - cu_start[req]  # [T] position within the request
    trow = ar_t + req  # [T] target row of each draft
    x = draft_token_ids.to(torch.int64)
    tp = target_probs.float()
    p_x = tp[trow, x]
    q_x = draft_probs.float()[ar_t, x] if draft_probs is not None else torch.ones_like(p_x)
    t_argmax = tp.argmax(dim=1)  # [T + B]
    greedy = is_greedy.to(torch.bool)
    ok = torch.where(
        greedy[req], x == t_argmax[trow], (p_x > 0) & (uniform_accept.float() * q_x <= p_x)
    )
    acc_pad = torch.ones((B, max_k), dtype=torch.int64, device=dev)
    acc_pad[req, pos] = ok.to(torch.int64)
    n_acc = torch.minimum(torch.cumprod(acc_pad, dim=1).sum(dim=1), nd)  # [B]

    out = torch.full((B, max_k + 1), -1, dtype=torch.int64, device=dev)
    keep = pos < n_acc[req]
    out[req[keep], pos[keep]] = x[keep]

    final_row = cu_start + ar_b + n_acc  # [B] target row sampled from
    if greedy.device.type == "cpu" and bool(greedy.all()):
        # every row greedy: the bonus / correction token is the argmax, nothing to sample (this
        # skips the inverse CDF over [B, V]; checked on the CPU only, where it is no device read)
        out[ar_b, n_acc] = t_argmax[final_row]
        return out, (n_acc + 1).to(torch.int32)
    rejected = n_acc < nd
    p_row = tp[final_row]  # [B, V]
    if T > 0:
        rej_draft = (cu_start + n_acc).clamp(max=T - 1)
        if draft_probs is not None:
            q_row = draft_probs.float()[rej_draft]
        else:
            q_row = torch.zeros_like(p_row)
            q_row[ar_b, x[rej_draft]] = 1.0
        residual = torch.clamp(p_row - q_row, min=0.0)
    else:
        residual = p_row
    w_res = _quantize(residual)
    w_p = _quantize(p_row.clamp(min=0.0))
    s_res = w_res.sum(dim=1)
    use_res = rejected & (s_res > 0)
    w = torch.where(use_res[:, None], w_res, w_p)
    idx, total = _inverse_cdf(w, uniform_sample.float())
    sampled = torch.where(total > 0, idx, p_row.argmax(dim=1))
    final_tok = torch.where(greedy, t_argmax[final_row], sampled)
    out[ar_b, n_acc] = final_tok
    return out, (n_acc + 1).to(torch.int32)


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------
if tl is not None:

    @lazy_jit
    def _row_argmax_partial_kernel(
        tprob_ptr,  # [T + B, V] fp32
        nd_ptr,  # [B] int32 drafts per request
        cu_end_ptr,  # [B] int64 cumulative drafts (inclusive)
        greedy_ptr,  # [B] uint8
        val_ptr,  # [T + B, NC] fp32 chunk max
        idx_ptr,  # [T + B, NC] int64 chunk argmax
        V,
        stride_t,
        NC,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        i = tl.program_id(0)
        j = tl.program_id(1)
        c = tl.program_id(2)
        nd = tl.load(nd_ptr + i)
        g = tl.load(greedy_ptr + i)
        if (g != 0) & (j <= nd):
            row = tl.load(cu_end_ptr + i) - nd + i + j  # int64
            base = tprob_ptr + row * stride_t
            best_v = tl.full([], float("-inf"), tl.float32)
            best_i = tl.full([], 0, tl.int64) + c * CHUNK
            for b in range(0, CHUNK, BLOCK):
                offs = c * CHUNK + b + tl.arange(0, BLOCK)
                vals = tl.load(base + offs, mask=offs < V, other=float("-inf"))
                bv, bi = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
                better = bv > best_v
                best_i = tl.where(better, (c * CHUNK + b + bi).to(tl.int64), best_i)
                best_v = tl.where(better, bv, best_v)
            tl.store(val_ptr + row * NC + c, best_v)
            tl.store(idx_ptr + row * NC + c, best_i)

    @lazy_jit
    def _verify_kernel(
        draft_ptr,  # [T] int64
        nd_ptr,  # [B] int32
        cu_end_ptr,  # [B] int64
        dprob_ptr,  # [T, V] fp32 (HAS_Q_PROBS)
        tprob_ptr,  # [T + B, V] fp32
        greedy_ptr,  # [B] uint8
        ua_ptr,  # [T] fp32
        amax_val_ptr,  # [T + B, NC] fp32
        amax_idx_ptr,  # [T + B, NC] int64
        out_ptr,  # [B, W] int64
        num_out_ptr,  # [B] int32
        sample_row_ptr,  # [B] int64: target row to sample from, -1 for greedy requests
        resid_ptr,  # [B] int64: draft row (HAS_Q_PROBS) / draft token (point mass), -1 = none
        stride_d,
        stride_t,
        stride_out,
        W,  # max_k + 1
        NC,
        K_P2: tl.constexpr,  # next_pow2(W)
        NC_P2: tl.constexpr,  # next_pow2(NC)
        HAS_Q_PROBS: tl.constexpr,
    ):
        i = tl.program_id(0)
        nd = tl.load(nd_ptr + i)
        start = tl.load(cu_end_ptr + i) - nd  # first draft index (int64)
        g = tl.load(greedy_ptr + i) != 0
        offs = tl.arange(0, K_P2)
        is_draft = offs < nd
        x = tl.load(draft_ptr + start + offs, mask=is_draft, other=0)
        trow = start + i + offs  # target rows (int64)
        if g:
            cc = tl.arange(0, NC_P2)
            amask = (offs <= nd)[:, None] & (cc < NC)[None, :]
            pv = tl.load(
                amax_val_ptr + trow[:, None] * NC + cc[None, :], mask=amask, other=float("-inf")
            )
            pi = tl.load(amax_idx_ptr + trow[:, None] * NC + cc[None, :], mask=amask, other=0)
            mv = tl.max(pv, axis=1)
            big = tl.full([K_P2, NC_P2], 9223372036854775807, tl.int64)
            amax = tl.min(tl.where(pv == mv[:, None], pi, big), axis=1)  # [K_P2]
            ok = x == amax
        else:
            p_x = tl.load(tprob_ptr + trow * stride_t + x, mask=is_draft, other=0.0)
            if HAS_Q_PROBS:
                q_x = tl.load(dprob_ptr + (start + offs) * stride_d + x, mask=is_draft, other=1.0)
            else:
                q_x = tl.full([K_P2], 1.0, tl.float32)
            u = tl.load(ua_ptr + start + offs, mask=is_draft, other=0.0)
            ok = (p_x > 0.0) & (u * q_x <= p_x)
            amax = tl.zeros([K_P2], tl.int64)
        n_acc = tl.min(tl.where(is_draft & (ok == 0), offs, nd), axis=0)
        final_g = tl.sum(tl.where(offs == n_acc, amax, 0), axis=0)
        vals = tl.where(offs < n_acc, x, -1)
        if g:
            vals = tl.where(offs == n_acc, final_g, vals)
        tl.store(out_ptr + i * stride_out + offs, vals, mask=offs < W)
        tl.store(num_out_ptr + i, (n_acc + 1).to(tl.int32))
        rejected = n_acc < nd
        if HAS_Q_PROBS:
            resid = tl.where(rejected, start + n_acc, -1)
        else:
            x_rej = tl.sum(tl.where(offs == n_acc, x, 0), axis=0)
            resid = tl.where(rejected, x_rej, -1)
        tl.store(sample_row_ptr + i, tl.where(g, -1, start + i + n_acc))
        tl.store(resid_ptr + i, tl.where(g, -1, resid).to(tl.int64))

    @lazy_jit
    def _cdf_partial_kernel(
        p_ptr,  # [num_p_rows, V] fp32
        q_ptr,  # [num_q_rows, V] fp32 (RESID_MODE == 1)
        row_ptr,  # [R] int64 p row per sampled row, -1 = skip (unless ROW_IDENTITY)
        resid_ptr,  # [R] int64 q row (mode 1) / draft token (mode 2), -1 = sample p
        sres_ptr,  # [R, NC] int64 chunk weight sum of the residual
        sp_ptr,  # [R, NC] int64 chunk weight sum of p
        pmax_ptr,  # [R, NC] fp32 chunk max of p
        pidx_ptr,  # [R, NC] int64 chunk argmax of p
        V,
        stride_p,
        stride_q,
        NC,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
        ROW_IDENTITY: tl.constexpr,
        RESID_MODE: tl.constexpr,  # 0: none, 1: q probs, 2: point-mass q
    ):
        r = tl.program_id(0)
        c = tl.program_id(1)
        if ROW_IDENTITY:
            prow = r.to(tl.int64)
        else:
            prow = tl.load(row_ptr + r)
        if prow >= 0:
            if RESID_MODE != 0:
                resid = tl.load(resid_ptr + r)
            else:
                resid = -1
            base = p_ptr + prow * stride_p
            s_res = tl.zeros([], tl.int64)
            s_p = tl.zeros([], tl.int64)
            best_v = tl.full([], float("-inf"), tl.float32)
            best_i = tl.full([], 0, tl.int64) + c * CHUNK
            for b in range(0, CHUNK, BLOCK):
                offs = c * CHUNK + b + tl.arange(0, BLOCK)
                m = offs < V
                p = tl.load(base + offs, mask=m, other=0.0)
                p0 = tl.maximum(p, 0.0)
                s_p += tl.sum((tl.minimum(p0, 1.0) * 1099511627776.0).to(tl.int64), axis=0)
                if RESID_MODE == 1:
                    q = tl.load(
                        q_ptr + tl.maximum(resid, 0) * stride_q + offs,
                        mask=m & ((offs * 0 + resid) >= 0),
                        other=0.0,
                    )
                    rr = tl.maximum(p - q, 0.0)
                    s_res += tl.sum((tl.minimum(rr, 1.0) * 1099511627776.0).to(tl.int64), axis=0)
                if RESID_MODE == 2:
                    q = tl.where(offs == resid, 1.0, 0.0)
                    rr = tl.maximum(p - q, 0.0)
                    s_res += tl.sum((tl.minimum(rr, 1.0) * 1099511627776.0).to(tl.int64), axis=0)
                pm = tl.where(m, p, float("-inf"))
                bv, bi = tl.max(pm, axis=0, return_indices=True, return_indices_tie_break_left=True)
                better = bv > best_v
                best_i = tl.where(better, (c * CHUNK + b + bi).to(tl.int64), best_i)
                best_v = tl.where(better, bv, best_v)
            tl.store(sres_ptr + r * NC + c, s_res)
            tl.store(sp_ptr + r * NC + c, s_p)
            tl.store(pmax_ptr + r * NC + c, best_v)
            tl.store(pidx_ptr + r * NC + c, best_i)

    @lazy_jit
    def _cdf_select_kernel(
        p_ptr,  # [num_p_rows, V] fp32
        q_ptr,  # [num_q_rows, V] fp32 (RESID_MODE == 1)
        row_ptr,  # [R] int64 p row, -1 = skip (unless ROW_IDENTITY)
        resid_ptr,  # [R] int64 (RESID_MODE != 0)
        sres_ptr,  # [R, NC] int64
        sp_ptr,  # [R, NC] int64
        pmax_ptr,  # [R, NC] fp32
        pidx_ptr,  # [R, NC] int64
        u_ptr,  # [R] fp32 uniforms
        out_ptr,  # SCATTER: [R, W] int64 (at column num_out[r] - 1); else [R] int64
        num_out_ptr,  # [R] int32 (SCATTER)
        V,
        stride_p,
        stride_q,
        stride_out,
        NC,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
        NC_P2: tl.constexpr,
        ROW_IDENTITY: tl.constexpr,
        RESID_MODE: tl.constexpr,
        SCATTER: tl.constexpr,
    ):
        r = tl.program_id(0)
        if ROW_IDENTITY:
            prow = r.to(tl.int64)
        else:
            prow = tl.load(row_ptr + r)
        if prow >= 0:
            if RESID_MODE != 0:
                resid = tl.load(resid_ptr + r)
            else:
                resid = -1
            cc = tl.arange(0, NC_P2)
            cm = cc < NC
            part_p = tl.load(sp_ptr + r * NC + cc, mask=cm, other=0)
            part_r = tl.load(sres_ptr + r * NC + cc, mask=cm, other=0)
            tot_p = tl.sum(part_p, axis=0)
            tot_r = tl.sum(part_r, axis=0)
            use_res = (resid >= 0) & (tot_r > 0)
            part = tl.where(use_res, part_r, part_p)
            total = tl.where(use_res, tot_r, tot_p)
            u = tl.load(u_ptr + r)
            thr = (u.to(tl.float64) * total.to(tl.float64)).to(tl.int64)  # >= 0: trunc = floor
            thr = tl.minimum(thr, total - 1)
            cum = tl.cumsum(part, axis=0)
            chunk = tl.sum(((cum <= thr) & cm).to(tl.int32), axis=0)  # chunk holding thr
            chunk = tl.minimum(chunk, NC - 1)
            running = tl.sum(tl.where(cc < chunk, part, 0), axis=0)  # weight before the chunk
            base = p_ptr + prow * stride_p
            result = tl.full([], -1, tl.int64)
            for b in range(0, CHUNK, BLOCK):
                offs = chunk * CHUNK + b + tl.arange(0, BLOCK)
                m = offs < V
                p = tl.load(base + offs, mask=m, other=0.0)
                if RESID_MODE == 1:
                    q = tl.load(
                        q_ptr + tl.maximum(resid, 0) * stride_q + offs,
                        mask=m & ((offs * 0 + use_res.to(tl.int32)) != 0),
                        other=0.0,
                    )
                    p = tl.where(use_res, tl.maximum(p - q, 0.0), tl.maximum(p, 0.0))
                elif RESID_MODE == 2:
                    q = tl.where(offs == resid, 1.0, 0.0)
                    p = tl.where(use_res, tl.maximum(p - q, 0.0), tl.maximum(p, 0.0))
                else:
                    p = tl.maximum(p, 0.0)
                w = (tl.minimum(p, 1.0) * 1099511627776.0).to(tl.int64)
                w = tl.where(m, w, 0)
                cw = running + tl.cumsum(w, axis=0)
                n_le = tl.sum(((cw <= thr) & m).to(tl.int32), axis=0)
                n_valid = tl.sum(m.to(tl.int32), axis=0)
                hit = (result < 0) & (n_le < n_valid)
                result = tl.where(hit, (chunk * CHUNK + b + n_le).to(tl.int64), result)
                running += tl.sum(w, axis=0)
            # zero total weight: argmax of p (lowest index on ties)
            pm = tl.load(pmax_ptr + r * NC + cc, mask=cm, other=float("-inf"))
            pi = tl.load(pidx_ptr + r * NC + cc, mask=cm, other=0)
            mv = tl.max(pm, axis=0)
            big = tl.full([NC_P2], 9223372036854775807, tl.int64)
            amax = tl.min(tl.where(pm == mv, pi, big), axis=0)
            tok = tl.where(total > 0, result, amax)
            if SCATTER:
                col = tl.load(num_out_ptr + r) - 1
                tl.store(out_ptr + r * stride_out + col, tok)
            else:
                tl.store(out_ptr + r, tok)


def _chunking(V: int) -> tuple[int, int, int]:
    """(CHUNK, BLOCK, NC): ~16 chunks per row, 1-8k elements per chunk."""
    chunk = max(16, min(8192, next_pow2(cdiv(V, 16))))
    block = min(chunk, 1024)
    return chunk, block, cdiv(V, chunk)


def _launch_cdf(
    p, q, rows, resid, uniform, out, num_out, resid_mode, row_identity, scatter, R
) -> None:
    V = p.shape[1]
    chunk, block, nc = _chunking(V)
    dev = p.device
    sres = torch.empty((R, nc), dtype=torch.int64, device=dev)
    sp = torch.empty((R, nc), dtype=torch.int64, device=dev)
    pmax = torch.empty((R, nc), dtype=torch.float32, device=dev)
    pidx = torch.empty((R, nc), dtype=torch.int64, device=dev)
    q_arg = q if q is not None else p
    stride_q = q.stride(0) if q is not None else 0
    rows_arg = rows if rows is not None else sp
    resid_arg = resid if resid is not None else sp
    num_warps = 4 if block >= 1024 else 2
    _cdf_partial_kernel[(R, nc)](
        p,
        q_arg,
        rows_arg,
        resid_arg,
        sres,
        sp,
        pmax,
        pidx,
        V,
        p.stride(0),
        stride_q,
        nc,
        CHUNK=chunk,
        BLOCK=block,
        ROW_IDENTITY=row_identity,
        RESID_MODE=resid_mode,
        num_warps=num_warps,
    )
    _cdf_select_kernel[(R,)](
        p,
        q_arg,
        rows_arg,
        resid_arg,
        sres,
        sp,
        pmax,
        pidx,
        uniform,
        out,
        num_out if num_out is not None else sp,
        V,
        p.stride(0),
        stride_q,
        out.stride(0),
        nc,
        CHUNK=chunk,
        BLOCK=block,
        NC_P2=next_pow2(nc),
        ROW_IDENTITY=row_identity,
        RESID_MODE=resid_mode,
        SCATTER=scatter,
        num_warps=num_warps,
    )


def _rejection_sample_triton(
    draft_token_ids,
    num_draft_tokens,
    draft_probs,
    target_probs,
    is_greedy,
    uniform_accept,
    uniform_sample,
    max_k,
):
    dev = target_probs.device
    B = num_draft_tokens.shape[0]
    T = draft_token_ids.shape[0]
    V = target_probs.shape[1]
    W = max_k + 1
    out = torch.empty((B, W), dtype=torch.int64, device=dev)
    num_out = torch.empty((B,), dtype=torch.int32, device=dev)
    if B == 0:
        return out, num_out
    nd = num_draft_tokens.contiguous()
    cu_end = torch.cumsum(nd, 0)  # int64, on device, no sync
    greedy = is_greedy.contiguous().view(torch.uint8)
    chunk, block, nc = _chunking(V)
    amax_val = torch.empty((T + B, nc), dtype=torch.float32, device=dev)
    amax_idx = torch.empty((T + B, nc), dtype=torch.int64, device=dev)
    _row_argmax_partial_kernel[(B, W, nc)](
        target_probs,
        nd,
        cu_end,
        greedy,
        amax_val,
        amax_idx,
        V,
        target_probs.stride(0),
        nc,
        CHUNK=chunk,
        BLOCK=block,
        num_warps=4 if block >= 1024 else 2,
    )
    sample_row = torch.empty((B,), dtype=torch.int64, device=dev)
    resid = torch.empty((B,), dtype=torch.int64, device=dev)
    has_q = draft_probs is not None
    dprob = draft_probs if has_q else target_probs
    ua = uniform_accept if T > 0 else uniform_sample  # never read when T == 0
    draft = draft_token_ids if T > 0 else sample_row
    _verify_kernel[(B,)](
        draft,
        nd,
        cu_end,
        dprob,
        target_probs,
        greedy,
        ua,
        amax_val,
        amax_idx,
        out,
        num_out,
        sample_row,
        resid,
        dprob.stride(0),
        target_probs.stride(0),
        out.stride(0),
        W,
        nc,
        K_P2=next_pow2(W),
        NC_P2=next_pow2(nc),
        HAS_Q_PROBS=has_q,
        num_warps=1 if W <= 32 else 4,
    )
    _launch_cdf(
        target_probs,
        draft_probs,
        sample_row,
        resid,
        uniform_sample,
        out,
        num_out,
        resid_mode=1 if has_q else 2,
        row_identity=False,
        scatter=True,
        R=B,
    )
    return out, num_out


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def _check_rejection_args(
    draft_token_ids,
    num_draft_tokens,
    draft_probs,
    target_probs,
    is_greedy,
    uniform_accept,
    uniform_sample,
) -> None:
    check_tensor("target_probs", target_probs, ndim=2, dtypes=(torch.float32,), last_contiguous=True)
    dev = target_probs.device
    V = target_probs.shape[1]
    check_tensor("draft_token_ids", draft_token_ids, ndim=1, dtypes=(torch.int64,), device=dev)
    T = draft_token_ids.shape[0]
    check_tensor("num_draft_tokens", num_draft_tokens, ndim=1, dtypes=(torch.int32, torch.int64))
    if num_draft_tokens.device != dev and num_draft_tokens.device.type != "cpu":
        raise ValueError(
            f"num_draft_tokens must be on {dev} (or the CPU), got {num_draft_tokens.device}"
        )
    B = num_draft_tokens.shape[0]
    if target_probs.shape[0] != T + B:
        raise ValueError(
            f"target_probs must have total_draft + batch = {T + B} rows, got {target_probs.shape[0]}"
        )
    if draft_probs is not None:
        check_tensor(
            "draft_probs",
            draft_probs,
            shape=(T, V),
            dtypes=(torch.float32,),
            device=dev,
            last_contiguous=True,
        )
    check_tensor("is_greedy", is_greedy, shape=(B,), dtypes=(torch.bool,), device=dev)
    check_tensor("uniform_accept", uniform_accept, shape=(T,), dtypes=(torch.float32,), device=dev)
    check_tensor("uniform_sample", uniform_sample, shape=(B,), dtypes=(torch.float32,), device=dev)


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [total_draft] int64
    num_draft_tokens: torch.Tensor,  # [batch] int32
    draft_probs: torch.Tensor | None,  # [total_draft, vocab] fp32, None = point-mass drafts
    target_probs: torch.Tensor,  # [total_draft + batch, vocab] fp32
    is_greedy: torch.Tensor,  # [batch] bool
    uniform_accept: torch.Tensor,  # [total_draft] fp32 in [0, 1)
    uniform_sample: torch.Tensor,  # [batch] fp32 in [0, 1)
    *,
    max_num_draft_tokens: int | None = None,
    force_triton: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify drafts losslessly. Returns ``(output_token_ids [batch, max_k + 1] int64 padded
    with -1, num_output [batch] int32)``; see the module docstring for the exact rules.

    ``max_num_draft_tokens`` (``max_k``, must be >= every ``num_draft_tokens``) sizes the
    output without reading the device; when omitted it is read from ``num_draft_tokens`` (free
    if that tensor is on the CPU, one synchronisation if it is on the GPU).
    """
    _check_rejection_args(
        draft_token_ids,
        num_draft_tokens,
        draft_probs,
        target_probs,
        is_greedy,
        uniform_accept,
        uniform_sample,
    )
    max_k = _resolve_max_k(num_draft_tokens, max_num_draft_tokens)
    if max_k < 0:
        raise ValueError(f"max_num_draft_tokens must be >= 0, got {max_k}")
    num_draft_tokens = num_draft_tokens.to(device=target_probs.device, non_blocking=True)
    tensors = [draft_token_ids, draft_probs, target_probs, is_greedy, uniform_accept]
    if use_triton(tensors + [uniform_sample, num_draft_tokens], force_triton):
        return _rejection_sample_triton(
            draft_token_ids,
            num_draft_tokens,
            draft_probs,
            target_probs,
            is_greedy,
            uniform_accept,
            uniform_sample,
            max_k,
        )
    return rejection_sample_ref(
        draft_token_ids,
        num_draft_tokens,
        draft_probs,
        target_probs,
        is_greedy,
        uniform_accept,
        uniform_sample,
        max_num_draft_tokens=max_k,
    )


def sample_from_probs(
    probs: torch.Tensor,  # [rows, vocab] fp32
    uniform: torch.Tensor,  # [rows] fp32 in [0, 1)
    *,
    force_triton: bool = False,
) -> torch.Tensor:  # [rows] int64
    """Inverse-CDF sampling of one token per row (same integer-weight rule as above)."""
    check_tensor("probs", probs, ndim=2, dtypes=(torch.float32,), last_contiguous=True)
    R = probs.shape[0]
    check_tensor("uniform", uniform, shape=(R,), dtypes=(torch.float32,), device=probs.device)
    if not use_triton([probs, uniform], force_triton):
        return sample_from_probs_ref(probs, uniform)
    out = torch.empty((R,), dtype=torch.int64, device=probs.device)
    if R == 0:
        return out
    _launch_cdf(
        probs,
        None,
        None,
        None,
        uniform,
        out,
        None,
        resid_mode=0,
        row_identity=True,
        scatter=False,
        R=R,
    )
    return out
