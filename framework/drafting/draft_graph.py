"""The fast path of :meth:`DraftRunner.propose_greedy <speculant.drafting.runner.DraftRunner>`:
the whole greedy propose as one CUDA graph replay: the catch-up forward (the tokens the draft
cache misses, normally the accepted drafts and the bonus token), the gather of each sequence's
last row, then K greedy steps (LM head and argmax, and for the first K - 1 a one-token forward of
the chosen token). The LM head and argmax are the runner's ``greedy`` (a strategy with a token
map passes the argmax over its hot rows' logits, mapped through the hot ids: no full-vocabulary
row). One graph per (batch bucket Bp, query bucket Q, K) in the runner's ``GraphCache``: at
start-up (``capture_all``, the ``capture_graphs`` hook) for every batch bucket
up to ``max_num_seqs`` and catch-ups of up to k + 1 tokens, on padding inputs
(``padding_ints``); other shapes (a request's first catch-up: its prompt) on first use. Calls
that do not fit (catch-ups longer than the largest query bucket, more sequences than the largest
batch bucket, block tables wider than the graph's) return None and the caller runs its eager
path.

Shapes follow the draft runner's CUDA graphs (engine/cuda_graph.py) exactly: the same batch and
query buckets and block-table width, so the catch-up and each draft step run the kernels, tilings
and split-K choices of the eager path and greedy drafts are the same. Padding is theirs too: a
catch-up of T <= Bp * Q rows over A <= Bp sequences leaves rows T.. as padding (token 0, position
0, slot -1, which store_kv skips) and sequences A.. with context length 0 and an empty query range.
A sequence that drafts fewer than K tokens runs the steps it does not use without writing K/V
(slot -1, position 0, context: its catch-up's): its output there is dropped.

All inputs are one int64 buffer per key in the layout of :mod:`~speculant.drafting.propose_ints`
(the head's one-graph propose reads the same), which the graph's first kernel copies from a
pinned host vector of its own (``pinned_copy``: the host only writes that vector).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from speculant.drafting.propose_ints import padding_ints
from speculant.drafting.propose_ints import sizes as _sizes
from speculant.engine.staging import staging_ext
from speculant.kernels.logprobs import row_argmax
from speculant.kernels.stage_copy import pinned_copy
from speculant.models.attention import AttentionMetadata, ForwardContext
from speculant.models.gather import gather_rows

if TYPE_CHECKING:
    from speculant.drafting.runner import DraftRunner, DraftState


def _bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    return next((b for b in buckets if b >= n), None)


def shapes(runner: DraftRunner) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(batch buckets, query buckets, block-table width W): the runner's CUDA graphs' shapes."""
    return runner.graph_shapes()


def fused_ints(
    out: np.ndarray,  # [sum(_sizes)] int64, written in full (the propose_ints layout)
    states: list[DraftState],  # each drafting sequence's (num_cached_tokens: before the catch-up)
    feeds: list[list[int]],  # catch-up tokens of each
    ks: list[int],  # drafts of each (1..K)
    Bp: int,
    Q: int,
    K: int,
    W: int,
    bs: int,
) -> None:
    """One pass in C where the extension is built (``_staging.draft_ints``, ~10x faster at batch
    16), else the Python below, which the tests compare it with
    value for value. In Python the block tables go straight into ``out`` (one numpy row write per
    sequence); the few numbers before them are built as Python lists and written with one slice
    assignment, where ~40 numpy calls cost more (the GPU waits for this host work before the
    draft graph runs)."""
    ext = staging_ext()
    if ext is not None:
        tables = [st.block_table for st in states]
        cached = [st.num_cached_tokens for st in states]
        return ext.draft_ints(out, tables, cached, feeds, ks, Bp, Q, K, W, bs)
    A, S, M = len(states), K - 1, Bp * Q
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    ctx, qsl, last = [0] * Bp, [0] * (Bp + 1), [0] * Bp
    spos, sslots, sctx = [0] * (S * Bp), [-1] * (S * Bp), [0] * (S * Bp)
    head = 3 * M + 3 * Bp + 1 + 3 * S * Bp + Bp + 1  # entries before the block tables
    tables = out[head:].reshape(Bp, W)
    tables.fill(0)
    t = 0
    for r, (st, feed, k) in enumerate(zip(states, feeds, ks)):
        bt = st.block_table
        nb = len(bt)
        tables[r, :nb] = bt
        c0 = st.num_cached_tokens
        n = c0 + len(feed)  # tokens in the draft cache after the catch-up
        ids.extend(feed)
        pos.extend(range(c0, n))
        slots.extend(bt[p // bs] * bs + p % bs for p in range(c0, n))
        ctx[r] = n
        t += len(feed)
        qsl[r + 1] = t
        last[r] = t - 1
        # step j feeds draft j at position n + j; rows with k - 1 <= j skip it (no write)
        for j in range(S):
            if j < k - 1:
                q = n + j
                b = min(q // bs, W - 1)
                spos[j * Bp + r] = q
                sslots[j * Bp + r] = (bt[b] if b < nb else 0) * bs + q % bs
                sctx[j * Bp + r] = q + 1
            else:
                sctx[j * Bp + r] = n
    qsl[A + 1 :] = [t] * (Bp - A)
    sqsl = list(range(A + 1)) + [A] * (Bp - A)
    pad = M - t
    out[:head] = (
        ids
        + [0] * pad
        + pos
        + [0] * pad
        + slots
        + [-1] * pad
        + ctx
        + qsl
        + last
        + spos
        + sslots
        + sctx
        + sqsl
    )


def _fctx(
    slots: torch.Tensor,  # [Bp * Q] int64
    tables: torch.Tensor,  # [Bp, W] int32
    ctx: torch.Tensor,  # [Bp] int32
    qsl: torch.Tensor,  # [Bp + 1] int32
    Q: int,
    bs: int,
    kv_caches: list,
) -> ForwardContext:
    meta = AttentionMetadata.padded(slots, tables, ctx, qsl, Q, bs)
    return ForwardContext(meta=meta, kv_caches=kv_caches)


def propose_graph(
    model,
    kv_caches: list,  # per layer (k_cache, v_cache) [num_blocks, bs, nkv, d] each
    ints: torch.Tensor,  # [n_ints] int64, the propose_ints layout
    Bp: int,
    Q: int,
    K: int,
    W: int,
    bs: int,
    greedy: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:  # [Bp, K] greedy drafts (padding rows and unused steps: garbage)
    """What the graph runs: the catch-up forward, the gather of each row's last position, LM head
    and argmax (the first draft), then the K - 1 further greedy steps (feed the last draft, LM
    head, argmax). ``greedy``: LM head and argmax, final hidden states [rows, hidden] -> tokens
    [rows] int64 (the runner's ``greedy``, which honours a strategy's token map); default
    ``row_argmax(model.compute_logits(hidden))``."""
    if greedy is None:

        def greedy(h: torch.Tensor) -> torch.Tensor:  # [rows, hidden] -> [rows]
            return row_argmax(model.compute_logits(h))

    S, sizes = K - 1, _sizes(Bp, Q, K, W)
    ids, pos, slots, _, _, last, spos, sslots, _, _, _ = ints.split(sizes)
    # the int32 inputs (lengths, query starts, block tables) from ONE conversion kernel
    _, _, _, ctx, qsl, _, _, _, sctx, sqsl, tables = ints.to(torch.int32).split(sizes)
    tables = tables.view(Bp, W)
    fctx = _fctx(slots, tables, ctx, qsl, Q, bs, kv_caches)
    hidden = model(ids, pos, fctx)  # [Bp * Q, hidden]
    tok = greedy(gather_rows(hidden, last))  # [Bp]
    spos, sslots, sctx = spos.view(S, Bp), sslots.view(S, Bp), sctx.view(S, Bp)
    out = [tok]
    for j in range(S):
        x = model(tok, spos[j], _fctx(sslots[j], tables, sctx[j], sqsl, 1, bs, kv_caches))
        tok = greedy(x)  # [Bp]
        out.append(tok)
    return torch.stack(out, dim=1)


def fused_greedy(
    runner: DraftRunner,
    states: list[DraftState],  # each drafting sequence's, synced and reserved
    feeds: list[list[int]],  # catch-up tokens of each
    ks: list[int],  # drafts of each, >= 1
) -> torch.Tensor | None:  # [len(states), max(ks)] greedy drafts; None: run the eager path
    """The greedy propose as one graph replay. On success the draft caches hold the catch-up and the
    fed-back drafts (``num_cached_tokens`` advanced; ``tokens`` is the caller's)."""
    batch_buckets, query_buckets, W = shapes(runner)
    A, K, bs = len(states), max(ks), runner.block_size
    Bp = _bucket(A, batch_buckets)
    Q = _bucket(max(len(f) for f in feeds), query_buckets)
    if Bp is None or Q is None or any(len(st.block_table) > W for st in states):
        return None
    key, (buf, host), whole = _entry(runner, Bp, Q, K, W)
    fused_ints(runner.graphs.writable(host), states, feeds, ks, Bp, Q, K, W, bs)  # graph copies it
    out = runner.graphs.replay(key, whole)
    if out is None:  # a capture failed: the same function, eagerly
        out = whole(buf, host)
    for st, feed, k in zip(states, feeds, ks):  # after the launch: the GPU is already drafting
        st.num_cached_tokens += len(feed) + k - 1
    return out[:A]


def _entry(runner: DraftRunner, Bp: int, Q: int, K: int, W: int):
    """(key, its static inputs ([n_ints] device, [n_ints] pinned host), the function the graph
    captures) of one (Bp, Q, K) propose graph."""
    n_ints, dev, bs = sum(_sizes(Bp, Q, K, W)), runner.device, runner.block_size
    graphs, model, kv = runner.graphs, runner.model, runner.kv_caches
    greedy = runner.greedy  # LM head and argmax: over the hot rows only with a token map
    bufs = graphs.buffers(  # [n_ints] device, [n_ints] pinned host
        (Bp, Q, K),
        lambda: (torch.zeros(n_ints, dtype=torch.long, device=dev), graphs.host_vector(n_ints)),
    )

    def whole(ints: torch.Tensor, host: torch.Tensor) -> torch.Tensor:  # -> [Bp, K]
        pinned_copy(host, ints)  # [n_ints] pinned -> device: the graph's first node
        return propose_graph(model, kv, ints, Bp, Q, K, W, bs, greedy)

    return (Bp, Q, K), bufs, whole


def startup_keys(runner: DraftRunner, max_seqs: int) -> list[tuple[int, int, int]]:
    """(Bp, Q, K) of every greedy propose of up to ``max_seqs`` sequences whose catch-ups feed
    at most k + 1 tokens (the accepted drafts and the bonus token) and which draft K = k tokens
    (fewer only near the end of the context): each batch bucket x query bucket up to theirs."""
    batch_buckets, query_buckets, _ = shapes(runner)
    K = runner.num_speculative_tokens
    top_b = _bucket(min(max_seqs, batch_buckets[-1]), batch_buckets)
    top_q = _bucket(min(K + 1, query_buckets[-1]), query_buckets)
    return [(Bp, Q, K) for Q in query_buckets if Q <= top_q for Bp in batch_buckets if Bp <= top_b]


def capture_all(runner: DraftRunner, max_seqs: int, progress: bool = True) -> int:
    """Capture now, on padding inputs (``padding_ints``: nothing written to the draft cache),
    every propose graph of ``startup_keys`` not captured yet. Returns how many were captured."""
    W = shapes(runner)[2]
    return runner.graphs.capture_all(
        startup_keys(runner, max_seqs),
        lambda key: _entry(runner, *key, W),
        lambda host, key: padding_ints(host, *key, W),
        "Capturing draft-model propose graphs",
        progress,
    )
