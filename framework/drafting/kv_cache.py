"""The paged KV cache of a draft head: blocks of K/V per head layer, a block table per sequence,
and which of its positions hold K/V computed from the target's features.

A head that runs on the target's features (EAGLE, an MTP layer, ...) keeps K/V for every position
it has seen. Each sequence owns a :class:`SeqCache`: its block table, the target position held at
cache index 0 (``offset``: a sequence whose context restarts at position p keeps positions p.. in
its blocks) and the end of its valid K/V. :class:`HeadDrafter
<speculant.drafting.head_drafter.HeadDrafter>` drives it; a head of your own can use it directly.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from speculant.models.llama import LlamaAttention
from speculant.spec_types import StrategyContext


def cache_slot(table: list[int], idx: int, block_size: int) -> int:
    """Cache slot of index ``idx`` of a sequence whose blocks are ``table``: block
    ``table[idx // block_size]``, row ``idx % block_size``. An index past the table's end reads
    block 0, as a zero-padded block-table row does.

    >>> cache_slot([5, 2], 6, 4)  # block 2, row 2
    10
    """
    b = idx // block_size
    return (table[b] if b < len(table) else 0) * block_size + idx % block_size


@dataclass
class SeqCache:
    """One sequence's part of a :class:`DraftKVCache`."""

    table: list[int]  # its blocks of the cache, in order
    offset: int  # the target position held at cache index 0
    valid: int  # positions [offset, valid) hold K/V computed from the target's features


class DraftKVCache:
    """The paged K/V of a draft head's layers and the sequences' blocks of it.

    ``kv_caches`` is what the attention layers read and write through a forward context: per
    layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``.
    ``seqs`` maps a sequence id to its :class:`SeqCache`.

    >>> cache = DraftKVCache(1, 2, 8, 4, 16, torch.device("cpu"), torch.float32)
    >>> st = cache.reserve(7, start=3, last=9)  # positions 3..9: 7 entries, 2 blocks
    >>> st.table, st.offset
    ([0, 1], 3)
    >>> cache.free([7]); len(cache.free_blocks)
    16
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        num_blocks: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.kv_caches = [(self.kv[i, 0], self.kv[i, 1]) for i in range(num_layers)]
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.seqs: dict[int, SeqCache] = {}

    @classmethod
    def for_context(
        cls,
        ctx: StrategyContext,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        extra_tokens: int,
    ) -> DraftKVCache:
        """A cache sized for ``ctx``: room for ``max_num_seqs`` sequences of ``max_model_len +
        extra_tokens`` positions (a head drafting k tokens writes k - 1 past the context), within
        ``ctx.kv_cache_memory`` bytes (default: a tenth of the free memory on CUDA, 1 GiB
        elsewhere), and at least one sequence's worth."""
        bs = ctx.block_size
        item = torch.empty(0, dtype=ctx.dtype).element_size()
        per_block = 2 * num_layers * bs * num_kv_heads * head_dim * item
        per_seq = -(-(ctx.max_model_len + extra_tokens) // bs)
        want = ctx.max_num_seqs * per_seq
        budget = ctx.kv_cache_memory
        if budget is None:
            if ctx.device.type == "cuda":
                budget = int(torch.cuda.mem_get_info(ctx.device)[0] * 0.1)
            else:
                budget = 1 << 30
        num_blocks = max(per_seq, min(want, budget // per_block))
        return cls(num_layers, num_kv_heads, head_dim, bs, num_blocks, ctx.device, ctx.dtype)

    @classmethod
    def for_head(cls, ctx: StrategyContext, head: nn.Module, extra_tokens: int) -> DraftKVCache:
        """:meth:`for_context` for the attention layers of ``head``: one cache layer per
        ``LlamaAttention`` submodule (their ``layer_idx`` 0, 1, ...), their K/V geometry."""
        attn = [m for m in head.modules() if isinstance(m, LlamaAttention)]
        if not attn:
            raise ValueError(f"{type(head).__name__} has no attention layer to cache K/V for")
        a = attn[0]
        return cls.for_context(ctx, len(attn), a.num_kv_heads, a.head_dim, extra_tokens)

    def grow(self, table: list[int], entries: int) -> bool:
        """Append free blocks to ``table`` until it holds ``entries`` cache indices. False (and
        ``table`` unchanged) if there are not enough free blocks."""
        need = -(-entries // self.block_size) - len(table)
        if need > len(self.free_blocks):
            return False
        for _ in range(max(0, need)):
            table.append(self.free_blocks.popleft())
        return True

    def release(self, table: list[int]) -> None:
        """Return ``table``'s blocks to the free list (reused first) and empty it."""
        for b in reversed(table):
            self.free_blocks.appendleft(b)
        table.clear()

    def reserve(self, seq_id: int, start: int, last: int) -> SeqCache | None:
        """The cache of sequence ``seq_id`` before a forward that writes positions ``start``
        .. ``last``, with blocks up to ``last``. Its context restarts at ``start`` (its blocks
        released, ``offset = valid = start``) if it has none yet or cannot continue there: its
        K/V would leave a gap (``start > valid``) or ``start`` is before its ``offset``. None, with
        the sequence's blocks released, if the cache is out of blocks (it restarts next time)."""
        st = self.seqs.get(seq_id)
        if st is None or start < st.offset or start > st.valid:
            if st is not None:
                self.release(st.table)
            st = self.seqs[seq_id] = SeqCache([], start, start)
        if not self.grow(st.table, last - st.offset + 1):
            self.release(st.table)
            del self.seqs[seq_id]
            return None
        return st

    def rollback(self, seq_id: int, valid: int) -> None:
        """Sequence ``seq_id``'s K/V from position ``valid`` on no longer counts (rejected
        drafts); blocks wholly past it go back to the free list. Heads that recompute the
        verified positions at every call (``HeadDrafter``) need not call it: they overwrite."""
        st = self.seqs.get(seq_id)
        if st is None:
            return
        st.valid = max(st.offset, min(st.valid, valid))
        keep = -(-(st.valid - st.offset) // self.block_size)
        if keep < len(st.table):
            tail = st.table[keep:]
            del st.table[keep:]
            self.release(tail)

    def free(self, seq_ids: Iterable[int]) -> None:
        """Release the blocks of finished sequences (``on_requests_finished``)."""
        for i in seq_ids:
            st = self.seqs.pop(i, None)
            if st is not None:
                self.release(st.table)


__all__ = ["DraftKVCache", "SeqCache", "cache_slot"]
