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
  context still fill the GPU.
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
    pdl_launch,
    tl,
    use_triton,
)

__all__ = [
    "TREE_MAX_ROWS", "paged_attention", "paged_attention_ref", "choose_launch_config",
]

# a tree step's rows per sequence: one int64 of visibility bits per row (tree_bits)
TREE_MAX_ROWS = 64
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_LOG2E = 1.4426950408889634
# Split-K target, programs per multiprocessor for (decode tiles, multi-token tiles), and the
# K/V prefetch default. From the H100 sweep in bench/bench_kernels.py (docs/kernels.md): the best
# split counts put ~3 decode programs (64-token chunks, 2 stages) or ~2 verification programs
# (128-token chunks, 3 stages: more shared memory each) on every SM; prefetching the next chunk
# into registers was never faster there (up to 2x slower with 128-token chunks).
_PROGRAMS_PER_SM = (3, 2)
# decode tiles that already fill every SM run unsplit over block tables of at most this many
# tokens (choose_launch_config: measured there)
_UNSPLIT_MAX_CONTEXT = 512
_PREFETCH_DEFAULT = False
# program order: the KV heads of one (tile, split) as neighbours (they read the same cache
# blocks at about the same time) instead of the tiles of one KV head. Measured on the H100:
# within 0.5% either way (bench/results/kernels_h100_order_sweep.json), so off.
_HEADS_FIRST_DEFAULT = False
# the block-table entries of a program's next K/V chunk loaded one iteration ahead (a register
# carried over the loop), so that the K/V loads do not wait on an index load of their own
# iteration: Triton's pipeliner then double-buffers K/V from 3 stages instead of 5. H100
# (docs/kernels.md): 1-4% faster back to back (graphN), no faster in the
# 8B engine's decode and verification graphs (bench/attention_engine_ab.py), so off
_BT_AHEAD_DEFAULT = False
# Tried and removed: a split merge fused into the attention kernel (the last split program of a
# tile merges, found with a per-tile atomic counter; no merge launch) and an all-heads decode
# kernel (one token, all KV heads per program, whole cache blocks per load), both added in commit
# 85b5ed1. Measured on an H100 on 2026-11-23 (bench_kernels.py, CUDA-graph replay, Llama-3-8B
# heads, bf16) as default / fused merge / decode kernel [decode kernel + fused merge, range over
# split counts and tiles]: batch 1 decode, 8k context 27.6 / 28.0 / 29.9 [44.9-72.7] us, 32k
# 66.2 / 67.7 / 69.1 [86-147] us; batch 8 decode, 8k 109.7 / 109.4 / 117.5 [115.6-220] us, 32k
# 373.6 / 373.2 / 383.7 [382-764] us; batch 1 k+1 = 6 verification, 8k: fused merge 30.9 -> 37.7
# us. Nothing gained more than ~1%, so both were removed.


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
    tree_bits: torch.Tensor | None = None,  # [num_tokens] int64: in-step rows each row may see
) -> torch.Tensor:
    """Plain torch reference (fp32 math, one sequence at a time). Also the CPU path.
    ``tree_bits``: the tree mask of :func:`paged_attention` (on top of the causal mask)."""
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
        if tree_bits is not None and q_len > TREE_MAX_ROWS:
            raise ValueError(f"sequence {s} has {q_len} query rows in a tree step; tree_bits "
                             f"covers at most {TREE_MAX_ROWS} (one int64 per row)")
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
        if tree_bits is not None:  # in-step key j (position ctx - q_len + j): bit j of the row
            jj = (kpos - (ctx - q_len)).clamp(0, 63)  # [ctx]
            bit = (tree_bits[q0:q1].long()[:, None] >> jj[None, :]) & 1  # [q_len, ctx]
            allowed &= (kpos[None, :] < ctx - q_len) | (bit != 0)
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

    # batch size, split count and block-table width vary from call to call on the eager paths
    # (prefill, a proposer's catch-up): not specialised, so that e.g. a table 16 blocks wide (a
    # context of 241-256 tokens) does not compile a variant of its own mid-run
    @lazy_jit(do_not_specialize=("num_seqs", "num_splits", "stride_bt"))
    def _paged_attn_kernel(
        q_ptr,  # [num_tokens, num_heads, head_dim]
        k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
        block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
        context_lens_ptr,  # [num_seqs] int32
        qsl_ptr,  # [num_seqs + 1] int32
        out_ptr,  # [num_tokens, num_heads, head_dim]; written when not SPLIT
        part_out_ptr,  # [num_tokens, num_heads, num_splits, head_dim] fp32; when SPLIT
        part_lse_ptr,  # [num_tokens, num_heads, num_splits] fp32 (log2 domain); when SPLIT
        tree_bits_ptr,  # [num_tokens] int64 in-step visibility bits; read when TREE
        qk_scale,  # fp32: softmax scale * log2(e)
        num_seqs,
        num_splits,
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
        SPLIT_CHUNKS: tl.constexpr,  # > 0: split i covers chunks [i, i + 1) * SPLIT_CHUNKS
        IEEE_DOT: tl.constexpr,  # fp32 inputs: exact fp32 dots instead of tf32
        UPCAST_DOT: tl.constexpr,  # interpreter + bf16: numpy has no bf16 dot, upcast operands
        PREFETCH: tl.constexpr,  # load chunk i+1 while computing chunk i
        HEADS_FIRST: tl.constexpr,  # grid (num_kv_heads, tiles, splits) instead of (tiles, ...)
        BT_AHEAD: tl.constexpr,  # block-table entries of chunk i+1 loaded in iteration i
        GDC: tl.constexpr,  # launched with PDL (programmatic dependent launch)
        TREE: tl.constexpr,  # tree_bits masks the in-step keys (tree verification)
    ):
        if GDC:  # launched with PDL: everything here reads what the previous kernel wrote
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
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
            if SPLIT_CHUNKS > 0:  # fixed absolute ranges (batch-invariant launches)
                chunks_per_split = n_chunks * 0 + SPLIT_CHUNKS
            else:
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
            if TREE:  # [BLOCK_M] int64: bit i = may see in-step row i of its sequence
                row_bits = tl.load(tree_bits_ptr + tok, mask=row_valid, other=0).to(tl.int64)

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
            if BT_AHEAD:  # the first chunk's block-table entries; later ones a chunk ahead
                offs_b = kv_lo + tl.arange(0, BLOCK_N)
                phys_b = tl.load(bt_row + offs_b // BLOCK_SIZE, mask=offs_b < kv_hi, other=0)
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
                    if BT_AHEAD:  # this chunk's entries came with the last iteration's
                        phys = phys_b.to(tl.int64)
                        offs_b = offs_n + BLOCK_N
                        phys_b = tl.load(
                            bt_row + offs_b // BLOCK_SIZE, mask=offs_b < kv_hi, other=0
                        )
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
                if TREE:  # keys before the step stay visible; in-step key i needs bit i
                    step_i = tl.minimum(tl.maximum(offs_n - prefix, 0), 63).to(tl.int64)
                    bit = (row_bits[:, None] >> step_i[None, :]) & 1  # [BLOCK_M, BLOCK_N]
                    allowed = allowed & ((offs_n[None, :] < prefix) | (bit != 0))
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
                prow = (tok * stride_ot + head * stride_oh) * num_splits + split  # [BLOCK_M]
                tl.store(
                    part_out_ptr + prow[:, None] * HEAD_DIM + d[None, :],
                    o,
                    mask=row_valid[:, None],
                )
                lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), -float("inf"))
                tl.store(part_lse_ptr + prow, lse, mask=row_valid)
            else:
                tl.store(
                    out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                    o.to(out_ptr.dtype.element_ty),
                    mask=row_valid[:, None],
                )

    @lazy_jit(do_not_specialize=("num_seqs", "num_splits"))
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
        GDC: tl.constexpr,  # launched with PDL (programmatic dependent launch)
        TRIGGER_FIRST: tl.constexpr,  # with GDC: let the next kernel launch before the wait
    ):
        if GDC:  # launched with PDL: everything here reads what the previous kernel wrote
            if TRIGGER_FIRST:
                tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
            if not TRIGGER_FIRST:
                tl.extra.cuda.gdc_launch_dependents()
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


# --------------------------------------------------------------------------------------------
# Launch configuration and launcher
# --------------------------------------------------------------------------------------------
def choose_launch_config(
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
    split_tokens: int | None = None,
) -> dict:
    """Pick tile sizes and the number of KV splits from shapes only (no device reads).
    ``split_tokens``: a batch-invariant launch (``_invariant_config``)."""
    group = num_heads // num_kv_heads
    if split_tokens is not None:
        return _invariant_config(num_tokens, num_seqs, group, head_dim, dtype, num_splits,
                                 split_tokens)
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
        # about _PROGRAMS_PER_SM[multi-token] programs per SM (one full wave), at least one
        # chunk of cached tokens per split, at most 64 splits. A program walks its chunks one
        # after another at ~1.8 us each (H100, 1 split at 8k: 225 us for 128 chunks), so at
        # short contexts (a few hundred tokens, the first steps of every request) the split
        # count, not the bandwidth, sets the time; the earlier floor of 256 tokens per split
        # left batch-1 decode at a 448-token table with 2 splits of 4 chunks
        target = _PROGRAMS_PER_SM[block_q > 1] * sm_count
        want = max(1, round(target / programs))
        if block_q == 1 and programs >= sm_count and max_context <= _UNSPLIT_MAX_CONTEXT:
            # decode tiles that fill every SM over a short table (at most 8 chunks a walk) run
            # unsplit: the merge costs more than the shorter walk saves (H200 pair, 8B TP 2,
            # batch 64, 256 programs, 320-token tables: 2 splits -> 1, 16,068 -> 16,473-16,543
            # tok/s). Longer tables keep 2 splits: 75 / 252 us a layer against 84 / 314
            # unsplit at 2k / 8k tokens of context (bench/results/attention_fewsplits_h200.json)
            want = 1
        cap = max(1, min(64, cdiv(max_context, block_n)))
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
        bt_ahead=_BT_AHEAD_DEFAULT,
    )


def _invariant_config(num_tokens: int, num_seqs: int, group: int, head_dim: int,
                      dtype: torch.dtype, num_splits: int | None, split_tokens: int) -> dict:
    """The launch of batch-invariant steps (``EngineConfig.batch_invariant``,
    models/batch_invariant.py): one tile shape (64 rows: ``64 // group`` query tokens of a
    sequence), chunk size, warp and stage count for every step, and ``num_splits`` splits of
    ``split_tokens`` KV positions each at fixed absolute ranges (split i: positions
    ``[i, i + 1) * split_tokens``; ranges past a row's position hold no key for it and merge as
    exact zeros). A query row's arithmetic then depends on its own sequence's cache alone: not on
    the batch, the other rows of its sequence's step (decode or k+1 verification), the block
    table width or CUDA-graph padding. The caller keeps ``num_splits`` fixed (the merge's
    reduction depends on it)."""
    if not num_splits or num_splits < 1:
        raise ValueError(f"a batch-invariant attention launch needs a fixed num_splits >= 1, got "
                         f"{num_splits}")
    half = dtype != torch.float32
    block_n = 64 if head_dim <= 64 or (head_dim <= 128 and half) else 32
    if split_tokens < block_n or split_tokens % block_n:
        raise ValueError(f"split_tokens={split_tokens}: a batch-invariant split must be a "
                         f"positive multiple of the {block_n}-token chunk; use a multiple of 128")
    block_q = max(1, 64 // next_pow2(group))
    block_m = max(16, next_pow2(block_q * group))
    return dict(
        block_q=block_q,
        block_m=block_m,
        block_n=block_n,
        num_warps=8 if block_m >= 128 else 4,
        num_stages=2,
        num_tiles=num_tokens if block_q == 1 else num_tokens // block_q + num_seqs,
        num_splits=int(num_splits),
        split_chunks=split_tokens // block_n,
        prefetch=False,
        heads_first=False,
        bt_ahead=False,
    )


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
    split_tokens: int | None = None,
    tree_bits: torch.Tensor | None = None,
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
        split_tokens=split_tokens,
    )
    if overrides:
        cfg.update(overrides)
    splits = cfg["num_splits"]
    split = splits > 1
    if split:
        part_out = torch.empty(
            (num_tokens, num_heads, splits, head_dim), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            (num_tokens, num_heads, splits), dtype=torch.float32, device=q.device
        )
        # partial buffers are indexed as dense [num_tokens, num_heads, splits, ...] below
        stride_ot, stride_oh = num_heads, 1
    else:
        part_out = out
        part_lse = out
        stride_ot, stride_oh = out.stride(0), out.stride(1)
    # grid dims 1 and 2 are limited to 65535: tiles go first when there are more of them
    heads_first = bool(cfg["heads_first"]) and cfg["num_tiles"] <= 65535
    if heads_first:
        grid = (num_kv_heads, cfg["num_tiles"], splits)
    else:
        grid = (cfg["num_tiles"], num_kv_heads, splits)
    pdl = pdl_launch(q.device)
    _paged_attn_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        query_start_loc,
        out,
        part_out,
        part_lse,
        tree_bits if tree_bits is not None else query_start_loc,  # not read without TREE
        float(scale) * _LOG2E,
        num_seqs,
        splits,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        stride_ot,
        stride_oh,
        GROUP=num_heads // num_kv_heads,
        BLOCK_Q=cfg["block_q"],
        BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"],
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        SPLIT=split,
        SPLIT_CHUNKS=int(cfg.get("split_chunks", 0)),
        IEEE_DOT=q.dtype == torch.float32,
        UPCAST_DOT=interpret_mode() and q.dtype == torch.bfloat16,
        PREFETCH=bool(cfg["prefetch"]),
        HEADS_FIRST=heads_first,
        BT_AHEAD=bool(cfg["bt_ahead"]) and not cfg["prefetch"],
        TREE=tree_bits is not None,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **pdl,
    )
    if split:
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
            **pdl,
            TRIGGER_FIRST=num_tokens == 1,  # o_proj: a one-row GEMV
        )
    return out


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
    split_tokens: int | None = None,
    force_triton: bool = False,
    tree_bits: torch.Tensor | None = None,  # [num_tokens] int64
) -> torch.Tensor:
    """Causal attention of a flat batch of query tokens over a paged KV cache.

    Covers prefill (``q_len`` = prompt length), decode (``q_len == 1``) and speculative
    verification (``q_len = k + 1``) in one call; ``q_len`` may be 0 for a sequence. GQA: query
    head ``h`` uses KV head ``h // (num_heads // num_kv_heads)``. Returns ``out`` (allocated when
    not given) in q's dtype. Rows of query tokens at index ``>= query_start_loc[-1]`` (padding)
    are not written.

    ``max_query_len`` is only a tiling hint (pass it when known; it is never read from the
    device). ``num_splits`` overrides the split-K heuristic (benchmarks). ``split_tokens`` (with
    a fixed ``num_splits``) makes the launch batch-invariant (``_invariant_config``: a row's
    output bit for bit independent of the rest of the step). ``force_triton`` runs the Triton
    kernel under ``TRITON_INTERPRET=1`` on CPU tensors (tests).

    ``tree_bits`` (tree verification, docs/kernels.md "Tree attention"): one int64 per query
    row; bit ``i`` set = the row may attend to in-step row ``i`` of its own sequence (the key at
    position ``context_lens[s] - q_len + i``). Keys before the step's first row are always
    visible, and the causal mask still applies (a tree's ancestors precede their descendants, so
    it never removes an allowed key). A chain's bits ``(1 << (i + 1)) - 1`` give the causal
    result bit for bit. At most ``TREE_MAX_ROWS`` query rows per sequence. Absent: no cost (the
    kernel's ``TREE`` flag is a compile-time constant).
    """
    triton_path = use_triton(
        [q, k_cache, v_cache, block_tables, context_lens, query_start_loc], force_triton
    )
    _check_attention_args(
        q, k_cache, v_cache, block_tables, context_lens, query_start_loc, out, triton_path
    )
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale must be finite, got {scale}")
    if tree_bits is not None:
        check_tensor("tree_bits", tree_bits, shape=(q.shape[0],), dtypes=(torch.int64,),
                     device=q.device)
        if tree_bits.stride(0) != 1:
            raise ValueError("tree_bits must be contiguous; pass tree_bits.contiguous()")
        if max_query_len is not None and max_query_len > TREE_MAX_ROWS:
            raise ValueError(f"max_query_len={max_query_len}: a tree step covers at most "
                             f"{TREE_MAX_ROWS} query rows per sequence (one int64 of tree_bits "
                             f"per row); split the tree or verify it as chains")
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
            split_tokens=split_tokens,
            tree_bits=tree_bits,
        )
    return paged_attention_ref(
        q, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, out, tree_bits
    )
