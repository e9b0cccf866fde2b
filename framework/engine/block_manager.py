"""Paged KV cache bookkeeping: fixed-size blocks, per-sequence block tables, a free list."""

from __future__ import annotations

from collections import deque

from speculant.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks ``seq`` needs so that ``num_tokens`` positions in total have a slot."""
        need = -(-num_tokens // self.block_size)
        return max(0, need - len(seq.block_table))

    def can_reserve(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self.free_blocks)

    def reserve(self, seq: Sequence, num_tokens: int) -> None:
        """Make sure positions [0, num_tokens) of ``seq`` have cache slots."""
        n = self.blocks_needed(seq, num_tokens)
        if n > len(self.free_blocks):
            raise RuntimeError("out of KV cache blocks (the scheduler should have preempted)")
        for _ in range(n):
            seq.block_table.append(self.free_blocks.popleft())

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Keep cache slots for positions [0, num_tokens) only; free the blocks past them."""
        keep = -(-num_tokens // self.block_size)
        while len(seq.block_table) > keep:
            self.free_blocks.appendleft(seq.block_table.pop())
        seq.num_cached_tokens = min(seq.num_cached_tokens, num_tokens)

    def free(self, seq: Sequence) -> None:
        for b in reversed(seq.block_table):
            self.free_blocks.appendleft(b)
        seq.block_table = []
        seq.num_cached_tokens = 0

    def slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size
