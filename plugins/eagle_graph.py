"""The whole greedy EAGLE propose as one CUDA graph replay: the catch-up forward over the verified
positions (the target's features in), the gather of each drafting sequence's last row, and the K
greedy draft steps (``_EagleBase._chain``). One graph per (batch bucket Bp, query bucket Q, K),
captured lazily in the strategy's ``GraphCache``.

Inputs live in two static buffers per key, filled before each replay: ``ints`` (int64, which the
graph's first kernel copies from a pinned host vector the host writes: ``pinned_copy``) and ``feats`` ([Bp * Q, F] target features, F = H for EAGLE-1,
3 * target hidden for EAGLE-3). Padding is that of engine/cuda_graph.py: a catch-up of
T <= Bp * Q rows over n <= Bp sequences leaves rows T.. as padding (token 0, position 0, slot -1,
which store_kv skips) and sequences n.. with context length 0 and an empty query range (the
attention kernel skips them); the chain pads the same way (``_chain_ints``). Sequences are
ordered drafting ones first, so chain row r is catch-up sequence r and both read one block-table
region.

``ints`` layout (M = Bp * Q rows, S = K - 1)::

    ids [M] | positions [M] | slots [M] | context lens [Bp] | query starts [Bp + 1] |
    last catch-up row of each drafting sequence [Bp] (padding: 0) |
    chain ints (``_chain_ints``): positions, slots, context lens [S, Bp] each,
        query starts [Bp + 1], block tables [Bp, W] (also the catch-up's)

Calls that do not fit (a catch-up longer than the largest query bucket, more than 256
sequences, no drafting sequence) return None and the caller runs its eager path.
"""

from __future__ import annotations

import numpy as np
import torch

from speculant.engine.attention import AttentionMetadata, ForwardContext
from speculant.engine.gather import gather_rows
from speculant.engine.staging import staging_ext
from speculant.kernels.stage_copy import pinned_copy
from speculant.plugins.mlp_speculator import bucket, to_device_async

QUERY_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16)  # catch-up rows per sequence: 1..k+1 normally
MAX_BATCH = 256


def query_bucket(n: int) -> int | None:
    return next((q for q in QUERY_BUCKETS if q >= n), None)


def _slot(table: list[int], idx: int, bs: int) -> int:
    """Cache slot of index ``idx`` of a sequence whose blocks are ``table`` (block 0 past its
    end, as a zero-padded table row gives)."""
    b = idx // bs
    return (table[b] if b < len(table) else 0) * bs + idx % bs


def fused_ints(
    out: np.ndarray,  # [n_ints] int64, written in full (layout above)
    strat,
    batch,
    order: list,  # the _Plan rows, the ``A`` drafting ones first
    A: int,
    Bp: int,
    Q: int,
    K: int,
    W: int,
) -> None:
    """The ``ints`` of one call into ``out``: one pass in C where the extension is built
    (``_staging.eagle_ints``; batch 16 on the development machine: 35 -> 4 us), else built as a
    Python list (a few hundred numbers: numpy's per-call cost dominated) and written at once; the
    tests compare the two value for value."""
    bs, M = strat.cache.block_size, Bp * Q
    ext = staging_ext()
    if ext is not None:
        rows = (
            [p.st.table for p in order],
            [p.st.offset for p in order],
            [p.start for p in order],
            [p.n for p in order],
            [batch.seqs[p.i].token_ids for p in order],
        )
        return ext.eagle_ints(out, *rows, A, Bp, Q, K, W, bs)
    chain = strat._chain_ints(order[:A], K, Bp, W)
    t0 = len(chain) - Bp * W  # the shared block tables: rows of non-drafting sequences too
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    ctx, qsl, last = [0] * Bp, [0] * (Bp + 1), [0] * Bp
    t = 0
    for r, p in enumerate(order):
        tbl, off = p.st.table, p.st.offset
        if r >= A:
            chain[t0 + r * W : t0 + r * W + len(tbl)] = tbl
        ids.extend(batch.seqs[p.i].token_ids[p.start + 1 : p.n])  # fed tokens
        qs = range(p.start, p.n - 1)  # their positions
        pos.extend(qs)
        slots.extend(_slot(tbl, q - off, bs) for q in qs)
        ctx[r] = p.n - 1 - off
        t += p.count
        qsl[r + 1] = t
        if r < A:
            last[r] = t - 1
    qsl[len(order) + 1 :] = [t] * (Bp - len(order))
    pad = M - t
    out[:] = ids + [0] * pad + pos + [0] * pad + slots + [-1] * pad + ctx + qsl + last + chain


def fused_greedy(
    strat,
    batch,
    feats: torch.Tensor,  # [rows, F] the target's features of the whole batch
    plan: list,  # _Plan rows of this call
    K: int,
) -> torch.Tensor | None:  # [drafting sequences, K] greedy drafts, plan order; None: not here
    order = [p for p in plan if p.k > 0]
    A = len(order)
    order += [p for p in plan if p.k == 0]
    Q = query_bucket(max(p.count for p in plan))
    if not A or Q is None or len(plan) > MAX_BATCH:
        return None
    if not all(batch.seqs[p.i].sampling_params.is_greedy for p in order[:A]):
        return None
    Bp, W, dev = bucket(len(plan)), strat.graph_width, feats.device
    if any(len(p.st.table) > W for p in plan):  # grow() bounds it by max_model_len + k
        raise AssertionError(f"draft block table wider than the graph's ({W} blocks)")
    M, S = Bp * Q, K - 1
    n_ints = 3 * M + 3 * Bp + 1 + 3 * S * Bp + Bp + 1 + Bp * W

    def make():
        return (
            torch.zeros(n_ints, dtype=torch.long, device=dev),
            torch.zeros(M, feats.shape[1], dtype=strat.ctx.dtype, device=dev),
            strat.graphs.host_vector(n_ints),
        )

    key = ("fused", Bp, Q, K)
    ints_buf, feats_buf, host = strat.graphs.buffers(key, make)  # [n_ints], [M, F], [n_ints]
    fused_ints(strat.graphs.writable(host), strat, batch, order, A, Bp, Q, K, W)
    rows = [r for p in order for r in range(p.row, p.row + p.count)]
    T = len(rows)
    if rows == list(range(feats.shape[0])):
        feats_buf[:T].copy_(feats)
    else:
        feats_buf[:T].copy_(gather_rows(feats, to_device_async(rows, torch.long, dev)))

    def fn(ints: torch.Tensor, fs: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
        pinned_copy(host, ints)  # [n_ints] pinned -> device: the graph's first node
        return propose_graph(strat, ints, fs, Bp, Q, K, W)

    out = strat.graphs.replay(key, fn)
    if out is None:  # the capture failed: eagerly
        out = fn(ints_buf, feats_buf, host)
    return out[:A]


def propose_graph(
    strat,
    ints: torch.Tensor,  # [n_ints] int64, layout above
    feats: torch.Tensor,  # [Bp * Q, F] the target's features, catch-up rows first
    Bp: int,
    Q: int,
    K: int,
    W: int,
) -> torch.Tensor:  # [Bp, K] greedy drafts (padded rows: garbage)
    """What the graph runs: catch-up forward, gather of the last rows, the K greedy steps."""
    M, bs = Bp * Q, strat.cache.block_size
    o = 3 * M
    ids, pos, slots = ints[:M], ints[M : 2 * M], ints[2 * M : o]
    i32 = ints.to(torch.int32)  # lengths, query starts and block tables: one conversion kernel
    ctx = i32[o : o + Bp]
    qsl = i32[o + Bp : o + 2 * Bp + 1]
    last = ints[o + 2 * Bp + 1 : o + 3 * Bp + 1]
    chain = ints[o + 3 * Bp + 1 :]
    tables = i32[i32.numel() - Bp * W :].view(Bp, W)
    meta = AttentionMetadata.padded(slots, tables, ctx, qsl, Q, bs)
    fctx = ForwardContext(meta=meta, kv_caches=strat.cache.kv_caches)
    out = strat.draft(strat._embed(ids), feats, pos, fctx, True)  # [M, H]
    x = gather_rows(out, last)  # [Bp, H] the draft state of each row's last position
    # greedy steps (no sampler): the argmax over the hot / draft-vocabulary logits when the
    # strategy has a token map or a draft vocabulary (_greedy), no full-vocabulary rows
    return strat._chain(chain, x, K, W, None)
