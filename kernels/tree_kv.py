"""Token trees at the kernel level: the per-row tree mask of a step and the K/V compaction of
an accepted path (docs/kernels.md "Tree attention").

A tree step of a sequence has ``n + 1`` query rows: row 0 the root (the sequence's last
accepted token), row ``i + 1`` draft node ``i``, at cache positions ``ctx_start + (0..n)``.
Nodes are in topological order (a parent precedes its children: ``parents[i] < i``, ``-1`` =
child of the root), as ``DraftTree`` keeps them.

* ``tree_bits [num_tokens] int64``: bit ``j`` of row ``r`` set = row ``r`` may attend to in-step
  row ``j`` of its sequence (the root, its ancestors and itself). Every row also sees the whole
  cached context before ``ctx_start``. A chain's rows are the causal masks ``(1 << (r + 1)) - 1``.
* RoPE positions: row ``r`` sits at ``ctx_start + depth(r)`` (root depth 0), not at its cache
  slot ``ctx_start + r``; the engine must pass these per-row positions to the forward.
* After verification the accepted path's K/V (in-step rows, increasing) move to the cache
  positions ``ctx_start + 1, ctx_start + 2, ...`` right after the root: ``compact_tree_kv``.
"""

from __future__ import annotations

import torch

from ._triton_utils import cdiv, check_tensor, lazy_jit, next_pow2, tl, use_triton
from .paged_attention import TREE_MAX_ROWS as _MAX_ROWS  # one int64 of bits per row

__all__ = ["tree_row_bits", "tree_row_depths", "compact_tree_kv", "compact_tree_kv_ref"]



def _check_parents(parents: list[int]) -> None:
    if len(parents) + 1 > _MAX_ROWS:
        raise ValueError(f"a tree of {len(parents)} nodes: tree_bits covers at most "
                         f"{_MAX_ROWS - 1} nodes (plus the root) per sequence")
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"parents[{i}] = {p}: a node's parent must be -1 (the root) or an "
                             f"earlier node (topological order)")


def tree_row_bits(parents: list[int]) -> list[int]:
    """The ``n + 1`` rows' tree bits of one sequence's step (row 0 the root), as Python ints in
    the int64 range (``torch.tensor(bits, dtype=torch.int64)``)."""
    _check_parents(parents)
    bits = [1]  # the root sees itself (and the context)
    for i, p in enumerate(parents):
        bits.append(bits[p + 1] | (1 << (i + 1)))  # a parent's row is complete before its child
    return [b - (1 << 64) if b >= 1 << 63 else b for b in bits]  # as signed int64


def tree_row_depths(parents: list[int]) -> list[int]:
    """Depth of each of the ``n + 1`` rows (root 0): row ``r``'s RoPE position is
    ``ctx_start + depth[r]``."""
    _check_parents(parents)
    depth = [0]
    for p in parents:
        depth.append(depth[p + 1] + 1)
    return depth


def _check_compaction(kv_cache, block_tables, ctx_start, path_rows) -> None:
    check_tensor("kv_cache", kv_cache, ndim=6)
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous (the engine's [num_layers, 2, ...] cache "
                         "is); compaction writes it in place, so a copy would be lost")
    dev = kv_cache.device
    if kv_cache.shape[1] != 2:
        raise ValueError(f"kv_cache must be [num_layers, 2, num_blocks, block_size, num_kv_heads, "
                         f"head_dim], got shape {tuple(kv_cache.shape)}")
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32, torch.int64),
                 device=dev)
    ns = block_tables.shape[0]
    check_tensor("ctx_start", ctx_start, shape=(ns,), dtypes=(torch.int32, torch.int64),
                 device=dev)
    check_tensor("path_rows", path_rows, ndim=2, dtypes=(torch.int32, torch.int64), device=dev)
    if path_rows.shape[0] != ns:
        raise ValueError(f"path_rows has {path_rows.shape[0]} rows, block_tables {ns}: one per "
                         f"sequence")


def compact_tree_kv_ref(
    kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    ctx_start: torch.Tensor,  # [num_seqs]: cache position of each sequence's root row
    path_rows: torch.Tensor,  # [num_seqs, max_path]: accepted in-step rows, increasing; -1 pad
) -> None:
    """Reference: for every sequence and every layer, copy the K/V of in-step row
    ``path_rows[s, i]`` (cache position ``ctx_start + path_rows[s, i]``) to position
    ``ctx_start + 1 + i``, one entry after another (in place; a destination never holds a
    source still to be read, since ``path_rows[s, i] >= i + 1`` and increases)."""
    _check_compaction(kv_cache, block_tables, ctx_start, path_rows)
    L, _, nb, bs = kv_cache.shape[:4]
    flat = kv_cache.view(L, 2, nb * bs, *kv_cache.shape[4:])  # [L, 2, num_slots, nkv, d]
    bt = block_tables.long().tolist()
    for s, (c0, rows) in enumerate(zip(ctx_start.tolist(), path_rows.tolist())):
        for i, r in enumerate(rows):
            if r < 0:
                break
            if r < i + 1:
                raise ValueError(f"path_rows[{s}] = {rows}: accepted rows must increase from 1 "
                                 f"(row 0 is the root)")
            src, dst = c0 + r, c0 + 1 + i
            if src == dst:
                continue
            flat[:, :, bt[s][dst // bs] * bs + dst % bs] = flat[:, :, bt[s][src // bs] * bs
                                                                 + src % bs]


def compact_tree_kv(
    kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    ctx_start: torch.Tensor,  # [num_seqs]: cache position of each sequence's root row
    path_rows: torch.Tensor,  # [num_seqs, max_path]: accepted in-step rows, increasing; -1 pad
    *,
    force_triton: bool = False,
) -> None:
    """``compact_tree_kv_ref`` without host reads (graph-capturable). CUDA: one Triton launch
    (``_compact_kernel``); CPU: one batched gather and scatter over all layers, all sources
    gathered before any destination is written. Padding (-1) goes at the end of a row of
    ``path_rows``; neither checks that the rows increase (the reference does).
    ``force_triton``: the kernel under ``TRITON_INTERPRET=1`` on CPU tensors (tests). Padding entries (-1) copy the root's slot onto itself
    (so no position past the sequence's blocks is looked up), rows already in place their own."""
    _check_compaction(kv_cache, block_tables, ctx_start, path_rows)
    if use_triton([kv_cache, block_tables, ctx_start, path_rows], force_triton):
        _compact_triton(kv_cache, block_tables, ctx_start, path_rows)
        return
    L, _, nb, bs = kv_cache.shape[:4]
    flat = kv_cache.view(L, 2, nb * bs, *kv_cache.shape[4:])  # [L, 2, num_slots, nkv, d]
    rows = path_rows.long()  # [S, P]
    P = rows.shape[1]
    step = torch.arange(1, P + 1, device=rows.device)[None, :]  # [1, P]
    valid = rows >= 0  # [S, P]
    c0 = ctx_start.long()[:, None]  # [S, 1]
    src_pos = c0 + torch.where(valid, rows, 0)  # [S, P]: padding: the root onto itself
    dst_pos = c0 + torch.where(valid, step, 0)  # [S, P]
    bt = block_tables.long()
    src = bt.gather(1, src_pos // bs) * bs + src_pos % bs  # [S, P] cache slots
    dst = bt.gather(1, dst_pos // bs) * bs + dst_pos % bs  # [S, P]
    flat[:, :, dst.reshape(-1)] = flat[:, :, src.reshape(-1)]  # [L, 2, S * P, nkv, d]


if tl is not None:

    @lazy_jit(do_not_specialize=("max_path", "stride_bt", "stride_rows"))
    def _compact_kernel(
        kv_ptr,  # [num_layers * 2, num_blocks * block_size, row_elems] (the contiguous cache)
        bt_ptr,  # [num_seqs, max_blocks] int32 / int64
        c0_ptr,  # [num_seqs]: cache position of the root row
        rows_ptr,  # [num_seqs, max_path]: accepted in-step rows, -1 padding
        max_path,
        row_elems,  # num_kv_heads * head_dim
        stride_lk,  # elements per (layer, K or V) plane
        stride_bt,
        stride_rows,
        BLOCK_SIZE: tl.constexpr,  # tokens per cache block
        BLOCK_E: tl.constexpr,  # elements of a slot per program
    ):
        # program = (sequence, layer x {K, V}, chunk of a slot's elements); the path's entries
        # are copied one after another, each element by the same program: a destination
        # ctx_start + 1 + i is never a source of a later entry (rows increase, rows[i] >= i + 1)
        seq = tl.program_id(0).to(tl.int64)
        plane = tl.program_id(1).to(tl.int64)
        e = tl.program_id(2) * BLOCK_E + tl.arange(0, BLOCK_E)  # [BLOCK_E]
        e_ok = e < row_elems
        c0 = tl.load(c0_ptr + seq).to(tl.int64)
        base = kv_ptr + plane * stride_lk
        bt_row = bt_ptr + seq * stride_bt
        for i in range(0, max_path):
            r = tl.load(rows_ptr + seq * stride_rows + i).to(tl.int64)
            if r >= 0:
                src = c0 + r
                dst = c0 + 1 + i
                src_slot = tl.load(bt_row + src // BLOCK_SIZE).to(tl.int64) * BLOCK_SIZE + (
                    src % BLOCK_SIZE)
                dst_slot = tl.load(bt_row + dst // BLOCK_SIZE).to(tl.int64) * BLOCK_SIZE + (
                    dst % BLOCK_SIZE)
                x = tl.load(base + src_slot * row_elems + e, mask=e_ok)  # [BLOCK_E]
                tl.store(base + dst_slot * row_elems + e, x, mask=e_ok)


def _compact_triton(kv_cache, block_tables, ctx_start, path_rows) -> None:
    L, _, nb, bs, nkv, d = kv_cache.shape
    ns, max_path = path_rows.shape
    if ns == 0 or max_path == 0 or kv_cache.numel() == 0:
        return
    row_elems = nkv * d
    block_e = min(next_pow2(row_elems), 2048)
    rows = path_rows.contiguous()
    grid = (ns, L * 2, cdiv(row_elems, block_e))
    _compact_kernel[grid](
        kv_cache, block_tables, ctx_start, rows, max_path, row_elems, nb * bs * row_elems,
        block_tables.stride(0), rows.stride(0), BLOCK_SIZE=bs, BLOCK_E=block_e,
        num_warps=4,
    )
