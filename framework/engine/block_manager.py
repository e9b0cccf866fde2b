"""Paged KV cache bookkeeping: fixed-size blocks, per-sequence block tables, a free map.

Placement keeps each sequence's blocks consecutive whenever the free space allows, so that the
CPU attention path can read a sequence's K/V as one slice of the cache (a view, no gather; see
attention.py): a sequence grows into the block right after its last one when that is free, and a
new sequence starts in the middle of the largest free run (the first one at the start of an empty
cache), which leaves room on both sides for the sequences around it to grow. When no such block
is free any free block is taken; correctness never depends on placement.
"""

from __future__ import annotations

from speculant.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = bytearray(b"\x01") * num_blocks  # [num_blocks]: 1 = free
        self._num_free = num_blocks
        self._hint = 0  # where to look first for an arbitrary free block

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    def is_free(self, block: int) -> bool:
        return bool(self._free[block])

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks ``seq`` needs so that ``num_tokens`` positions in total have a slot."""
        need = -(-num_tokens // self.block_size)
        return max(0, need - len(seq.block_table))

    def can_reserve(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self._num_free

    def reserve(self, seq: Sequence, num_tokens: int) -> None:
        """Make sure positions [0, num_tokens) of ``seq`` have cache slots."""
        n = self.blocks_needed(seq, num_tokens)
        if n > self._num_free:
            raise RuntimeError("out of KV cache blocks (the scheduler should have preempted)")
        bt = seq.block_table
        for _ in range(n):
            b = bt[-1] + 1 if bt else self._new_start()
            if not 0 <= b < self.num_blocks or not self._free[b]:
                b = self._any_free()
            self._take(b)
            bt.append(b)

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Keep cache slots for positions [0, num_tokens) only; free the blocks past them."""
        keep = -(-num_tokens // self.block_size)
        while len(seq.block_table) > keep:
            self._give(seq.block_table.pop())
        seq.num_cached_tokens = min(seq.num_cached_tokens, num_tokens)

    def free(self, seq: Sequence) -> None:
        for b in seq.block_table:
            self._give(b)
        seq.block_table = []
        seq.num_cached_tokens = 0

    def slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    # ----------------------------------------------------------------- free map
    def _take(self, b: int) -> None:
        self._free[b] = 0
        self._num_free -= 1

    def _give(self, b: int) -> None:
        self._free[b] = 1
        self._num_free += 1

    def _any_free(self) -> int:
        i = self._free.find(1, self._hint)
        if i < 0:
            i = self._free.find(1)
        self._hint = i + 1 if i + 1 < self.num_blocks else 0
        return i

    def _new_start(self) -> int:
        """First block of a new sequence: the start of an empty cache, else the middle of the
        largest free run (ties: the first)."""
        if self._num_free == self.num_blocks:
            return 0
        best_len = best_start = 0
        i, free, n = 0, self._free, self.num_blocks
        while i < n:
            s = free.find(1, i)
            if s < 0:
                break
            e = free.find(0, s)
            e = n if e < 0 else e
            if e - s > best_len:
                best_len, best_start = e - s, s
            i = e
        return best_start + best_len // 2 if best_len else -1
