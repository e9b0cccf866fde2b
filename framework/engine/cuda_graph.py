"""CUDA graphs of the model forward for decode (1 token per sequence), verification (up to k+1
tokens per sequence) and prefill steps.

One graph per (batch bucket B, rows M, query bucket Q, aux layers, head), replayed for every
step of its shapes. The engine captures the graphs its steps can use at start-up
(``EngineConfig.cuda_graph_capture="startup"``, the default: ``startup_keys`` / ``capture_all``);
any other shape (e.g. a prefill of prompts of at most ``max_query`` tokens, a strategy swapped in
later) is captured on first use. Decode and verification graphs have ``M = B * Q`` rows (any query
lengths up to ``Q``). Prefill graphs (a step in which some sequence feeds more than
``max_query`` tokens, e.g. a prompt) have ``M`` = the step's total token count rounded up to a
``PREFILL_BUCKETS`` size (at most ``max_prefill`` tokens), split among up to ``B = max_batch``
sequences in any way (one graph per token bucket), and ``Q = M``. An eager prefill of a short
prompt is bound by the host's ~300 kernel launches from Python; a replay is not (on an H100,
Llama-3-8B geometry, time to first token of a 128-token prompt: 42 ms eager, 9.2 ms replayed;
``bench/prefill_graphs.py``).

All inputs live in static device buffers that the graphs read: token ids, positions, slot
mapping and tree bits (int64, ``M`` rows), and context lengths, query start offsets and
block tables (int32). A step writes them into pinned host memory and replays the graph: no
device read, no ``.item()``, no per-layer launch. Graphs of up to ``ZERO_COPY_MAX_ROWS`` rows copy
their inputs themselves: the host writes the next slot of a pinned ring (``_stage_ring``) and the
graph's first kernel (kernels/stage_copy.py) reads it over the bus, so between a step's read-back
and the next launch there is no copy or event call (~100 us on the H100 machine); larger steps
fill one pinned staging buffer and copy it with one asynchronous copy (``_stage``). The Triton
paged-attention kernel picks its launch configuration from shapes only (never from tensor
contents), which is what makes it capturable.

Segments: the GPU starts on a graph only when the host's launch call returns, and that call's
cost grows with the graph's kernel nodes (~450-600 for a 32-layer step: 40-70 us on an H100 at
Llama-3-8B scale, 15-24 us for a one-layer segment). A step whose inputs depend
on the previous step's result (a verification step, any synchronous step) leaves the GPU idle
for that time, so each forward is captured as several graphs cut at layer boundaries
(``segment_starts``): the first is one layer long, and the host launches each next segment
while the GPU runs the one before. The segments share one memory pool and are always replayed
in the order they were captured, which is what makes the pool sharing safe.

Head graphs (``head=True``, verification steps of up to ``HEAD_MAX_ROWS`` rows: ``run_head``)
end with the LM head and, for every row, the greedy choice and its log-probability
(``speculant.engine.sampler.greedy_pack``), so that scoring a speculative step launches nothing
from the host after the forward's segments: the greedy verifier reads ``[rows, 2]`` numbers back
and compares them with the drafts on the host. Without them the host launched the LM head and
~10 small verification kernels after the forward (1.0-2.3 ms of host time on the lent H100
machines, and ten times that while such a host stalls: docs/perf.md). A tensor-parallel target
with a vocab-parallel LM head (``decode_head``: each rank multiplies its share of the vocabulary
rows, then an all-gather; docs/tensor_parallel.md) ends these graphs with that head, and its
decode steps replay head graphs too (``ModelRunner.decode``).

Tree graphs (token trees, docs/trees.md): a tree step (``run`` / ``run_head`` with ``tree``)
replays a graph of its own, captured on first use, whose attention reads a static
``tree_bits`` buffer (``[M]`` int64, one row's ancestor bits each); the step's per-row RoPE
positions (``ctx_start + depth``) replace the consecutive ones in the staged inputs, and its bits
travel in the staged inputs' fourth region (``kernels.stage_copy.REGIONS``), so a tree step
stages with no copy of its own. Chains of a tree step have causal bits.

Wide verification steps: a scored step or a tree step of more than ``max_query`` (16) and at
most 64 tokens per sequence (a tree of up to ``MAX_TREE_NODES`` nodes, a chain of up to 63
drafts) replays a decode-shaped graph of a ``WIDE_QUERY_BUCKETS`` query bucket (``plan(...,
wide=True)``), a head graph when its rows fit ``HEAD_MAX_ROWS``; other steps of that length take
prefill-shaped graphs. Tree steps that no graph covers run eagerly.

Padding: a step with ``n <= B`` sequences and ``T <= M`` query tokens (any lengths up to
``Q``, flat in ``query_start_loc`` order) leaves rows ``T..`` as padding: token 0 at position 0
with slot -1 (``store_kv`` skips it), and sequences ``n..`` with context length 0 and an empty
query range (the attention kernel skips them). Padded rows of the output are garbage and dropped.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from speculant.engine.sampler import greedy_pack
from speculant.engine.staging import staging_ext
from speculant.kernels.stage_copy import HEADER, REGIONS, StageLayout, stage_copy
from speculant.models.attention import AttentionMetadata, ForwardContext

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)
# tokens per sequence: decode (1), verification of k drafts (k + 1), draft catch-up (1..k+1)
QUERY_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
# wide verification steps (``plan(..., wide=True)``: scored steps and token trees) of more than
# ``max_query`` tokens per sequence, up to the tree attention's 64 rows (TREE_MAX_ROWS), replay
# decode-shaped (B, B * Q, Q) graphs of these query buckets instead of prefill-shaped ones
WIDE_QUERY_BUCKETS = (24, 32, 48, 64)
# total tokens of a prefill step (each bucket at most 1.5x the one below, 1.25x from 128)
PREFILL_BUCKETS = (32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024,
                   1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096)
# the largest prefill step a graph is captured for (ModelRunner's default; ~25 ms of GPU work
# on the Llama-3-8B geometry, which hides the host's launches anyway); larger ones run eagerly
MAX_PREFILL_TOKENS = 2048


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the duration of a CUDA-graph capture. A
    collection that ran mid-capture could free another CUDA graph (an engine or strategy
    dropped earlier, kept alive by a reference cycle): its destructor's cudaGraphExecDestroy is
    not permitted while a stream captures and invalidates the capture ("operation failed due to
    a previous error during capture"). What is collectable is collected after the capture."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def max_prefill_tokens(value: int | None = None) -> int:
    """The prefill graph limit: ``value`` (``EngineConfig.max_prefill_graph_tokens``) when given,
    else ``MAX_PREFILL_TOKENS``; 0 turns prefill graphs off."""
    if value is None:
        value = MAX_PREFILL_TOKENS
    if value < 0:
        raise ValueError(f"the prefill graph limit must be >= 0 tokens, got {value}")
    return value


def _bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    for b in buckets:
        if b >= n:
            return b
    return None


# steps of up to this many tokens are staged with Python lists (``_fill_small``), larger ones
# with numpy (``_fill``)
SMALL_STAGE_TOKENS = 64
# graphs of up to this many rows (B * Q) read their inputs themselves from a pinned ring buffer
# (kernels/stage_copy.py: no copy or event call between a step's read-back and the next launch);
# larger ones are staged with one host-to-device copy.
ZERO_COPY_MAX_ROWS = 64
STAGE_RING = 8  # slots of that ring: the host waits only when this many launches ahead
# layers in the first captured segment and in each later one (see the module doc)
FIRST_SEGMENT_LAYERS = 1
SEGMENT_LAYERS = 8


def segment_starts(num_layers: int) -> frozenset[int]:
    """Layers at which a new graph segment begins (layer 0 always starts the first)."""
    return frozenset(range(FIRST_SEGMENT_LAYERS, num_layers, SEGMENT_LAYERS))


# verification graphs of up to this many rows (B * Q) can end with the LM head and the greedy
# choice of every row (``head=True``): a scored step then needs no launch from the host after its
# forward's, and its logits buffer ([rows, vocab] fp32: 33 MB at 64 rows of a 128k vocabulary)
# stays small; larger steps compute their logits eagerly after the replay.
HEAD_MAX_ROWS = 64


def _stage_tree(h64, N: int, M: int, tree: tuple[list[int], list[int]]) -> None:
    """Write a tree step's RoPE positions (``[T]``, over the staged consecutive ones) and its
    tree bits (``[T]``, then zeros up to ``M``) into an int64 staging region ``h64``."""
    positions, bits = tree
    T = len(bits)
    h64[N : N + T] = positions
    h64[3 * N : 3 * N + T] = bits
    h64[3 * N + T : 3 * N + M] = 0


@dataclass
class _Graph:
    graphs: list[torch.cuda.CUDAGraph]  # the forward's segments, replayed in this order
    hidden: torch.Tensor  # [B * Q, hidden] static output
    aux: torch.Tensor | None  # [B * Q, n_aux * hidden] static output
    logits: torch.Tensor | None = None  # [B * Q, vocab] float32 static output (head graphs)
    greedy: torch.Tensor | None = None  # [B * Q, 2] float64: each row's argmax and its logprob

    def replay(self) -> None:
        for g in self.graphs:
            g.replay()


class CudaGraphRunner:
    def __init__(
        self,
        model,
        kv_caches,
        block_size: int,
        device: torch.device,
        max_blocks_per_seq: int,
        max_batch: int = 128,
        max_query: int = 16,
        max_prefill: int = 0,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.W = max_blocks_per_seq  # block-table width
        self.buckets = tuple(b for b in BATCH_BUCKETS if b < max_batch) + (max_batch,)
        self.q_buckets = tuple(q for q in QUERY_BUCKETS if q < max_query) + (max_query,)
        self.max_batch = max_batch
        self.max_query = max_query
        # prefill graphs: total-token buckets up to max_prefill (0: none)
        self.p_buckets = tuple(t for t in PREFILL_BUCKETS if t < max_prefill)
        if max_prefill > 0:
            self.p_buckets += (max_prefill,)
        self.max_prefill = max_prefill
        self.max_tokens = max(max_batch * max_query, max_prefill)  # rows of the static buffers
        N, B, W = self.max_tokens, max_batch, self.W
        # int64 region: [ids | positions | slots | tree bits], N each (REGIONS);
        # int32 region: [ctx | qsl | tables]
        self.o32 = (0, B, 2 * B + 1)
        self.len32 = 2 * B + 1 + B * W
        # one pinned staging buffer and one device buffer, each viewed as the int64 region
        # followed by the int32 region: a step stages its inputs with ONE host-to-device copy
        nbytes = 8 * REGIONS * N + 4 * self.len32
        self.host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.dev = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.host64 = self.host[: 8 * REGIONS * N].view(torch.int64)  # [REGIONS * N]
        self.host32 = self.host[8 * REGIONS * N :].view(torch.int32)  # [len32]
        self.np64, self.np32 = self.host64.numpy(), self.host32.numpy()
        self.dev64 = self.dev[: 8 * REGIONS * N].view(torch.int64)  # [REGIONS * N]
        self.dev32 = self.dev[8 * REGIONS * N :].view(torch.int32)  # [len32]
        self.copied = torch.cuda.Event()  # staging may be rewritten once this has passed
        # small steps: a ring of pinned slots, each laid out as [host64 | header] and host32,
        # that the first kernel of their graph copies from (kernels/stage_copy.py)
        pin = device.type == "cuda"
        R = STAGE_RING
        self.ring64 = torch.zeros(R, REGIONS * N + HEADER, dtype=torch.int64, pin_memory=pin)
        self.ring32 = torch.zeros(R, self.len32, dtype=torch.int32, pin_memory=pin)
        self.ack = torch.zeros(R, dtype=torch.int64, pin_memory=pin)  # [R] written by the GPU
        self.err = torch.zeros(1, dtype=torch.int64, pin_memory=pin)  # [1] written by the GPU
        self.count = torch.zeros(1, dtype=torch.int64, device=device)  # [1] launches consumed
        self.ring64_np, self.ring32_np = self.ring64.numpy(), self.ring32.numpy()
        self.ack_np, self.err_np = self.ack.numpy(), self.err.numpy()
        self.launches = 0  # ring launches issued by the host
        self._stage_warm = False
        self.graphs: dict[tuple[int, int, int, tuple[int, ...], bool], _Graph] = {}  # (B, M, Q, aux, head)
        # tree steps: their own graphs (same keys), which read the tree bits of the staged
        # inputs' fourth int64 region (``_stage_ring`` / ``_stage`` write them)
        self.tree_graphs: dict[tuple[int, int, int, tuple[int, ...], bool], _Graph] = {}
        self.tree_bits = self.dev64[3 * N : 4 * N]  # [N]
        self.pool = None
        self.head_rows = HEAD_MAX_ROWS  # verification graphs of up to this many rows are head graphs
        # a tensor-parallel target whose LM head is split by vocabulary (a collective): its head
        # graphs end with ``compute_logits_parallel``, and decode steps replay head graphs too
        # (``decode_head``), so that no logits call runs outside a graph that every rank replays
        self.decode_head = bool(getattr(model, "vocab_parallel", False))

    def release(self) -> None:
        """Destroy every captured graph now, not when the last reference to it goes (a caller
        may still hold this runner). A graph with NCCL collectives in it (a tensor-parallel
        target without the fused all-reduce, or a prefill of more rows than it takes) holds its
        communicator: destroying the process group waits for the graph's end, forever if it
        is still referenced. Replaying after this raises."""
        for table in (self.graphs, self.tree_graphs):
            for g in table.values():
                for seg in g.graphs:
                    seg.reset()
            table.clear()

    # ----------------------------------------------------------------- static views
    def _views(self, B: int, M: int):
        N = self.max_tokens
        c, q, t = self.o32
        ids = self.dev64[0:M]  # [M] token ids
        pos = self.dev64[N : N + M]  # [M] positions
        slots = self.dev64[2 * N : 2 * N + M]  # [M] cache slots, -1 = padding
        ctx = self.dev32[c : c + B]  # [B] context lengths after this step's writes
        qsl = self.dev32[q : q + B + 1]  # [B + 1] query start offsets
        tables = self.dev32[t : t + B * self.W].view(B, self.W)  # [B, W] block tables
        return ids, pos, slots, ctx, qsl, tables

    def plan(self, seqs, query_lens: list[int], wide: bool = False) -> tuple[int, int, int] | None:
        """(B, M, Q) of the graph that runs a step with these sequences and query lengths, or
        None when no graph can (the caller runs it eagerly): more sequences than ``max_batch``,
        a block table wider than the graphs', or a prefill step over ``max_prefill`` tokens.
        ``wide`` (a verification step: scored, or a token tree): a step of more than
        ``max_query`` and at most 64 tokens per sequence takes a decode-shaped (B, B * Q, Q)
        graph of a ``WIDE_QUERY_BUCKETS`` Q when its rows fit the static buffers (a tree's
        attention needs Q <= 64, which a prefill-shaped graph's Q = M breaks at batch > 1)."""
        n, longest = len(seqs), max(query_lens)
        if not 0 < n <= self.max_batch or any(len(s.block_table) > self.W for s in seqs):
            return None
        if longest <= self.max_query:
            B, Q = _bucket(n, self.buckets), _bucket(longest, self.q_buckets)
            return B, B * Q, Q
        if wide:
            Q = _bucket(longest, tuple(q for q in WIDE_QUERY_BUCKETS if q > self.max_query))
            B = _bucket(n, self.buckets)
            if Q is not None and B * Q <= self.max_tokens:
                return B, B * Q, Q
        T = sum(query_lens)
        if T > self.max_prefill:
            return None
        M = _bucket(T, self.p_buckets)
        return self.max_batch, M, M

    # ----------------------------------------------------------------- start-up capture
    def startup_keys(self, max_seqs: int, max_query: int, aux_layers: tuple[int, ...] = (),
                     max_prefill_tokens: int | None = None, head: bool = False) -> list[tuple]:
        """The graph keys (B, M, Q, aux, head) of every step an engine of up to ``max_seqs``
        running sequences can replay when its decode and verification steps feed at most
        ``max_query`` tokens per sequence and its prefill steps at most ``max_prefill_tokens``
        tokens in all: each (batch bucket, query bucket) up to theirs, then each prefill token
        bucket up to that limit (at most ``max_prefill``); with ``head`` (a speculative engine's
        scored steps, ``run_head``) also the head graph of each verification bucket (Q >= 2) of
        at most ``HEAD_MAX_ROWS`` rows, and when ``max_query`` exceeds the runner's, the wide
        graphs of its scored steps (``plan(..., wide=True)``; head graphs where they fit); with
        ``decode_head`` the head graph of each decode bucket (Q = 1) of at most that many rows.
        Prefill steps of prompts no longer than ``max_query`` (which take decode-shaped graphs)
        and tree steps (captured on first use) are not in it."""
        top_b = _bucket(min(max_seqs, self.max_batch), self.buckets)
        top_q = _bucket(min(max_query, self.max_query), self.q_buckets)
        aux = tuple(aux_layers)
        keys = [(B, B * Q, Q, aux, False) for Q in self.q_buckets if Q <= top_q
                for B in self.buckets if B <= top_b]
        # head graphs: scored verification steps (Q >= 2) with ``head``, decode steps (Q = 1)
        # of a vocab-parallel target (``decode_head``)
        keys += [(B, M, Q, aux, True) for B, M, Q, _, _ in keys if self.head_fits(M)
                 and ((head and Q >= 2) or (self.decode_head and Q == 1))]
        if head:
            # scored steps past max_query take wide graphs (``plan(..., wide=True)``)
            wide = tuple(q for q in WIDE_QUERY_BUCKETS if q > self.max_query)
            top_w = _bucket(max_query, wide) if max_query > self.max_query else None
            keys += [(B, B * Q, Q, aux, self.head_fits(B * Q)) for Q in wide
                     if top_w is not None and Q <= top_w
                     for B in self.buckets if B <= top_b and B * Q <= self.max_tokens]
        limit = self.max_prefill if max_prefill_tokens is None else min(self.max_prefill,
                                                                         max_prefill_tokens)
        top_m = _bucket(limit, self.p_buckets) if limit > 0 else None
        if top_m is not None:
            keys += [(self.max_batch, M, M, aux, False) for M in self.p_buckets if M <= top_m]
        return keys

    def head_fits(self, M: int) -> bool:
        """Whether a graph of ``M`` rows may end with the LM head (``self.head_rows``)."""
        return M <= self.head_rows

    def capture_all(self, keys, progress: bool = True) -> int:
        """Capture the graphs of ``keys`` that are not captured yet, each on an empty step (no
        sequence, every row padding: nothing is written to the KV cache), with a progress bar.
        Returns how many were captured."""
        from tqdm.auto import tqdm

        todo = [k for k in dict.fromkeys(keys) if k not in self.graphs]
        for B, M, Q, aux, head in tqdm(todo, desc="Capturing CUDA graphs", unit="graph",
                                       disable=not progress or not todo, dynamic_ncols=True):
            self._stage_empty(B, M)
            self._capture(B, M, Q, aux, head)
        if todo:
            torch.cuda.synchronize(self.device)
        return len(todo)

    def _stage_empty(self, B: int, M: int) -> None:
        """Device buffers of a step with no sequence: ``M`` padding rows (token 0 at position 0,
        slot -1) and ``B`` sequences with context length 0 and empty query ranges."""
        ids, pos, slots, ctx, qsl, tables = self._views(B, M)
        ids.zero_()
        pos.zero_()
        slots.fill_(-1)
        ctx.zero_()
        qsl.zero_()
        tables.zero_()

    # ----------------------------------------------------------------- one step
    def run(
        self,
        seqs,
        new_tokens: list[list[int]],
        aux_layers: tuple[int, ...],
        token_ids: torch.Tensor | None = None,
        plan: tuple[int, int, int] | None = None,
        tree: tuple[list[int], list[int]] | None = None,
    ):
        """Returns (hidden [T, hidden], aux [T, n_aux * hidden] or None), fresh tensors.
        ``tree``: a tree step's (positions [T], tree bits [T]) (module doc).

        ``token_ids`` ([T] int64 on the device, flat in sequence order): the tokens to feed, when
        they are still on the device (e.g. the previous draft step's choices); ``new_tokens``
        then only gives the query lengths (its values are ignored). No device read either way.
        ``plan``: this step's ``plan(...)`` when the caller has it (it must not be None)."""
        g, T = self._replay(seqs, new_tokens, aux_layers, token_ids, plan, False, tree)
        return g.hidden[:T].clone(), (g.aux[:T].clone() if g.aux is not None else None)

    def run_head(
        self,
        seqs,
        new_tokens: list[list[int]],
        aux_layers: tuple[int, ...],
        plan: tuple[int, int, int],
        clone_hidden: bool = True,
        tree: tuple[list[int], list[int]] | None = None,
        token_ids: torch.Tensor | None = None,  # [T] int64 on the device (see ``run``), or None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """``run`` of a step whose graph also computes the logits and the greedy choices (a
        head graph; ``plan``'s rows must satisfy ``head_fits``). Returns (hidden [T, hidden],
        aux [T, n_aux * hidden] or None, logits [T, vocab] float32, greedy [T, 2] float64: each
        row's argmax, lowest index on ties, and its log-probability). ``logits`` and ``greedy``
        are views of the graph's static buffers, valid until this runner's next replay of that
        graph; so are ``hidden`` and ``aux`` unless ``clone_hidden``."""
        g, T = self._replay(seqs, new_tokens, aux_layers, token_ids, plan, True, tree)
        hidden = g.hidden[:T]
        aux = g.aux[:T] if g.aux is not None else None
        if clone_hidden:
            hidden, aux = hidden.clone(), (aux.clone() if aux is not None else None)
        return hidden, aux, g.logits[:T], g.greedy[:T]

    def _replay(self, seqs, new_tokens, aux_layers, token_ids, plan, head: bool,
                tree: tuple[list[int], list[int]] | None = None) -> tuple[_Graph, int]:
        """Stage a step's inputs and replay (capturing first if needed) its graph; returns the
        graph and the step's token count. ``tree``: (positions, bits) of a tree step."""
        query_lens = [len(t) for t in new_tokens]
        T = sum(query_lens)
        B, M, Q = plan or self.plan(seqs, query_lens)
        key = (B, M, Q, tuple(aux_layers), head)
        ring = M <= ZERO_COPY_MAX_ROWS
        graphs = self.graphs if tree is None else self.tree_graphs
        g = graphs.get(key)
        if ring:
            slot = self._stage_ring(seqs, new_tokens, query_lens, B, M,
                                    T if token_ids is not None else 0, tree)
            if g is None:  # the warm-up before the capture reads the device buffers
                self.dev64.copy_(self.ring64[slot, : self.dev64.shape[0]])
                self.dev32.copy_(self.ring32[slot])
        else:
            self._stage(seqs, new_tokens, query_lens, B, M, token_ids is not None, tree)
        if token_ids is not None:  # after the staged placeholder ids (the ring skips them)
            self.dev64[:T].copy_(token_ids)
        g = g or self._capture(*key, tree=tree is not None)
        if ring:
            self.launches += 1  # the launch that consumes the slot: now, never without it
        g.replay()
        return g, T

    def _layout(self, B: int, M: int) -> StageLayout:
        c, q, t = self.o32
        return StageLayout(n_max=self.max_tokens, m=M, c=c, q=q, t=t, b=B, w=self.W)

    def _stage_ring(self, seqs, new_tokens, query_lens, B: int, M: int, ids_on_device: int,
                    tree: tuple[list[int], list[int]] | None = None) -> int:
        """Write this step's inputs into the next ring slot (the graph's first kernel copies
        them); returns the slot. Waits only if the launch that last used the slot has not
        copied it yet (``STAGE_RING`` launches ahead)."""
        if self.err_np[0]:
            raise RuntimeError(
                f"CUDA-graph input staging out of step: launch {int(self.err_np[0])} found a "
                "stale ring slot (a bug: please report it)"
            )
        n = self.launches + 1
        R = self.ring64.shape[0]
        slot = (n - 1) % R
        if n > R and self.ack_np[slot] < n - R:
            torch.cuda.current_stream(self.device).synchronize()
            if self.ack_np[slot] < n - R:
                raise RuntimeError(f"CUDA-graph input staging: launch {n - R} never copied its "
                                   "ring slot (a bug: please report it)")
        h64, h32 = self.ring64_np[slot], self.ring32_np[slot]
        self._fill_small(seqs, new_tokens, query_lens, B, M, ids_on_device > 0, h64, h32)
        N = self.max_tokens
        if tree is not None:  # a tree step: RoPE positions ctx_start + depth, its tree bits
            _stage_tree(h64, N, M, tree)
        h64[REGIONS * N] = n
        h64[REGIONS * N + 1] = ids_on_device
        for s, ql in zip(seqs, query_lens):
            s.num_cached_tokens += ql
        return slot

    def _stage(self, seqs, new_tokens, query_lens, B: int, M: int, on_device: bool = False,
               tree: tuple[list[int], list[int]] | None = None) -> None:
        self.copied.synchronize()  # the previous step's copy has read the staging buffers
        fill = self._fill_small if sum(query_lens) <= SMALL_STAGE_TOKENS else self._fill
        fill(seqs, new_tokens, query_lens, B, M, on_device)
        if tree is not None:  # a tree step: RoPE positions ctx_start + depth, its tree bits
            _stage_tree(self.np64, self.max_tokens, M, tree)
        self.dev.copy_(self.host, non_blocking=True)
        self.copied.record()
        for s, ql in zip(seqs, query_lens):
            s.num_cached_tokens += ql

    def _fill_small(self, seqs, new_tokens, query_lens, B: int, M: int, on_device: bool,
                    h64=None, h32=None) -> None:
        """``_fill`` with Python lists: a few slice writes instead of ~30 numpy calls, which at
        a few tokens per step cost the host ~100 us on the H100 machine (the GPU waits for this
        after every verification step); with the C staging extension (``staging_ext``) the
        same writes in one C pass (``ring_ints``). ``h64`` / ``h32``: where to write (default:
        the staging buffer; a ring slot for ``_stage_ring``)."""
        N, W, bs = self.max_tokens, self.W, self.block_size
        h64 = self.np64 if h64 is None else h64
        h32 = self.np32 if h32 is None else h32
        c, q, t = self.o32
        ext = staging_ext()
        if ext is not None:  # the same writes in one C pass (framework/csrc/staging.c)
            ext.ring_ints(h64, h32, [s.block_table for s in seqs],
                          [s.num_cached_tokens for s in seqs], new_tokens, on_device,
                          N, M, B, W, bs, c, q, t)
            return
        pos: list[int] = []
        slots: list[int] = []
        ctx: list[int] = []
        qsl = [0]
        for i, (s, ql) in enumerate(zip(seqs, query_lens)):
            start, bt = s.num_cached_tokens, s.block_table
            pos.extend(range(start, start + ql))
            slots.extend(bt[p // bs] * bs + p % bs for p in range(start, start + ql))
            ctx.append(start + ql)
            qsl.append(qsl[-1] + ql)
            h32[t + i * W : t + i * W + len(bt)] = bt
        T, n = qsl[-1], len(seqs)
        pad = [0] * (M - T)
        h64[0:M] = ([0] * T if on_device else [x for toks in new_tokens for x in toks]) + pad
        h64[N : N + M] = pos + pad
        h64[2 * N : 2 * N + M] = slots + [-1] * (M - T)
        h32[c : c + B] = ctx + [0] * (B - n)
        h32[q : q + B + 1] = qsl + [T] * (B - n)

    def _fill(self, seqs, new_tokens, query_lens, B: int, M: int, on_device: bool) -> None:
        """Write this step's inputs into the pinned staging buffers (numpy, for many tokens):
        ``B`` sequence rows, ``M`` token rows."""
        N, W = self.max_tokens, self.W
        T = sum(query_lens)
        h64, h32 = self.np64, self.np32
        c, q, t = self.o32
        starts = np.fromiter((s.num_cached_tokens for s in seqs), np.int64, len(seqs))
        qlens = np.asarray(query_lens, dtype=np.int64)
        seq_of = np.repeat(np.arange(len(seqs)), qlens)  # [T] sequence of each token
        qsl = np.zeros(len(seqs) + 1, np.int64)
        np.cumsum(qlens, out=qsl[1:])
        positions = starts[seq_of] + (np.arange(T) - qsl[:-1][seq_of])  # [T]
        tables = h32[t : t + B * W].reshape(B, W)
        for i, s in enumerate(seqs):
            bt = s.block_table
            tables[i, : len(bt)] = bt
        if on_device:
            h64[0:T] = 0  # the caller copies the ids in on the device
        else:
            h64[0:T] = [x for toks in new_tokens for x in toks]
        h64[T:M] = 0
        h64[N : N + T] = positions
        h64[N + T : N + M] = 0
        h64[2 * N : 2 * N + T] = (
            tables[seq_of, positions // self.block_size].astype(np.int64) * self.block_size
            + positions % self.block_size
        )
        h64[2 * N + T : 2 * N + M] = -1
        h32[c : c + len(seqs)] = starts + qlens
        h32[c + len(seqs) : c + B] = 0
        h32[q : q + len(seqs) + 1] = qsl
        h32[q + len(seqs) + 1 : q + B + 1] = T

    # ----------------------------------------------------------------- capture
    def _forward(self, B: int, M: int, Q: int, aux_layers: tuple[int, ...], head: bool = False,
                 on_layer=None, stage=None, tree: bool = False):
        if stage is not None:  # captured first: the graph copies its own inputs in
            stage()
        ids, pos, slots, ctx_lens, qsl, tables = self._views(B, M)
        meta = AttentionMetadata.padded(slots, tables, ctx_lens, qsl, Q, self.block_size,
                                        tree_bits=self.tree_bits[:M] if tree else None)
        ctx = ForwardContext(meta=meta, kv_caches=self.kv_caches, aux_layers=aux_layers,
                             on_layer=on_layer)
        hidden = self.model(ids, pos, ctx)  # [M, hidden]
        aux = torch.cat(ctx.aux_hidden, dim=-1) if ctx.aux_hidden else None
        if not head:
            return hidden, aux, None, None
        if self.decode_head:  # every rank its vocabulary rows, then an all-gather
            logits = self.model.compute_logits_parallel(hidden)  # [M, vocab] float32
        else:
            logits = self.model.compute_logits(hidden)  # [M, vocab] float32
        return hidden, aux, logits, greedy_pack(logits)  # greedy: [M, 2] float64

    def _capture(self, B: int, M: int, Q: int, aux_layers: tuple[int, ...],
                 head: bool = False, tree: bool = False) -> _Graph:
        # the staged inputs of the current step are on the device; a warm-up run on them would
        # write their K/V twice (harmless: same values), and compiles the Triton kernels for
        # these shapes outside the capture
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(B, M, Q, aux_layers, head, tree=tree)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        stage = None
        if M <= ZERO_COPY_MAX_ROWS:
            self._warm_stage_kernel()
            layout = self._layout(B, M)

            def stage() -> None:
                stage_copy(self.ring64, self.ring32, self.dev64, self.dev32, self.count,
                           self.ack, self.err, layout)

        starts = segment_starts(self.model.num_layers)
        graphs = [torch.cuda.CUDAGraph()]

        def next_segment(layer: int) -> None:
            if layer in starts:
                graphs[-1].capture_end()
                graphs.append(torch.cuda.CUDAGraph())
                graphs[-1].capture_begin(pool=self.pool)

        # what torch.cuda.graph() does, with a capture that may end and restart at layer
        # boundaries
        torch.cuda.synchronize(self.device)
        capture_stream = torch.cuda.Stream(self.device)
        with gc_paused(), torch.cuda.stream(capture_stream):
            graphs[0].capture_begin(pool=self.pool)
            try:
                hidden, aux, logits, greedy = self._forward(B, M, Q, aux_layers, head,
                                                            next_segment, stage, tree)
            finally:
                graphs[-1].capture_end()
        torch.cuda.current_stream(self.device).wait_stream(capture_stream)
        g = _Graph(graphs, hidden, aux, logits, greedy)
        (self.tree_graphs if tree else self.graphs)[(B, M, Q, aux_layers, head)] = g
        return g

    def _warm_stage_kernel(self) -> None:
        """Compile and load the staging kernel outside any capture, on throwaway buffers of the
        ring's shapes (its integer arguments are not specialised on: one binary serves all)."""
        if self._stage_warm:
            return
        R, pin = self.ring64.shape[0], True
        ring64 = torch.zeros_like(self.ring64, pin_memory=pin)
        ring64[0, REGIONS * self.max_tokens] = 1  # launch 1 in slot 0
        ring32 = torch.zeros_like(self.ring32, pin_memory=pin)
        ack = torch.zeros(R, dtype=torch.int64, pin_memory=pin)
        err = torch.zeros(1, dtype=torch.int64, pin_memory=pin)
        stage_copy(ring64, ring32, torch.empty_like(self.dev64), torch.empty_like(self.dev32),
                   torch.zeros_like(self.count), ack, err, self._layout(1, 1))
        torch.cuda.synchronize(self.device)
        if int(ack[0]) != 1 or int(err[0]) != 0:
            raise RuntimeError("the CUDA-graph staging kernel failed its warm-up copy (a bug: "
                               "please report it)")
        self._stage_warm = True
