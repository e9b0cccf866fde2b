"""Continuous batching: admit waiting sequences (prefill) while blocks and seats allow, otherwise
decode every running sequence; preempt (recompute) the newest when blocks run out."""

from __future__ import annotations

from collections import deque

from speculant.engine.block_manager import BlockManager
from speculant.engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preempted_ids: list[int] = []  # since the last call to take_released()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def decode_only(self, lookahead: int) -> bool:
        """True if ``schedule(lookahead)`` will run a decode step of every running sequence,
        admitting none and preempting none (each one's next ``1 + lookahead`` slots fit)."""
        if self.waiting and len(self.running) < self.max_num_seqs:
            return False
        need = sum(self.bm.blocks_needed(s, len(s) + lookahead) for s in self.running)
        return need <= self.bm.num_free_blocks

    def schedule(self, lookahead: int) -> tuple[list[Sequence], bool]:
        """Return (sequences, is_prefill). Decode sequences get cache slots for their next
        ``1 + lookahead`` tokens (lookahead = draft tokens a speculative step may add)."""
        batch: list[Sequence] = []
        tokens = 0
        while self.waiting and len(self.running) + len(batch) < self.max_num_seqs:
            seq = self.waiting[0]
            n = len(seq)
            if batch and tokens + n > self.max_num_batched_tokens:
                break
            if not self.bm.can_reserve(seq, n + lookahead):
                if not batch and not self.running:
                    raise RuntimeError(
                        f"a sequence of {n} tokens does not fit in the whole KV cache "
                        f"({self.bm.num_blocks} blocks of {self.bm.block_size}); raise "
                        "kv_cache_memory / gpu_memory_utilization or lower max_model_len"
                    )
                break
            self.bm.reserve(seq, n)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            batch.append(seq)
            tokens += n
        if batch:
            self.running.extend(batch)
            return batch, True
        scheduled: list[Sequence] = []
        queue = list(self.running)
        while queue:
            seq = queue.pop(0)
            need = len(seq) + lookahead
            while not self.bm.can_reserve(seq, need):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.bm.reserve(seq, need)
                scheduled.append(seq)
        if not scheduled and self.waiting:
            return self.schedule(lookahead)
        return scheduled, False

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.preempted_ids.append(seq.seq_id)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq)
        seq.status = Status.FINISHED

    def take_preempted(self) -> list[int]:
        ids, self.preempted_ids = self.preempted_ids, []
        return ids
