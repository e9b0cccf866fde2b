"""Paged attention over a block-table KV cache: prefill, decode and speculative verification.

One kernel serves all three cases. The queries of a step are a flat batch ``q[num_tokens,
num_heads, head_dim]``; sequence ``s`` owns query tokens ``query_start_loc[s] :
query_start_loc[s+1]`` (``q_len`` of them, possibly 0) and has ``context_lens[s]`` tokens in the
cache *including* this step's tokens, whose K/V were already stored. Query token ``j`` of ``s``
sits at absolute position ``context_lens[s] - q_len + j`` and attends to every cache position
``<=`` its own (causal).

Triton kernel design
--------------------
* Work item = (query tile, kv head, kv split). A query tile is ``BLOCK_Q`` consecutive query
  tokens of one sequence times all ``GROUP = num_heads // num_kv_heads`` query heads that share
  one KV head, flattened to ``BLOCK_M`` rows (row ``r`` = token ``r // GROUP``, head
  ``r % GROUP``). Each K/V block is thus read once per KV head, not once per query head (GQA).
* Query tiles are enumerated without any host synchronisation: sequence ``s`` owns tiles
  ``qsl[s] // BLOCK_Q + s ...`` (``qsl[s]`` when ``BLOCK_Q == 1``); the total is bounded by
  ``num_tokens // BLOCK_Q + num_seqs`` and each program finds its sequence by binary search
  over ``query_start_loc``. Tiles past the end of their sequence exit at once.
* Split-K (flash-decoding): the causal KV range of a tile is cut into ``num_splits`` pieces of
  whole ``BLOCK_N`` chunks. With more than one split, each piece writes a normalised partial
  output plus its log-sum-exp and a second kernel merges them. The number of splits is picked
  on the host from shapes only (never from tensor contents), so that small batches at long
  context still fill the GPU. Option (``fused_merge``, off by default): no second kernel; each
  split program bumps a per-(tile, KV head) atomic counter after writing its partial, and the
  program that arrives last merges all partials and resets the counter to zero (graph-safe:
  the grid and the counter buffer come from shapes only; the buffer is never allocated during
  a capture, the separate merge kernel is used instead then).
* Option (``decode_kernel``, off by default): decode batches go to ``_paged_decode_kernel``,
  one query token and ALL its heads per program (grid ``(num_tokens, num_splits)``). Each step
  reads BLOCK_N cache positions of every KV head, i.e. whole contiguous cache blocks
  (``[BLOCK_N, num_kv_heads, head_dim]``), instead of 256-byte rows per KV head, and runs
  batched ``[KV head, GROUP (padded to 16), BLOCK_N]`` dots. Exact for any ``q_len`` (one
  program row per query token, causal bound per token), so a wrong hint only costs speed.
* fp32 accumulation and softmax (exp2 with the scale folded in); output in q's dtype.
"""

from __future__ import annotations

import math

import torch

from ._triton_utils import (
    cdiv,
    check_tensor,
    interpret_mode,
    lazy_jit,
    next_pow2,
    num_sms,
    tl,
    use_triton,
)

__all__ = ["paged_attention", "paged_attention_ref", "choose_launch_config"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_LOG2E = 1.4426950408889634
# Split-K target, programs per multiprocessor for (decode tiles, multi-token tiles), and the
# K/V prefetch default. From the H100 sweep in bench/bench_kernels.py (docs/kernels.md): the best
# split counts put ~3 decode programs (64-token chunks, 2 stages) or ~2 verification programs
# (128-token chunks, 3 stages: more shared memory each) on every SM; prefetching the next chunk
# into registers was never faster there (up to 2x slower with 128-token chunks).
_PROGRAMS_PER_SM = (3, 2)
_PREFETCH_DEFAULT = False
# program order: the KV heads of one (tile, split) as neighbours (they read the same cache
# blocks at about the same time) instead of the tiles of one KV head. Measured on the H100:
# within 0.5% either way (bench/results/kernels_h100_order_sweep.json), so off.
_HEADS_FIRST_DEFAULT = False
# Split merge inside the attention kernel (the last split program of a tile merges, found with
# a per-tile atomic counter) instead of a second launch. Needs the per-device counter buffer
# (_counters): calls must not run concurrently on two streams of one device.
# Decode tiles (one query token) through _paged_decode_kernel: all KV heads of a token per
# program, whole cache blocks per load; programs per SM for its split count, chunk, warps,
# stages below.
# Both are OFF: written and tested under the Triton interpreter only, not yet compiled or timed
# on a GPU (no device was lent in the session that wrote them). `bench/bench_kernels.py
# --decode-sweep` measures them against the defaults; switch them on only where that wins.
_FUSED_MERGE_DEFAULT = False
_DECODE_KERNEL_DEFAULT = False
_DECODE_PROGRAMS_PER_SM = 2
_DECODE_BLOCK_N = 16
_DECODE_NUM_WARPS = 8
_DECODE_NUM_STAGES = 2
_DECODE_MAX_SPLITS = 128


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------
def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
) -> torch.Tensor:
    """Plain torch reference (fp32 math, one sequence at a time). Also the CPU path."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    qsl = query_start_loc.tolist()
    ctxs = context_lens.tolist()
    for s in range(len(ctxs)):
        q0, q1 = qsl[s], qsl[s + 1]
        q_len = q1 - q0
        if q_len <= 0:
            continue
        ctx = ctxs[s]
        n_blocks = cdiv(ctx, block_size)
        blocks = block_tables[s, :n_blocks].to(torch.int64)
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx].float()  # [ctx, Hkv, D]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx].float()
        k = k.repeat_interleave(group, dim=1)  # [ctx, H, D]
        v = v.repeat_interleave(group, dim=1)
        qs = q[q0:q1].float()  # [q_len, H, D]
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale  # [H, q_len, ctx]
        qpos = torch.arange(q_len, device=q.device) + (ctx - q_len)
        kpos = torch.arange(ctx, device=q.device)
        allowed = kpos[None, :] <= qpos[:, None]  # [q_len, ctx]
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        probs = torch.nan_to_num(probs, nan=0.0)  # rows with no key (invalid ctx) -> 0
        o = torch.einsum("hqk,khd->qhd", probs, v)
        out[q0:q1] = o.to(out.dtype)
    return out


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------
if tl is not None:

    @lazy_jit
    def _paged_attn_kernel(
        q_ptr,  # [num_tokens, num_heads, head_dim]
        k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
        block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
        context_lens_ptr,  # [num_seqs] int32
        qsl_ptr,  # [num_seqs + 1] int32
        out_ptr,  # [num_tokens, num_heads, head_dim]; written when not SPLIT or FUSED_MERGE
        part_out_ptr,  # [num_tokens, num_heads, num_splits, head_dim] fp32; when SPLIT
        part_lse_ptr,  # [num_tokens, num_heads, num_splits] fp32 (log2 domain); when SPLIT
        counter_ptr,  # [num_tiles * num_kv_heads] int32, all zero on entry; when FUSED_MERGE
        qk_scale,  # fp32: softmax scale * log2(e)
        num_seqs,
        num_splits,
        num_heads,
        num_kv_heads,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_bt,
        stride_ot,
        stride_oh,
        GROUP: tl.constexpr,  # num_heads // num_kv_heads
        BLOCK_Q: tl.constexpr,  # query tokens per tile
        BLOCK_M: tl.constexpr,  # rows per tile: next_pow2(BLOCK_Q * GROUP), >= 16
        BLOCK_N: tl.constexpr,  # kv positions per inner iteration
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,  # tokens per cache block
        SPLIT: tl.constexpr,  # num_splits > 1
        FUSED_MERGE: tl.constexpr,  # SPLIT: the last split program of a tile merges (counter)
        MERGE_M: tl.constexpr,  # FUSED_MERGE: next_pow2(BLOCK_Q * GROUP) rows to merge
        SPLITS_P2: tl.constexpr,  # FUSED_MERGE: next_pow2(num_splits)
        MERGE_SP: tl.constexpr,  # FUSED_MERGE: splits merged per step
        IEEE_DOT: tl.constexpr,  # fp32 inputs: exact fp32 dots instead of tf32
        UPCAST_DOT: tl.constexpr,  # interpreter + bf16: numpy has no bf16 dot, upcast operands
        PREFETCH: tl.constexpr,  # load chunk i+1 while computing chunk i
        HEADS_FIRST: tl.constexpr,  # grid (num_kv_heads, tiles, splits) instead of (tiles, ...)
    ):
        if HEADS_FIRST:  # neighbouring programs: the KV heads of one tile (same cache blocks)
            kvh = tl.program_id(0)
            tile = tl.program_id(1)
        else:
            tile = tl.program_id(0)
            kvh = tl.program_id(1)
        split = tl.program_id(2)

        # ---- which sequence owns this tile: largest s with tile_start(s) <= tile ----
        lo = 0
        hi = num_seqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            ts_mid = tl.load(qsl_ptr + mid)
            if BLOCK_Q > 1:
                ts_mid = ts_mid // BLOCK_Q + mid
            if ts_mid <= tile:
                lo = mid
            else:
                hi = mid - 1
        seq = lo
        q_start = tl.load(qsl_ptr + seq)
        q_len = tl.load(qsl_ptr + seq + 1) - q_start
        if BLOCK_Q > 1:
            tile_start = q_start // BLOCK_Q + seq
        else:
            tile_start = q_start
        q_tile = (tile - tile_start) * BLOCK_Q  # first query index (within seq) of this tile

        if q_tile < q_len:
            ctx = tl.load(context_lens_ptr + seq)
            prefix = ctx - q_len  # cached tokens before the first query token
            kv_end = prefix + tl.minimum(q_tile + BLOCK_Q, q_len)  # exclusive causal bound
            n_chunks = tl.cdiv(tl.maximum(kv_end, 0), BLOCK_N)
            chunks_per_split = tl.cdiv(n_chunks, num_splits)
            kv_lo = split * chunks_per_split * BLOCK_N
            kv_hi = tl.minimum(kv_lo + chunks_per_split * BLOCK_N, kv_end)

            rows = tl.arange(0, BLOCK_M)
            j = rows // GROUP
            h = rows % GROUP
            row_valid = (j < BLOCK_Q) & (q_tile + j < q_len)
            tok = (q_start + q_tile + j).to(tl.int64)
            head = kvh * GROUP + h
            pos = prefix + q_tile + j  # absolute position of the row's query token
            d = tl.arange(0, HEAD_DIM)

            q = tl.load(
                q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_valid[:, None],
                other=0.0,
            )  # [BLOCK_M, HEAD_DIM]
            if UPCAST_DOT:
                q = q.to(tl.float32)

            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
            bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
            k_head = k_cache_ptr + kvh.to(tl.int64) * stride_kh
            v_head = v_cache_ptr + kvh.to(tl.int64) * stride_vh

            # K/V tiles of the current chunk. PREFETCH: the next chunk's tiles are loaded before
            # the current one is used (register double buffering: two chunks of loads in flight
            # per program, which is what small batches at long context need); otherwise K and V
            # of the chunk are both issued at the top of the iteration.
            if PREFETCH:
                offs_n = kv_lo + tl.arange(0, BLOCK_N)
                n_valid = offs_n < kv_hi
                phys = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
                within = offs_n % BLOCK_SIZE
                k = tl.load(
                    k_head + (phys * stride_kb + within * stride_ks)[:, None] + d[None, :],
                    mask=n_valid[:, None],
                    other=0.0,
                )  # [BLOCK_N, HEAD_DIM]
                v = tl.load(
                    v_head + (phys * stride_vb + within * stride_vs)[:, None] + d[None, :],
                    mask=n_valid[:, None],
                    other=0.0,
                )  # [BLOCK_N, HEAD_DIM]
            for start in range(kv_lo, kv_hi, BLOCK_N):
                offs_n = start + tl.arange(0, BLOCK_N)
                n_valid = offs_n < kv_hi
                if PREFETCH:
                    offs_nx = offs_n + BLOCK_N
                    nx_valid = offs_nx < kv_hi
                    phys_x = tl.load(bt_row + offs_nx // BLOCK_SIZE, mask=nx_valid, other=0).to(
                        tl.int64
                    )
                    within_x = offs_nx % BLOCK_SIZE
                    k_next = tl.load(
                        k_head + (phys_x * stride_kb + within_x * stride_ks)[:, None] + d[None, :],
                        mask=nx_valid[:, None],
                        other=0.0,
                    )  # [BLOCK_N, HEAD_DIM]
                    v_next = tl.load(
                        v_head + (phys_x * stride_vb + within_x * stride_vs)[:, None] + d[None, :],
                        mask=nx_valid[:, None],
                        other=0.0,
                    )  # [BLOCK_N, HEAD_DIM]
                else:
                    phys = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_valid, other=0).to(
                        tl.int64
                    )
                    within = offs_n % BLOCK_SIZE
                    k = tl.load(
                        k_head + (phys * stride_kb + within * stride_ks)[:, None] + d[None, :],
                        mask=n_valid[:, None],
                        other=0.0,
                    )  # [BLOCK_N, HEAD_DIM]
                    v = tl.load(
                        v_head + (phys * stride_vb + within * stride_vs)[:, None] + d[None, :],
                        mask=n_valid[:, None],
                        other=0.0,
                    )  # [BLOCK_N, HEAD_DIM]
                kt = k
                vt = v
                if UPCAST_DOT:
                    kt = kt.to(tl.float32)
                    vt = vt.to(tl.float32)
                if IEEE_DOT:
                    s = tl.dot(q, tl.trans(kt), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(kt))
                s = s * qk_scale  # [BLOCK_M, BLOCK_N], log2 domain
                allowed = n_valid[None, :] & (offs_n[None, :] <= pos[:, None])
                s = tl.where(allowed, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_safe)
                p = tl.exp2(s - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                if IEEE_DOT:
                    pv = tl.dot(p, vt, input_precision="ieee")
                elif UPCAST_DOT:
                    pv = tl.dot(p.to(tl.bfloat16).to(tl.float32), vt)
                else:
                    pv = tl.dot(p.to(vt.dtype), vt)
                acc = acc * alpha[:, None] + pv
                m_i = m_new
                if PREFETCH:
                    k = k_next
                    v = v_next

            has_keys = l_i > 0.0
            o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
            if SPLIT:
                prow = (tok * num_heads + head) * num_splits + split  # [BLOCK_M]
                tl.store(
                    part_out_ptr + prow[:, None] * HEAD_DIM + d[None, :],
                    o,
                    mask=row_valid[:, None],
                )
                lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), -float("inf"))
                tl.store(part_lse_ptr + prow, lse, mask=row_valid)
                if FUSED_MERGE:
                    # Every split program of this (tile, kv head) bumps one counter after its
                    # partial is written (barrier: all threads' stores first; acq_rel at GPU
                    # scope publishes them / makes the others' visible). The program that
                    # sees num_splits - 1 merges all partials and resets the counter to 0.
                    tl.debug_barrier()
                    cidx = tile * num_kv_heads + kvh
                    done = tl.atomic_add(counter_ptr + cidx, 1, sem="acq_rel", scope="gpu")
                    if done == num_splits - 1:
                        mr = tl.arange(0, MERGE_M)
                        mj = mr // GROUP
                        m_valid = (mj < BLOCK_Q) & (q_tile + mj < q_len)
                        mhead = kvh * GROUP + mr % GROUP
                        mtok = (q_start + q_tile + mj).to(tl.int64)
                        pbase = (mtok * num_heads + mhead) * num_splits  # [MERGE_M]
                        sp = tl.arange(0, SPLITS_P2)
                        lse_all = tl.load(
                            part_lse_ptr + pbase[:, None] + sp[None, :],
                            mask=m_valid[:, None] & (sp < num_splits)[None, :],
                            other=-float("inf"),
                            cache_modifier=".cg",
                        )  # [MERGE_M, SPLITS_P2]
                        mx = tl.max(lse_all, axis=1)
                        mx = tl.where(mx == -float("inf"), 0.0, mx)
                        den = tl.sum(tl.exp2(lse_all - mx[:, None]), axis=1)
                        macc = tl.zeros([MERGE_M, HEAD_DIM], tl.float32)
                        for s0 in range(0, num_splits, MERGE_SP):
                            spc = s0 + tl.arange(0, MERGE_SP)
                            pmask = m_valid[:, None] & (spc < num_splits)[None, :]
                            lse_c = tl.load(
                                part_lse_ptr + pbase[:, None] + spc[None, :],
                                mask=pmask,
                                other=-float("inf"),
                                cache_modifier=".cg",
                            )  # [MERGE_M, MERGE_SP]
                            w = tl.exp2(lse_c - mx[:, None])
                            po = tl.load(
                                part_out_ptr
                                + ((pbase[:, None] + spc[None, :]) * HEAD_DIM)[:, :, None]
                                + d[None, None, :],
                                mask=pmask[:, :, None],
                                other=0.0,
                                cache_modifier=".cg",
                            )  # [MERGE_M, MERGE_SP, HEAD_DIM]
                            macc += tl.sum(po * w[:, :, None], axis=1)
                        mo = macc / tl.where(den > 0.0, den, 1.0)[:, None]
                        tl.store(
                            out_ptr
                            + mtok[:, None] * stride_ot
                            + mhead[:, None] * stride_oh
                            + d[None, :],
                            mo.to(out_ptr.dtype.element_ty),
                            mask=m_valid[:, None],
                        )
                        tl.atomic_xchg(counter_ptr + cidx, 0)  # ready for the next launch
            else:
                tl.store(
                    out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                    o.to(out_ptr.dtype.element_ty),
                    mask=row_valid[:, None],
                )

    @lazy_jit
    def _paged_attn_reduce_kernel(
        part_out_ptr,  # [num_tokens, num_heads, num_splits, head_dim] fp32
        part_lse_ptr,  # [num_tokens, num_heads, num_splits] fp32 (log2 domain)
        out_ptr,  # [num_tokens, num_heads, head_dim]
        qsl_ptr,  # [num_seqs + 1] int32 (qsl[num_seqs] = number of real query tokens)
        num_seqs,
        num_heads,
        num_splits,
        stride_ot,
        stride_oh,
        HEAD_DIM: tl.constexpr,
        SPLITS_P2: tl.constexpr,  # next_pow2(num_splits)
    ):
        tok = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        total = tl.load(qsl_ptr + num_seqs)
        if tok < total:
            sp = tl.arange(0, SPLITS_P2)
            d = tl.arange(0, HEAD_DIM)
            base = (tok * num_heads + head) * num_splits  # partials are dense/contiguous
            lse = tl.load(part_lse_ptr + base + sp, mask=sp < num_splits, other=-float("inf"))
            m = tl.max(lse, axis=0)
            m_safe = tl.where(m == -float("inf"), 0.0, m)
            w = tl.exp2(lse - m_safe)  # [SPLITS_P2]; empty splits -> 0
            po = tl.load(
                part_out_ptr + (base + sp)[:, None] * HEAD_DIM + d[None, :],
                mask=(sp < num_splits)[:, None],
                other=0.0,
            )
            den = tl.sum(w, axis=0)
            o = tl.sum(po * w[:, None], axis=0) / tl.where(den > 0.0, den, 1.0)
            tl.store(
                out_ptr + tok * stride_ot + head * stride_oh + d,
                o.to(out_ptr.dtype.element_ty),
            )

    @lazy_jit
    def _paged_decode_kernel(
        q_ptr,  # [num_tokens, num_heads, head_dim]
        k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
        block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
        context_lens_ptr,  # [num_seqs] int32
        qsl_ptr,  # [num_seqs + 1] int32
        out_ptr,  # [num_tokens, num_heads, head_dim]; written when not SPLIT or FUSED_MERGE
        part_out_ptr,  # [num_tokens, num_heads, num_splits, head_dim] fp32; when SPLIT
        part_lse_ptr,  # [num_tokens, num_heads, num_splits] fp32 (log2 domain); when SPLIT
        counter_ptr,  # [num_tokens] int32, all zero on entry; when FUSED_MERGE
        qk_scale,  # fp32: softmax scale * log2(e)
        num_seqs,
        num_splits,
        num_heads,
        num_kv_heads,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_bt,
        stride_ot,
        stride_oh,
        GROUP: tl.constexpr,  # num_heads // num_kv_heads
        KVH_P2: tl.constexpr,  # next_pow2(num_kv_heads)
        GROUP_M: tl.constexpr,  # rows per KV head in the dots: next_pow2(GROUP), >= 16
        HEADS_P2: tl.constexpr,  # next_pow2(num_heads)
        BLOCK_N: tl.constexpr,  # kv positions per inner iteration
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,  # tokens per cache block
        SPLIT: tl.constexpr,  # num_splits > 1
        FUSED_MERGE: tl.constexpr,  # SPLIT: the last split program of a token merges (counter)
        SPLITS_P2: tl.constexpr,  # FUSED_MERGE: next_pow2(num_splits)
        MERGE_SP: tl.constexpr,  # FUSED_MERGE: splits merged per step
        IEEE_DOT: tl.constexpr,
        UPCAST_DOT: tl.constexpr,
    ):
        """One query token, ALL heads per program (decode): each inner step reads the K/V rows
        of every KV head of BLOCK_N positions, i.e. whole contiguous cache blocks, and runs one
        batched (KV head x GROUP_M x BLOCK_N) dot per operand. Grid (num_tokens, num_splits)."""
        tok = tl.program_id(0)
        split = tl.program_id(1)
        lo = 0
        hi = num_seqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if tl.load(qsl_ptr + mid) <= tok:
                lo = mid
            else:
                hi = mid - 1
        seq = lo
        q_start = tl.load(qsl_ptr + seq)
        q_len = tl.load(qsl_ptr + seq + 1) - q_start
        q_idx = tok - q_start
        if q_idx < q_len:
            ctx = tl.load(context_lens_ptr + seq)
            kv_end = ctx - q_len + q_idx + 1  # causal: positions <= the token's own
            n_chunks = tl.cdiv(tl.maximum(kv_end, 0), BLOCK_N)
            chunks_per_split = tl.cdiv(n_chunks, num_splits)
            kv_lo = split * chunks_per_split * BLOCK_N
            kv_hi = tl.minimum(kv_lo + chunks_per_split * BLOCK_N, kv_end)

            hk = tl.arange(0, KVH_P2)[:, None, None]  # [KVH_P2, 1, 1]
            g = tl.arange(0, GROUP_M)[None, :, None]  # [1, GROUP_M, 1]
            dd = tl.arange(0, HEAD_DIM)[None, None, :]  # [1, 1, HEAD_DIM]
            head = hk * GROUP + g  # [KVH_P2, GROUP_M, 1]
            r_valid = (hk < num_kv_heads) & (g < GROUP)
            tok64 = tok.to(tl.int64)
            q = tl.load(
                q_ptr + tok64 * stride_qt + head * stride_qh + dd, mask=r_valid, other=0.0
            )  # [KVH_P2, GROUP_M, HEAD_DIM]
            if UPCAST_DOT:
                q = q.to(tl.float32)
            m_i = tl.full([KVH_P2, GROUP_M], float("-inf"), tl.float32)
            l_i = tl.zeros([KVH_P2, GROUP_M], tl.float32)
            acc = tl.zeros([KVH_P2, GROUP_M, HEAD_DIM], tl.float32)
            bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
            kv_valid = hk < num_kv_heads  # [KVH_P2, 1, 1]
            k_hoff = hk.to(tl.int64) * stride_kh + dd
            v_hoff = hk.to(tl.int64) * stride_vh + dd
            for start in range(kv_lo, kv_hi, BLOCK_N):
                offs_n = start + tl.arange(0, BLOCK_N)
                n_valid = offs_n < kv_hi
                phys = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
                within = offs_n % BLOCK_SIZE
                ld_mask = n_valid[None, :, None] & kv_valid
                k = tl.load(
                    k_cache_ptr + (phys * stride_kb + within * stride_ks)[None, :, None] + k_hoff,
                    mask=ld_mask,
                    other=0.0,
                )  # [KVH_P2, BLOCK_N, HEAD_DIM]
                v = tl.load(
                    v_cache_ptr + (phys * stride_vb + within * stride_vs)[None, :, None] + v_hoff,
                    mask=ld_mask,
                    other=0.0,
                )  # [KVH_P2, BLOCK_N, HEAD_DIM]
                if UPCAST_DOT:
                    k = k.to(tl.float32)
                    v = v.to(tl.float32)
                kt = tl.permute(k, (0, 2, 1))  # [KVH_P2, HEAD_DIM, BLOCK_N]
                if IEEE_DOT:
                    s = tl.dot(q, kt, input_precision="ieee")
                else:
                    s = tl.dot(q, kt)
                s = s * qk_scale  # [KVH_P2, GROUP_M, BLOCK_N], log2 domain
                s = tl.where(n_valid[None, None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=2))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_safe)
                p = tl.exp2(s - m_safe[:, :, None])
                l_i = l_i * alpha + tl.sum(p, axis=2)
                if IEEE_DOT:
                    pv = tl.dot(p, v, input_precision="ieee")
                elif UPCAST_DOT:
                    pv = tl.dot(p.to(tl.bfloat16).to(tl.float32), v)
                else:
                    pv = tl.dot(p.to(v.dtype), v)
                acc = acc * alpha[:, :, None] + pv
                m_i = m_new

            has_keys = l_i > 0.0
            o = acc / tl.where(has_keys, l_i, 1.0)[:, :, None]
            if SPLIT:
                prow = (tok64 * num_heads + head) * num_splits + split  # [KVH_P2, GROUP_M, 1]
                tl.store(part_out_ptr + prow * HEAD_DIM + dd, o, mask=r_valid)
                lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), -float("inf"))
                tl.store(
                    part_lse_ptr + tl.reshape(prow, [KVH_P2, GROUP_M]),
                    lse,
                    mask=tl.reshape(r_valid, [KVH_P2, GROUP_M]),
                )
                if FUSED_MERGE:  # as in _paged_attn_kernel, one counter per query token
                    tl.debug_barrier()
                    done = tl.atomic_add(counter_ptr + tok64, 1, sem="acq_rel", scope="gpu")
                    if done == num_splits - 1:
                        hh = tl.arange(0, HEADS_P2)
                        h_valid = hh < num_heads
                        pbase = (tok64 * num_heads + hh) * num_splits  # [HEADS_P2]
                        d = tl.arange(0, HEAD_DIM)
                        sp = tl.arange(0, SPLITS_P2)
                        lse_all = tl.load(
                            part_lse_ptr + pbase[:, None] + sp[None, :],
                            mask=h_valid[:, None] & (sp < num_splits)[None, :],
                            other=-float("inf"),
                            cache_modifier=".cg",
                        )  # [HEADS_P2, SPLITS_P2]
                        mx = tl.max(lse_all, axis=1)
                        mx = tl.where(mx == -float("inf"), 0.0, mx)
                        den = tl.sum(tl.exp2(lse_all - mx[:, None]), axis=1)
                        macc = tl.zeros([HEADS_P2, HEAD_DIM], tl.float32)
                        for s0 in range(0, num_splits, MERGE_SP):
                            spc = s0 + tl.arange(0, MERGE_SP)
                            pmask = h_valid[:, None] & (spc < num_splits)[None, :]
                            lse_c = tl.load(
                                part_lse_ptr + pbase[:, None] + spc[None, :],
                                mask=pmask,
                                other=-float("inf"),
                                cache_modifier=".cg",
                            )  # [HEADS_P2, MERGE_SP]
                            w = tl.exp2(lse_c - mx[:, None])
                            po = tl.load(
                                part_out_ptr
                                + ((pbase[:, None] + spc[None, :]) * HEAD_DIM)[:, :, None]
                                + d[None, None, :],
                                mask=pmask[:, :, None],
                                other=0.0,
                                cache_modifier=".cg",
                            )  # [HEADS_P2, MERGE_SP, HEAD_DIM]
                            macc += tl.sum(po * w[:, :, None], axis=1)
                        mo = macc / tl.where(den > 0.0, den, 1.0)[:, None]
                        tl.store(
                            out_ptr + tok64 * stride_ot + hh[:, None] * stride_oh + d[None, :],
                            mo.to(out_ptr.dtype.element_ty),
                            mask=h_valid[:, None],
                        )
                        tl.atomic_xchg(counter_ptr + tok64, 0)  # ready for the next launch
            else:
                tl.store(
                    out_ptr + tok64 * stride_ot + head * stride_oh + dd,
                    o.to(out_ptr.dtype.element_ty),
                    mask=r_valid,
                )


# --------------------------------------------------------------------------------------------
# Launch configuration and launcher
# --------------------------------------------------------------------------------------------
def choose_launch_config(**kw) -> dict:
    """Pick the kernel, tile sizes and the number of KV splits from shapes only (no device
    reads): decode batches (``max_query_len == 1``) go to :func:`_paged_decode_kernel`
    (``_DECODE_KERNEL_DEFAULT``), everything else to the tiled kernel."""
    if (
        kw["max_query_len"] <= 1
        and _DECODE_KERNEL_DEFAULT
        and decode_kernel_fits(kw["num_heads"], kw["num_kv_heads"], kw["head_dim"])
    ):
        return choose_decode_config(
            num_tokens=kw["num_tokens"],
            num_heads=kw["num_heads"],
            num_kv_heads=kw["num_kv_heads"],
            max_context=kw["max_context"],
            sm_count=kw["sm_count"],
            num_splits=kw.get("num_splits"),
        )
    return _choose_tiled_config(**kw)


def decode_kernel_fits(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether :func:`_paged_decode_kernel`'s per-program tiles (all heads of a token, padded
    to >= 16 rows per KV head) stay within 8 x 16 x 128 elements."""
    rows = next_pow2(num_kv_heads) * max(16, next_pow2(num_heads // num_kv_heads))
    return rows * head_dim <= 16384


def _choose_tiled_config(
    *,
    num_tokens: int,
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_query_len: int,
    max_context: int,
    dtype: torch.dtype,
    sm_count: int,
    num_splits: int | None = None,
    prefetch: bool | None = None,
) -> dict:
    """Tiles and KV splits of the tiled kernel :func:`_paged_attn_kernel`."""
    group = num_heads // num_kv_heads
    max_rows = 128 if head_dim <= 128 and dtype != torch.float32 else 64
    block_q = 1
    while block_q < max_query_len and 2 * block_q * group <= max_rows:
        block_q *= 2
    block_m = max(16, next_pow2(block_q * group))
    half = dtype != torch.float32
    # Measured on an H100 (bench/bench_kernels.py --sweep, Llama-3-8B heads, bf16): decode tiles
    # prefer 64-token chunks and 2 stages; multi-token (verification / prefill) tiles 128-token
    # chunks, 4 warps, 3 stages (-20% time at batch 32, 8k context, q_len 6 against 64 tokens).
    wide = block_q > 1 and half and block_m <= 64  # 128-row tiles: keep shared memory in bounds
    if head_dim <= 64:
        block_n = 128 if wide else 64
    elif head_dim <= 128:
        block_n = (128 if wide else 64) if half else 32
    else:
        block_n = 32
    num_warps = 8 if block_m >= 128 else 4
    num_stages = (3 if block_q > 1 else 2) if (half and head_dim <= 128) else 2
    num_tiles = num_tokens if block_q == 1 else num_tokens // block_q + num_seqs
    # tiles that can hold query tokens (the rest exit at once): exact for uniform q_len
    real_tiles = min(num_tiles, num_seqs * max(1, cdiv(max_query_len, block_q)))
    if num_splits is None:
        programs = max(1, real_tiles * num_kv_heads)
        # about _PROGRAMS_PER_SM[multi-token] programs per SM (one full wave), at least 256
        # cached tokens per split, at most 64 splits
        target = _PROGRAMS_PER_SM[block_q > 1] * sm_count
        want = max(1, round(target / programs))
        cap = max(1, min(64, cdiv(max_context, 256)))
        num_splits = min(want, cap)
    if prefetch is None:
        prefetch = _PREFETCH_DEFAULT
    return dict(
        block_q=block_q,
        block_m=block_m,
        block_n=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
        num_tiles=num_tiles,
        num_splits=int(num_splits),
        prefetch=bool(prefetch),
        heads_first=_HEADS_FIRST_DEFAULT,
        fused_merge=_FUSED_MERGE_DEFAULT,
        merge_sp=4 if block_q * group > 8 else 8,
        decode_kernel=False,
    )


def choose_decode_config(
    *,
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    max_context: int,
    sm_count: int,
    num_splits: int | None = None,
) -> dict:
    """Launch parameters of :func:`_paged_decode_kernel` (one query token per program row,
    all heads), from shapes only."""
    if num_splits is None:
        target = _DECODE_PROGRAMS_PER_SM * sm_count
        want = max(1, round(target / max(1, num_tokens)))
        cap = max(1, min(_DECODE_MAX_SPLITS, cdiv(max_context, 4 * _DECODE_BLOCK_N)))
        num_splits = min(want, cap)
    return dict(
        block_q=1,
        block_m=max(16, next_pow2(num_heads // num_kv_heads)),
        block_n=_DECODE_BLOCK_N,
        num_warps=_DECODE_NUM_WARPS,
        num_stages=_DECODE_NUM_STAGES,
        num_tiles=num_tokens,
        num_splits=int(num_splits),
        prefetch=False,
        heads_first=False,
        fused_merge=_FUSED_MERGE_DEFAULT,
        merge_sp=4 if num_heads > 16 else 8,
        decode_kernel=True,
    )


# per-device int32 counters for the fused split merge; zero between launches (the merging
# program resets its counter), so one buffer serves every call made on one stream at a time
_COUNTERS: dict = {}


def _counters(device: torch.device, n: int) -> torch.Tensor | None:
    """A zeroed int32 buffer of at least ``n`` entries, or None when one would have to be
    allocated during CUDA-graph capture (its zero fill would not run before the graph does)."""
    key = (device.type, device.index)
    buf = _COUNTERS.get(key)
    if buf is not None and buf.numel() >= n:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    buf = torch.zeros(max(n, 16384), dtype=torch.int32, device=device)
    _COUNTERS[key] = buf
    return buf


def _check_attention_args(
    q, k_cache, v_cache, block_tables, context_lens, query_start_loc, out, triton_path
) -> None:
    check_tensor("q", q, ndim=3, dtypes=_FLOAT_DTYPES, last_contiguous=True)
    dev = q.device
    num_tokens, num_heads, head_dim = q.shape
    check_tensor("k_cache", k_cache, ndim=4, dtypes=(q.dtype,), device=dev, last_contiguous=True)
    nb, bs, hkv, dk = k_cache.shape
    if dk != head_dim:
        raise ValueError(f"k_cache head_dim {dk} != q head_dim {head_dim}")
    check_tensor(
        "v_cache",
        v_cache,
        shape=(nb, bs, hkv, head_dim),
        dtypes=(q.dtype,),
        device=dev,
        last_contiguous=True,
    )
    if hkv == 0 or num_heads % hkv != 0:
        raise ValueError(
            f"q num_heads ({num_heads}) must be a multiple of k_cache num_kv_heads ({hkv})"
        )
    check_tensor("block_tables", block_tables, ndim=2, dtypes=_INDEX_DTYPES, device=dev)
    num_seqs = block_tables.shape[0]
    check_tensor("context_lens", context_lens, shape=(num_seqs,), dtypes=_INDEX_DTYPES, device=dev)
    check_tensor(
        "query_start_loc",
        query_start_loc,
        shape=(num_seqs + 1,),
        dtypes=_INDEX_DTYPES,
        device=dev,
    )
    if out is not None:
        check_tensor(
            "out",
            out,
            shape=tuple(q.shape),
            dtypes=(q.dtype,),
            device=dev,
            last_contiguous=True,
        )
    if triton_path:
        if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
            raise ValueError(
                f"q head_dim must be a power of two in [16, 256] for the Triton kernel, got {head_dim}"
            )
        if bs < 1:
            raise ValueError(f"k_cache block_size must be >= 1, got {bs}")


def _paged_attention_triton(
    q,
    k_cache,
    v_cache,
    block_tables,
    context_lens,
    query_start_loc,
    scale,
    max_query_len,
    out,
    num_splits=None,
    overrides: dict | None = None,
) -> torch.Tensor:
    """Launcher. ``overrides`` replaces entries of :func:`choose_launch_config` (benchmarks)."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = block_tables.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        # shapes only: the mean query length (exact for pure decode / uniform verification)
        max_query_len = cdiv(num_tokens, num_seqs)
    cfg = choose_launch_config(
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_query_len=int(max_query_len),
        max_context=block_tables.shape[1] * block_size,
        dtype=q.dtype,
        sm_count=num_sms(q.device),
        num_splits=num_splits,
    )
    if overrides:
        if "decode_kernel" in overrides and overrides["decode_kernel"] != cfg["decode_kernel"]:
            base = dict(
                num_tokens=num_tokens,
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                max_context=block_tables.shape[1] * block_size,
                sm_count=num_sms(q.device),
                num_splits=num_splits,
            )
            if overrides["decode_kernel"]:
                cfg = choose_decode_config(**base)
            else:
                base.pop("max_context")
                cfg = _choose_tiled_config(
                    **base,
                    num_seqs=num_seqs,
                    head_dim=head_dim,
                    max_query_len=int(max_query_len),
                    max_context=block_tables.shape[1] * block_size,
                    dtype=q.dtype,
                )
        cfg.update(overrides)
    decode = bool(cfg["decode_kernel"])
    if decode and cfg["block_q"] != 1:
        raise ValueError("decode_kernel needs block_q == 1")
    splits = cfg["num_splits"]
    split = splits > 1
    counters = out  # placeholder pointer when not fused
    fused = False
    if split:
        part_out = torch.empty(
            (num_tokens, num_heads, splits, head_dim), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            (num_tokens, num_heads, splits), dtype=torch.float32, device=q.device
        )
        if cfg["fused_merge"]:
            n_cnt = num_tokens if decode else cfg["num_tiles"] * num_kv_heads
            buf = _counters(q.device, n_cnt)
            if buf is not None:
                counters, fused = buf, True
    else:
        part_out = out
        part_lse = out
    # merge tile constexprs only matter when fused: fixed otherwise (no extra compiled variants)
    merge_sp = int(cfg.get("merge_sp", 4)) if fused else 1
    splits_p2 = next_pow2(splits) if fused else 1
    common = (
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        query_start_loc,
        out,
        part_out,
        part_lse,
        counters,
        float(scale) * _LOG2E,
        num_seqs,
        splits,
        num_heads,
        num_kv_heads,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
    )
    if decode:
        _paged_decode_kernel[(num_tokens, splits)](
            *common,
            GROUP=num_heads // num_kv_heads,
            KVH_P2=next_pow2(num_kv_heads),
            GROUP_M=max(16, next_pow2(num_heads // num_kv_heads)),
            HEADS_P2=next_pow2(num_heads),
            BLOCK_N=cfg["block_n"],
            HEAD_DIM=head_dim,
            BLOCK_SIZE=block_size,
            SPLIT=split,
            FUSED_MERGE=fused,
            SPLITS_P2=splits_p2,
            MERGE_SP=merge_sp,
            IEEE_DOT=q.dtype == torch.float32,
            UPCAST_DOT=interpret_mode() and q.dtype == torch.bfloat16,
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        )
        if split and not fused:
            _launch_reduce(part_out, part_lse, out, query_start_loc, num_seqs, splits)
        return out
    # grid dims 1 and 2 are limited to 65535: tiles go first when there are more of them
    heads_first = bool(cfg["heads_first"]) and cfg["num_tiles"] <= 65535
    if heads_first:
        grid = (num_kv_heads, cfg["num_tiles"], splits)
    else:
        grid = (cfg["num_tiles"], num_kv_heads, splits)
    _paged_attn_kernel[grid](
        *common,
        GROUP=num_heads // num_kv_heads,
        BLOCK_Q=cfg["block_q"],
        BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"],
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        SPLIT=split,
        FUSED_MERGE=fused,
        MERGE_M=next_pow2(cfg["block_q"] * (num_heads // num_kv_heads)) if fused else 1,
        SPLITS_P2=splits_p2,
        MERGE_SP=merge_sp,
        IEEE_DOT=q.dtype == torch.float32,
        UPCAST_DOT=interpret_mode() and q.dtype == torch.bfloat16,
        PREFETCH=bool(cfg["prefetch"]),
        HEADS_FIRST=heads_first,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    if split and not fused:
        _launch_reduce(part_out, part_lse, out, query_start_loc, num_seqs, splits)
    return out


def _launch_reduce(part_out, part_lse, out, query_start_loc, num_seqs, splits) -> None:
    num_tokens, num_heads, head_dim = out.shape
    _paged_attn_reduce_kernel[(num_tokens, num_heads)](
        part_out,
        part_lse,
        out,
        query_start_loc,
        num_seqs,
        num_heads,
        splits,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        SPLITS_P2=next_pow2(splits),
        num_warps=4 if head_dim * next_pow2(splits) >= 4096 else 2,
    )


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,  # [num_seqs] int32 (cache length incl. this step's tokens)
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32 (cumulative query lengths)
    scale: float,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    *,
    num_splits: int | None = None,
    force_triton: bool = False,
) -> torch.Tensor:
    """Causal attention of a flat batch of query tokens over a paged KV cache.

    Covers prefill (``q_len`` = prompt length), decode (``q_len == 1``) and speculative
    verification (``q_len = k + 1``) in one call; ``q_len`` may be 0 for a sequence. GQA: query
    head ``h`` uses KV head ``h // (num_heads // num_kv_heads)``. Returns ``out`` (allocated when
    not given) in q's dtype. Rows of query tokens at index ``>= query_start_loc[-1]`` (padding)
    are not written.

    ``max_query_len`` is only a tiling hint (pass it when known; it is never read from the
    device). ``num_splits`` overrides the split-K heuristic (benchmarks). ``force_triton`` runs
    the Triton kernel under ``TRITON_INTERPRET=1`` on CPU tensors (tests).
    """
    triton_path = use_triton(
        [q, k_cache, v_cache, block_tables, context_lens, query_start_loc], force_triton
    )
    _check_attention_args(
        q, k_cache, v_cache, block_tables, context_lens, query_start_loc, out, triton_path
    )
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale must be finite, got {scale}")
    if triton_path:
        return _paged_attention_triton(
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            query_start_loc,
            scale,
            max_query_len,
            out,
            num_splits,
        )
    return paged_attention_ref(
        q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out
    )
