"""The draft runner: a draft network's own paged KV cache, kept in step with the target's sequences.

A :class:`DraftRunner` owns a draft model's K/V cache (blocks of ``ctx.block_size`` tokens), a
:class:`DraftState` (block table, cached tokens) per sequence, and the CUDA graphs of its
forwards. It keeps each sequence in step with the target by prefix comparison: at every propose
:meth:`DraftRunner.prepare` compares the tokens whose K/V the draft holds with the sequence's
tokens, rolls the cache back to the common prefix (rejected drafts are always a suffix) and
returns what the draft misses (accepted drafts it never cached, the bonus token, tokens produced
while speculation was off, or a whole sequence that is new or came back after preemption).
:meth:`~DraftRunner.catch_up` feeds those tokens in one flat-batch forward and
:meth:`~DraftRunner.step` feeds one token per sequence; :meth:`~DraftRunner.propose` runs both
for ``k`` draft steps with a strategy's choice of token. On CUDA a greedy propose with short
catch-ups is one CUDA graph replay instead (:meth:`~DraftRunner.propose_greedy`,
``draft_graph.py``). :meth:`~DraftRunner.free` drops finished sequences' state.

The draft model itself is any of speculant's causal LMs: :func:`load_draft_model` loads one from
an HF folder (:func:`load_draft_config` reads its config, :func:`load_draft_tokenizer` its
tokenizer to compare with the target's).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from speculant.drafting import draft_graph
from speculant.drafting.graphs import GraphCache, to_device_async
from speculant.drafting.sampling import split_drafts
from speculant.engine.block_manager import BlockManager
from speculant.engine.cuda_graph import BATCH_BUCKETS, QUERY_BUCKETS, max_prefill_tokens
from speculant.engine.model_runner import ModelRunner, kv_bytes_per_block
from speculant.kernels.logprobs import row_argmax
from speculant.spec_types import SpecSequence, StrategyContext

logger = logging.getLogger("speculant")

_CPU_MAX_KV_BYTES = 1 << 30  # default cap of the draft's KV cache on CPU
_CUDA_FREE_FRACTION = 0.5  # default cap on CUDA: this share of the memory free at construction
_MAX_BATCH, _MAX_QUERY = 128, 16  # ModelRunner's max_graph_batch / max_graph_query defaults


# ----------------------------------------------------------------- loading a draft model
def load_draft_config(folder: Path) -> Any:
    """The transformers ``PretrainedConfig`` of the draft checkpoint in ``folder`` (its
    config.json), e.g. ``load_draft_config(resolve_draft_folder("org/draft"))``. Raises
    ValueError naming the file when it cannot be read."""
    from speculant.models.loader import load_config

    return load_config(folder)


def load_draft_model(
    folder: Path, config: Any, dtype: torch.dtype, device: torch.device, max_len: int
) -> torch.nn.Module:
    """speculant's implementation of the causal LM in ``folder`` (``config`` from
    :func:`load_draft_config`) with its weights, in ``dtype`` on ``device``, its rotary tables
    and graph block tables sized for ``max_len`` positions. The model maps token ids [T] and
    positions [T] to final hidden states [T, hidden]; ``compute_logits`` gives [T, vocab]
    float32 (docs/drafting.md has a runnable example). Raises FileNotFoundError (no weights:
    the files looked for) or ValueError (a truncated or corrupt weight file, a tensor that does
    not fit the config) naming the file."""
    from speculant.distributed import NO_TENSOR_PARALLEL
    from speculant.models.loader import load_model

    # whole on rank 0 under tensor parallelism (a drafter is not sharded)
    return load_model(folder, config, dtype, device, max_len, tp=NO_TENSOR_PARALLEL)


def load_draft_tokenizer(folder: Path) -> Any | None:
    """The tokenizer saved with the draft checkpoint in ``folder`` (a transformers tokenizer),
    or None when the folder holds none (a .gguf or weights-only folder). A draft model must
    share the target's vocabulary: compare ``get_vocab()`` with ``ctx.tokenizer``'s. Raises
    ValueError naming the file when the tokenizer files are there but corrupt."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((folder / f).exists() for f in names):
        return None
    from speculant.models.loader import load_tokenizer

    return load_tokenizer(folder)


# ----------------------------------------------------------------- per-sequence state
class DraftState:
    """The draft cache's view of one sequence: its block table, how many of its positions hold
    K/V (``num_cached_tokens``) and which tokens those are (``tokens``). Owned by the runner;
    strategies only pass it back (:class:`DraftBatch`)."""

    __slots__ = ("block_table", "num_cached_tokens", "tokens", "checked")

    def __init__(self) -> None:
        self.block_table: list[int] = []
        self.num_cached_tokens = 0
        self.tokens: list[int] = []  # token ids whose K/V the draft cache holds, in order
        # leading entries of ``tokens`` known to equal the sequence's tokens (the engine only
        # appends to a sequence): the next comparison starts there
        self.checked = 0


@dataclass
class DraftBatch:
    """The sequences of one propose call that draft, as :meth:`DraftRunner.prepare` left them:
    rolled back to what they share with their sequence, blocks reserved for the catch-up and
    ``k - 1`` fed-back drafts. E.g. ``rows=[0, 2], ks=[3, 3], feeds=[[17, 4], [9]]``: sequences
    0 and 2 of the call draft 3 tokens each, sequence 0's cache misses its last two tokens."""

    num_seqs: int  # sequences in the call, drafting or not
    rows: list[int]  # the call's index of each drafting sequence
    states: list[DraftState]  # the draft cache state of each
    feeds: list[list[int]]  # the tokens each misses (its catch-up), ending with its last token
    ks: list[int]  # drafts each proposes (>= 1)

    def __len__(self) -> int:
        return len(self.rows)


def _common_prefix(a: list[int], b: list[int], start: int = 0) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, given that ``a[:start] ==
    b[:start]`` (only what follows is compared). Called every step with the draft cache's tokens
    and the sequence's, which normally differ only in the last few positions (the rejected
    drafts): one C-speed slice compare up to a few tokens before the end, then a short scan; a
    bisection on slice compares only when they differ earlier."""
    m = min(len(a), len(b))
    lo = min(start, m)
    g = max(lo, m - 8)
    if a[lo:g] == b[lo:g]:
        while g < m and a[g] == b[g]:
            g += 1
        return g
    hi = g  # a[:lo] == b[:lo] and a[:hi] != b[:hi]: bisect on C-speed slice compares
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


# ----------------------------------------------------------------- the runner
class DraftRunner:
    """A draft model's paged KV cache, per-sequence state and forwards (module doc).

    ``model``: a causal LM (:func:`load_draft_model`); ``ctx``: the strategy's context (device,
    block size, ``max_num_seqs``, graph settings); ``dtype``: the model's (and cache's) dtype;
    ``max_len``: positions the draft can hold (proposes stop drafting before it);
    ``num_speculative_tokens``: drafts per step (sizes the graphs captured at start-up);
    ``kv_cache_memory``: bytes for the cache (default ``ctx.kv_cache_memory``, else enough for
    ``max_num_seqs`` sequences of ``max_len``, capped at 1 GiB on CPU and half the free memory
    on CUDA); ``greedy``: the LM head and argmax, final hidden states [rows, hidden] -> tokens
    [rows] int64 (default ``row_argmax(model.compute_logits(h))``; a strategy with a token map
    passes its own), which the one-graph greedy propose captures; ``what``: the graphs' name in
    log messages. Attributes: ``states`` (sequence id -> :class:`DraftState`), ``block_manager``
    (its free blocks), ``graphs`` (the :class:`~speculant.drafting.GraphCache` of the one-graph
    proposes). Methods that run the model expect ``torch.inference_mode()`` (the hooks' own).
    A propose::

        batch = runner.prepare(spec_batch.seqs)
        drafts = runner.propose_greedy(batch)  # one CUDA graph; None: run the eager path
        if drafts is None:
            drafts = runner.propose(batch, lambda hidden, rows, step: greedy(hidden))
    """

    def __init__(
        self,
        model: torch.nn.Module,
        ctx: StrategyContext,
        *,
        dtype: torch.dtype,
        max_len: int,
        num_speculative_tokens: int,
        kv_cache_memory: int | None = None,
        greedy: Callable[[torch.Tensor], torch.Tensor] | None = None,
        what: str = "draft model propose",
    ) -> None:
        self.model = model
        self.device = ctx.device
        self.dtype = dtype
        self.block_size = ctx.block_size
        self.max_len = max_len
        self.num_speculative_tokens = num_speculative_tokens
        if greedy is None:

            def greedy(h: torch.Tensor) -> torch.Tensor:  # [rows, hidden] -> [rows]
                return row_argmax(model.compute_logits(h))

        self.greedy = greedy
        num_blocks = self._num_blocks(kv_cache_memory or ctx.kv_cache_memory, ctx.max_num_seqs)
        self.block_manager = BlockManager(num_blocks, self.block_size)
        # the draft's first feed of a sequence is its prompt plus the target's first token: a
        # prefill graph one token per sequence larger than the target's
        limit = max_prefill_tokens(ctx.max_prefill_graph_tokens)
        self._runner = ModelRunner(
            model,
            num_blocks,
            self.block_size,
            self.device,
            dtype,
            enforce_eager=ctx.enforce_eager,
            max_graph_prefill=limit and limit + ctx.max_num_seqs,
        )
        self.states: dict[int, DraftState] = {}
        # greedy proposes as one CUDA graph replay each (draft_graph.py); off on the CPU
        self.graphs = GraphCache(self.device, what, ctx.enforce_eager)

    @property
    def num_blocks(self) -> int:
        """Blocks of ``block_size`` tokens in the draft's KV cache."""
        return self.block_manager.num_blocks

    @property
    def kv_cache(self) -> torch.Tensor:
        """The whole cache, [num_layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim]."""
        return self._runner.kv_cache

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k_cache, v_cache), each [num_blocks, block_size, kv_heads, head_dim]."""
        return self._runner.kv_caches

    def _num_blocks(self, budget: int | None, max_num_seqs: int) -> int:
        per_block = kv_bytes_per_block(self.model, self.block_size, self.dtype)
        blocks_per_seq = -(-self.max_len // self.block_size)
        if budget is None:
            want = (max_num_seqs * blocks_per_seq + 1) * per_block
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                cap = int(free * _CUDA_FREE_FRACTION)
            else:
                cap = _CPU_MAX_KV_BYTES
            budget = max(min(want, cap), blocks_per_seq * per_block)
        num = int(budget // per_block)
        if num < 1:
            raise ValueError(
                f"the draft KV cache budget ({budget} bytes) holds no block of {self.block_size} "
                f"tokens ({per_block} bytes each); raise kv_cache_memory in speculative_config"
            )
        return num

    # ----------------------------------------------------------------- one propose
    def prepare(self, seqs: list[SpecSequence], k: int | None = None) -> DraftBatch:
        """Sync the draft cache with ``seqs`` before a propose of up to ``k`` drafts each
        (default ``num_speculative_tokens``; fewer where ``max_draft`` or ``max_len`` says so):
        roll each sequence back to the prefix it shares with its tokens, reserve blocks for the
        catch-up and ``k - 1`` fed-back drafts. A sequence gets no drafts (it is not in the
        batch) when it may draft none or the cache is full even after dropping the state of
        sequences not in ``seqs`` (e.g. preempted ones); its state is dropped then."""
        k = self.num_speculative_tokens if k is None else k
        # positions of the cache used: n tokens + (k_i - 1) drafts fed back; keep them < max_len
        ks = [max(0, min(s.max_draft, k, self.max_len - s.num_tokens)) for s in seqs]
        rows: list[int] = []
        feeds: list[list[int]] = []
        in_batch = {s.seq_id for s in seqs}
        for i, (s, n) in enumerate(zip(seqs, ks)):
            if n == 0:
                self.drop(s.seq_id)
                continue
            feed = self._sync(s, n, in_batch)
            if feed is None:
                continue
            rows.append(i)
            feeds.append(feed)
        states = [self.states[seqs[i].seq_id] for i in rows]
        return DraftBatch(len(seqs), rows, states, feeds, [ks[i] for i in rows])

    def propose_greedy(self, batch: DraftBatch) -> list[list[int]] | None:
        """The greedy drafts of every sequence of the call (``[]`` for those not in ``batch``)
        as one CUDA graph replay: the catch-up, then ``k`` steps of ``greedy`` and one-token
        forwards. None when graphs are off (CPU, ``enforce_eager``) or the call does not fit
        (a catch-up longer than the largest query bucket, a batch larger than the largest
        bucket): run :meth:`propose` then. ``batch`` must not be empty."""
        if not self.graphs.enabled:
            return None
        # only what the graph's inputs need runs before the launch, the rest of the bookkeeping
        # while the GPU drafts (before the read-back)
        toks = draft_graph.fused_greedy(self, batch.states, batch.feeds, batch.ks)  # [rows, K]
        if toks is None:
            return None
        self._caught_up(batch)
        drafts = split_drafts(toks, batch.rows, batch.ks, batch.num_seqs, self.graphs)
        self.record_drafts(batch, drafts)
        return drafts

    def propose(
        self,
        batch: DraftBatch,
        choose: Callable[[torch.Tensor, list[int], int], torch.Tensor],
    ) -> list[list[int]]:
        """The drafts of every sequence of the call (``[]`` for those not in ``batch``): the
        catch-up forward, then per step ``j`` ``choose(hidden, rows, j)`` -> tokens [len(rows)]
        int64 on the device, where ``hidden`` [len(rows), hidden] are the final hidden states
        of the batch rows ``rows`` (positions in ``batch``) that still draft, and a one-token
        forward of the chosen tokens for the next step. The tokens stay on the device until one
        read at the end. ``batch`` must not be empty."""
        hidden = self.catch_up(batch)
        cur = list(range(len(batch)))  # rows still drafting
        steps: list[tuple[list[int], torch.Tensor]] = []  # (rows, their tokens [len(rows)])
        step = 0
        while True:
            toks = choose(hidden, cur, step)  # [len(cur)]
            steps.append((cur, toks))
            step += 1
            keep = [m for m, r in enumerate(cur) if batch.ks[r] > step]
            if not keep:
                break
            if len(keep) != len(cur):
                toks = toks[to_device_async(keep, torch.long, self.device)]
                cur = [cur[m] for m in keep]
            hidden = self.step([batch.states[r] for r in cur], toks)
        out = torch.zeros(len(batch), len(steps), dtype=torch.long, device=self.device)
        for j, (rows, toks) in enumerate(steps):  # out [rows, K]
            if len(rows) == len(batch):
                out[:, j] = toks
            else:
                out[to_device_async(rows, torch.long, self.device), j] = toks
        drafts = split_drafts(out, batch.rows, batch.ks, batch.num_seqs)
        self.record_drafts(batch, drafts)
        return drafts

    def catch_up(self, batch: DraftBatch) -> torch.Tensor:
        """Feed each sequence's catch-up tokens (one flat forward, their K/V written) and return
        the final hidden state of each one's last token [len(batch), hidden]: the input of its
        first draft."""
        feeds = batch.feeds
        hidden = self._forward(batch.states, feeds)  # [sum(len(feed)), hidden]
        self._caught_up(batch)
        if any(len(f) != 1 for f in feeds):  # the last row of each sequence's feed
            ends = list(itertools.accumulate(len(f) for f in feeds))
            hidden = hidden[to_device_async([e - 1 for e in ends], torch.long, self.device)]
        return hidden

    def step(self, states: list[DraftState], token_ids: torch.Tensor) -> torch.Tensor:
        """Feed one token per sequence, ``token_ids`` [len(states)] int64 on the device (the
        last drafts), at the next position of each; returns final hidden states
        [len(states), hidden]. Decode steps replay the runner's CUDA graphs on GPU."""
        return self._forward(states, [[0] for _ in states], token_ids)

    def record_drafts(self, batch: DraftBatch, drafts: list[list[int]]) -> None:
        """Note the drafts fed back by :meth:`step` (all but each sequence's last) as cached:
        :meth:`propose` and :meth:`propose_greedy` do; a strategy driving :meth:`catch_up` and
        :meth:`step` itself calls this with the call's drafts (per sequence of the call)."""
        for st, i, k in zip(batch.states, batch.rows, batch.ks):
            st.tokens.extend(drafts[i][: k - 1])

    # ----------------------------------------------------------------- sequences
    def drop(self, seq_id: int) -> None:
        """Free the draft cache of one sequence (no-op when it has none)."""
        st = self.states.pop(seq_id, None)
        if st is not None:
            self.block_manager.free(st)

    def free(self, seq_ids: Iterable[int]) -> None:
        """Free the draft caches of finished sequences (the ``on_requests_finished`` hook)."""
        for i in seq_ids:
            self.drop(i)

    @torch.inference_mode()
    def capture_graphs(self, max_num_seqs: int, progress: bool = True) -> int:
        """Capture now the runner's CUDA graphs for up to ``max_num_seqs`` sequences: its
        forwards (catch-ups of up to k + 1 tokens, one-token steps, each request's first feed:
        its prompt's prefill) and the one-graph greedy proposes (``draft_graph.capture_all``),
        on padding inputs (no K/V written). Returns how many were captured (0 on CPU)."""
        k = self.num_speculative_tokens
        n = self._runner.capture_graphs(max_num_seqs, k + 1, (), None, progress)
        return n + draft_graph.capture_all(self, max_num_seqs, progress)

    def graph_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """(batch buckets, query buckets, block-table width) of the runner's CUDA graphs, where
        it has them (CUDA), else what it would use. The one-graph propose uses the same, so its
        kernels, tilings and split-K choices are those of the eager path."""
        g = self._runner.graphs
        if g is not None:
            return g.buckets, g.q_buckets, g.W
        bs = self.block_size
        width = min(self.num_blocks, -(-(self.max_len + _MAX_QUERY) // bs) + 1)
        batch = tuple(b for b in BATCH_BUCKETS if b <= _MAX_BATCH)
        return batch, tuple(q for q in QUERY_BUCKETS if q <= _MAX_QUERY), width

    # ----------------------------------------------------------------- helpers
    def _caught_up(self, batch: DraftBatch) -> None:
        for st, f in zip(batch.states, batch.feeds):  # the catch-up is queued on the device
            st.tokens.extend(f)
            st.checked = len(st.tokens)  # the sequence's tokens up to its last

    def _sync(self, s: SpecSequence, k: int, in_batch: set[int]) -> list[int] | None:
        """Roll the draft cache of ``s`` back to the prefix it shares with ``s.token_ids`` and
        reserve slots for the catch-up plus ``k - 1`` drafts. Returns the tokens to feed (always
        ending with the sequence's last token), or None when the draft cache is full."""
        st = self.states.get(s.seq_id)
        if st is None:
            st = self.states[s.seq_id] = DraftState()
        toks = s.token_ids
        n = len(toks)
        common = min(_common_prefix(st.tokens, toks, st.checked), n - 1)
        if common < st.num_cached_tokens:
            self.block_manager.rollback(st, common)
            del st.tokens[common:]
        st.checked = common
        need = n + k - 1
        bm = self.block_manager
        # most steps the blocks are there already (BlockManager.blocks_needed, inlined: this
        # runs per sequence while the GPU waits for the draft graph)
        if -(-need // bm.block_size) > len(st.block_table):
            if not bm.can_reserve(st, need):
                # reclaim caches of sequences not running now (e.g. waiting after preemption)
                for sid in [sid for sid in self.states if sid not in in_batch]:
                    self.drop(sid)
            if not bm.can_reserve(st, need):
                logger.debug("draft KV cache full: no drafts for sequence %d this step", s.seq_id)
                self.drop(s.seq_id)
                return None
            bm.reserve(st, need)
        return toks[common:]  # a new list

    def _forward(
        self,
        states: list[DraftState],
        feeds: list[list[int]],
        token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the draft over ``feeds`` (or, with ``token_ids`` [len(states)] on the device, one
        token per sequence from there) and return the final hidden states [tokens, hidden].
        Decode steps replay the CUDA graphs with the ids copied in on the device."""
        graphs = self._runner.graphs
        plan = graphs.plan(states, [len(f) for f in feeds]) if graphs is not None else None
        if plan is not None:
            return graphs.run(states, feeds, (), token_ids, plan)[0]
        if token_ids is not None:  # the eager path builds its inputs on the host
            feeds = [[t] for t in token_ids.tolist()]
        return self._runner.forward(states, feeds)[0]


__all__ = [
    "DraftBatch",
    "DraftRunner",
    "DraftState",
    "load_draft_config",
    "load_draft_model",
    "load_draft_tokenizer",
]
