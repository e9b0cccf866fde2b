"""The whole greedy propose of a :class:`~speculant.drafting.head_drafter.HeadDrafter` as one
CUDA graph replay: the catch-up forward over the verified positions (the target's features in),
the gather of each drafting sequence's last row, and the K greedy draft steps
(``HeadDrafter.chain``). One graph per (batch bucket Bp, query bucket Q, K) in the drafter's
``GraphCache``: at start-up (``capture_all``, the ``capture_graphs`` hook) for every batch bucket
up to ``max_num_seqs`` and catch-ups of up to k + 1 rows, with the K-step chains that follow
longer (eager) catch-ups, on padding inputs; other shapes on first use. The graph calls only the
head's public :class:`~speculant.drafting.head_drafter.DraftHead` methods (``catch_up``, ``step``,
``greedy``).

Inputs live in two static buffers per key, filled before each replay: ``ints`` (int64, which the
graph's first kernel copies from a pinned host vector the host writes: ``pinned_copy``; the
layout of :mod:`~speculant.drafting.propose_ints`, which the draft model's one-graph propose
shares) and ``feats`` ([Bp * Q, F] target features, F = the drafter's ``feature_width``). A
catch-up of T <= Bp * Q rows over n <= Bp sequences leaves rows T.. and sequences n.. as padding;
the chain pads the same way (``chain_ints``). Sequences are ordered drafting ones first, so chain
row r is catch-up sequence r and both read one block-table region.

Calls that do not fit (a catch-up longer than the largest query bucket, more than 256
sequences, no drafting sequence) return None and the caller runs its eager path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from speculant.drafting.graphs import BUCKETS, bucket, to_device_async
from speculant.drafting.kv_cache import cache_slot
from speculant.drafting.propose_ints import chain_padding, chain_sizes, padding_ints, sizes
from speculant.engine.staging import staging_ext
from speculant.kernels.stage_copy import pinned_copy
from speculant.models.attention import AttentionMetadata, ForwardContext
from speculant.models.gather import gather_rows

if TYPE_CHECKING:
    from speculant.drafting.head_drafter import CatchUp, HeadDrafter
    from speculant.spec_types import SpecBatch

QUERY_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16)  # catch-up rows per sequence: 1..k+1 normally
MAX_BATCH = 256


def query_bucket(n: int) -> int | None:
    return next((q for q in QUERY_BUCKETS if q >= n), None)


def chain_ints(rows: list[CatchUp], K: int, Bp: int, W: int, bs: int) -> list[int]:
    """The int64 inputs of K - 1 draft steps for ``rows`` padded to ``Bp`` sequences and block
    tables of width ``W`` (block size ``bs``): positions, slots, context lengths ``[K - 1, Bp]``
    each, query start offsets ``[Bp + 1]``, block tables ``[Bp, W]`` (flat, in that order).
    Padded sequences have context length 0 and an empty query range; their token rows write no
    K/V (slot -1). Built as a Python list: a few hundred numbers, where numpy's per-call cost
    dominated (the GPU waits for this host work before the draft graph runs)."""
    S, A = K - 1, len(rows)
    pos, slots, ctx = [0] * (S * Bp), [-1] * (S * Bp), [0] * (S * Bp)
    tables = [0] * (Bp * W)
    for r, p in enumerate(rows):
        tbl = p.st.table
        tables[r * W : r * W + len(tbl)] = tbl
        for j in range(S):
            idx = p.n - 1 + j - p.st.offset  # draft step j writes position n - 1 + j
            pos[j * Bp + r] = p.n - 1 + j
            slots[j * Bp + r] = cache_slot(tbl, idx, bs)
            ctx[j * Bp + r] = idx + 1
    return pos + slots + ctx + list(range(A + 1)) + [A] * (Bp - A) + tables


def fused_ints(
    out: np.ndarray,  # [n_ints] int64, written in full (propose_ints layout)
    batch: SpecBatch,
    order: list[CatchUp],  # the ``A`` drafting ones first
    A: int,
    Bp: int,
    Q: int,
    K: int,
    W: int,
    bs: int,
) -> None:
    """The ``ints`` of one call into ``out``: one pass in C where the extension is built
    (``_staging.eagle_ints``, a tenth of the Python's host time), else built as a Python list
    and written at once; the tests compare the two value for value."""
    M = Bp * Q
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
    chain = chain_ints(order[:A], K, Bp, W, bs)
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
        slots.extend(cache_slot(tbl, q - off, bs) for q in qs)
        ctx[r] = p.n - 1 - off
        t += p.count
        qsl[r + 1] = t
        if r < A:
            last[r] = t - 1
    qsl[len(order) + 1 :] = [t] * (Bp - len(order))
    pad = M - t
    out[:] = ids + [0] * pad + pos + [0] * pad + slots + [-1] * pad + ctx + qsl + last + chain


def fused_greedy(
    drafter: HeadDrafter,
    batch: SpecBatch,
    feats: torch.Tensor,  # [rows, F] the target's features of the whole batch
    plan: list[CatchUp],
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
    Bp, W, dev = bucket(len(plan)), drafter.graph_width, feats.device
    if any(len(p.st.table) > W for p in plan):  # reserve() bounds it by max_model_len + k
        raise AssertionError(f"draft block table wider than the graph's ({W} blocks)")
    key, (ints_buf, feats_buf, host), fn = _entry(drafter, Bp, Q, K, W, feats.shape[1])
    host_ints = drafter.graphs.writable(host)
    fused_ints(host_ints, batch, order, A, Bp, Q, K, W, drafter.cache.block_size)
    rows = [r for p in order for r in range(p.row, p.row + p.count)]
    T = len(rows)
    if rows == list(range(feats.shape[0])):
        feats_buf[:T].copy_(feats)
    else:
        feats_buf[:T].copy_(gather_rows(feats, to_device_async(rows, torch.long, dev)))
    out = drafter.graphs.replay(key, fn)
    if out is None:  # the capture failed: eagerly
        out = fn(ints_buf, feats_buf, host)
    return out[:A]


def _entry(drafter: HeadDrafter, Bp: int, Q: int, K: int, W: int, F: int):
    """(key, its static inputs ([n_ints] device, [Bp * Q, F] features, [n_ints] pinned host),
    the function the graph captures) of one (Bp, Q, K) propose graph."""
    M, dev, graphs = Bp * Q, drafter.ctx.device, drafter.graphs
    n_ints = sum(sizes(Bp, Q, K, W))

    def make():
        return (
            torch.zeros(n_ints, dtype=torch.long, device=dev),
            torch.zeros(M, F, dtype=drafter.ctx.dtype, device=dev),
            graphs.host_vector(n_ints),
        )

    key = ("fused", Bp, Q, K)
    bufs = graphs.buffers(key, make)

    def fn(ints: torch.Tensor, fs: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
        pinned_copy(host, ints)  # [n_ints] pinned -> device: the graph's first node
        return propose_graph(drafter, ints, fs, Bp, Q, K, W)

    return key, bufs, fn


def chain_entry(drafter: HeadDrafter, Bp: int, K: int, W: int):
    """(key, its static inputs ([n_ints] device, [Bp, H] draft states, [n_ints] pinned host),
    the function the graph captures) of one (Bp, K) greedy chain graph."""
    dev, graphs = drafter.ctx.device, drafter.graphs
    n_ints = sum(chain_sizes(Bp, K, W))

    def make():
        return (
            torch.zeros(n_ints, dtype=torch.long, device=dev),
            torch.zeros(Bp, drafter.hidden_size, dtype=drafter.ctx.dtype, device=dev),
            graphs.host_vector(n_ints),
        )

    key = (Bp, K)
    bufs = graphs.buffers(key, make)  # [n_ints], [Bp, H], [n_ints]

    def fn(ints, xs, host):
        pinned_copy(host, ints)  # [n_ints] pinned -> device: the graph's first node
        return drafter.chain(ints, xs, K, W, None)[0]  # greedy

    return key, bufs, fn


def chain_greedy(
    drafter: HeadDrafter,
    x: torch.Tensor,  # [len(rows), H] the draft states of the drafting sequences
    rows: list[CatchUp],
    K: int,
) -> torch.Tensor:  # [len(rows), K]
    """The K greedy draft steps from the draft states ``x`` [len(rows), H] as one CUDA graph
    replay (batch padded to a bucket, block tables to the widest a sequence can have):
    [len(rows), K] drafts."""
    A, Bp, W = len(rows), bucket(len(rows)), drafter.graph_width
    if any(len(p.st.table) > W for p in rows):  # reserve() bounds it by max_model_len + k
        raise AssertionError(f"draft block table wider than the graph's ({W} blocks)")
    key, (ints_buf, x_buf, host), fn = chain_entry(drafter, Bp, K, W)
    host_ints = drafter.graphs.writable(host)
    host_ints[:] = chain_ints(rows, K, Bp, W, drafter.cache.block_size)  # the graph copies it
    x_buf[:A].copy_(x)
    out = drafter.graphs.replay(key, fn)
    if out is None:  # the capture failed: eagerly
        out = fn(ints_buf, x_buf, host)
    return out[:A]  # [A, K]


def capture_all(drafter: HeadDrafter, max_seqs: int, progress: bool = True) -> int:
    """Capture now, on padding inputs (nothing written to the draft cache), the greedy propose
    graphs of up to ``max_seqs`` sequences (at most 256) not captured yet: the one-graph
    propose of each (batch bucket, catch-up bucket up to k + 1 rows) and the K-step chain
    (``chain_greedy``: after a catch-up too long for one graph, e.g. a request's first propose
    over its prompt) of each batch bucket, K = k. Returns how many were captured."""
    K, W = drafter.num_speculative_tokens, drafter.graph_width
    top_b, top_q = bucket(min(max_seqs, MAX_BATCH)), query_bucket(min(K + 1, QUERY_BUCKETS[-1]))
    batches = [b for b in BUCKETS if b <= top_b]
    items = [(b, q) for q in QUERY_BUCKETS if q <= top_q for b in batches]  # one-graph proposes
    items += [(b, 0) for b in batches]  # chains (Q = 0)

    def entry(item):
        Bp, Q = item
        if Q:
            return _entry(drafter, Bp, Q, K, W, drafter.feature_width)
        return chain_entry(drafter, Bp, K, W)

    def pad(host: np.ndarray, item) -> None:
        Bp, Q = item
        if Q:
            padding_ints(host, Bp, Q, K, W)
        else:
            chain_padding(host, Bp, K)

    return drafter.graphs.capture_all(
        items, entry, pad, f"Capturing {drafter.name} propose graphs", progress
    )


def propose_graph(
    drafter: HeadDrafter,
    ints: torch.Tensor,  # [n_ints] int64, the propose_ints layout
    feats: torch.Tensor,  # [Bp * Q, F] the target's features, catch-up rows first
    Bp: int,
    Q: int,
    K: int,
    W: int,
) -> torch.Tensor:  # [Bp, K] greedy drafts (padded rows: garbage)
    """What the graph runs: catch-up forward, gather of the last rows, the K greedy steps."""
    M, bs = Bp * Q, drafter.cache.block_size
    o = 3 * M
    ids, pos, slots = ints[:M], ints[M : 2 * M], ints[2 * M : o]
    i32 = ints.to(torch.int32)  # lengths, query starts and block tables: one conversion kernel
    ctx = i32[o : o + Bp]
    qsl = i32[o + Bp : o + 2 * Bp + 1]
    last = ints[o + 2 * Bp + 1 : o + 3 * Bp + 1]
    chain = ints[o + 3 * Bp + 1 :]
    tables = i32[i32.numel() - Bp * W :].view(Bp, W)
    meta = AttentionMetadata.padded(slots, tables, ctx, qsl, Q, bs)
    fctx = ForwardContext(meta=meta, kv_caches=drafter.cache.kv_caches)
    out = drafter.head.catch_up(ids, feats, pos, fctx)  # [M, H]
    x = gather_rows(out, last)  # [Bp, H] the draft state of each row's last position
    # greedy steps (no sampler): the head's greedy choice, which needs no full-vocabulary row
    # with a token map or a draft vocabulary
    return drafter.chain(chain, x, K, W, None)[0]
