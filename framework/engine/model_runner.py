"""Owns a model and its paged KV cache; runs one flat forward over many sequences.

On CUDA, decode and verification steps (at most ``max_graph_query`` tokens per sequence, at most
``max_graph_batch`` sequences; scored verification steps and token trees up to 64 tokens per
sequence: ``CudaGraphRunner.plan``'s ``wide``) and prefill steps of at most ``max_graph_prefill`` tokens replay
CUDA graphs (:mod:`speculant.engine.cuda_graph`); larger prefills and everything on the CPU run
eagerly. ``enforce_eager=True`` turns graphs off.
"""

from __future__ import annotations

import torch

from speculant.distributed import setup_fused_all_reduce
from speculant.engine.sampler import greedy_pack
from speculant.engine.sequence import Sequence
from speculant.engine.tree_compaction import CompactionGraphs
from speculant.kernels.paged_attention import TREE_MAX_ROWS
from speculant.kernels.tree_kv import tree_row_bits, tree_row_depths
from speculant.models.attention import AttentionMetadata, ForwardContext


def tree_step_rows(seqs: list[Sequence], query_lens: list[int],
                   trees: list[list[int] | None]) -> tuple[list[int], list[int]]:
    """The RoPE positions and tree bits (``AttentionMetadata.tree_bits``) of every row of a tree
    step: a sequence with ``parents`` feeds its root and nodes at ``num_cached_tokens + depth``
    with its ancestor bits (``kernels.tree_kv``); any other sequence is a chain (causal bits)."""
    positions: list[int] = []
    bits: list[int] = []
    for s, q, parents in zip(seqs, query_lens, trees):
        if parents is None:
            parents = list(range(-1, q - 2))  # a chain of q - 1 drafts
        if len(parents) + 1 != q:
            raise ValueError(f"a tree step's sequence feeds {q} rows for a tree of "
                             f"{len(parents)} nodes (the root and one row per node)")
        depths, row_bits = _tree_rows(tuple(parents))
        c0 = s.num_cached_tokens
        positions.extend([c0 + d for d in depths])
        bits.extend(row_bits)
    return positions, bits


_TREE_ROWS: dict[tuple[int, ...], tuple[list[int], list[int]]] = {}


def _tree_rows(parents: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """(row depths, row bits) of a tree shape, remembered: a strategy's trees mostly repeat a
    few shapes (static trees, the oracle's), and building them cost ~15 us a step on the H100
    machine's host."""
    got = _TREE_ROWS.get(parents)
    if got is None:
        if len(_TREE_ROWS) >= 1024:
            _TREE_ROWS.clear()
        got = _TREE_ROWS[parents] = (tree_row_depths(list(parents)), tree_row_bits(list(parents)))
    return got


def kv_bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
    nkv, d = model.kv_cache_shape()
    return 2 * model.num_layers * block_size * nkv * d * torch.empty(0, dtype=dtype).element_size()


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, enforce_eager: bool = False, max_graph_batch: int = 128,
                 max_graph_query: int = 16, max_graph_prefill: int | None = None) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        nkv, d = model.kv_cache_shape()
        # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_cache = torch.zeros(model.num_layers, 2, num_blocks, block_size, nkv, d,
                                    dtype=dtype, device=device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(model.num_layers)]
        # the sharded target, on every rank (a collective); never a drafter: it is whole
        # (model.tp size 1) and runs on rank 0 alone
        if getattr(getattr(model, "tp", None), "enabled", False) and device.type == "cuda":
            setup_fused_all_reduce(model.config.hidden_size, dtype, device)
        self.graphs = None
        self.compactions: CompactionGraphs | None = None  # tree steps' K/V moves
        if device.type == "cuda" and not enforce_eager:
            from speculant.engine.cuda_graph import CudaGraphRunner, max_prefill_tokens

            max_len = getattr(model, "max_positions", None) or 4096
            width = min(num_blocks, -(-(max_len + max_graph_query) // block_size) + 1)
            self.graphs = CudaGraphRunner(model, self.kv_caches, block_size, device, width,
                                          max_graph_batch, max_graph_query,
                                          max_prefill_tokens(max_graph_prefill))

    def capture_graphs(self, max_seqs: int, max_query: int, aux_layers: tuple[int, ...] = (),
                       max_prefill_tokens: int | None = None, progress: bool = True,
                       head: bool = False) -> int:
        """Capture now the CUDA graphs of every decode, verification (up to ``max_query`` tokens
        per sequence) and prefill step (up to ``max_prefill_tokens`` tokens) this runner can
        replay for up to ``max_seqs`` sequences (``CudaGraphRunner.startup_keys``; ``head``:
        the scored verification steps' graphs too, see ``score``), instead of on each shape's
        first step. Returns how many were captured (0 without CUDA graphs)."""
        if self.graphs is None:
            return 0
        with torch.inference_mode():
            keys = self.graphs.startup_keys(max_seqs, max_query, tuple(aux_layers),
                                            max_prefill_tokens, head)
            return self.graphs.capture_all(keys, progress)

    @torch.inference_mode()
    def forward(
        self,
        seqs: list[Sequence],
        new_tokens: list[list[int]],
        aux_layers: tuple[int, ...] = (),
        token_ids: torch.Tensor | None = None,  # [num_tokens] int64 on the device, or None
        trees: list[list[int] | None] | None = None,  # per sequence: its tree's parents, or None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed ``new_tokens[i]`` at positions ``seqs[i].num_cached_tokens ...`` (their K/V are
        written to the cache) and return the final hidden states ``[num_tokens, hidden]`` and, if
        ``aux_layers`` is set, the residual stream entering those layers ``[num_tokens, n*hidden]``.
        ``token_ids``: the tokens to feed when they are still on the device (flat, in sequence
        order); ``new_tokens`` then only gives the query lengths.
        ``trees`` (a tree step, docs/trees.md): for a sequence with ``parents`` there,
        ``new_tokens[i]`` is the root then the tree's nodes; each row's K/V goes to the next
        slot as usual, but its RoPE position is ``num_cached_tokens + depth`` and it attends to
        the context, its ancestors and itself only (``tree_bits``). Tree steps replay tree
        graphs where chain verification steps replay graphs (``CudaGraphRunner``, "Tree graphs").
        """
        query_lens = [len(t) for t in new_tokens]
        is_tree = trees is not None and any(t is not None for t in trees)
        tree = tree_step_rows(seqs, query_lens, trees) if is_tree else None
        g = self.graphs
        plan = g.plan(seqs, query_lens, wide=is_tree) if g is not None else None
        if plan is not None and (tree is None or plan[2] <= TREE_MAX_ROWS):
            kw = {"tree": tree} if tree is not None else {}
            return self.graphs.run(seqs, new_tokens, tuple(aux_layers), token_ids, plan, **kw)
        ctx_lens = [s.num_cached_tokens + q for s, q in zip(seqs, query_lens)]
        flat = [t for toks in new_tokens for t in toks]
        bits = None
        if tree is not None:
            positions, bits = tree
        else:
            positions = [p for s, q in zip(seqs, query_lens)
                         for p in range(s.num_cached_tokens, s.num_cached_tokens + q)]
        meta = AttentionMetadata.build(query_lens, ctx_lens, [s.block_table for s in seqs],
                                       self.block_size, self.device, tree_bits=bits)
        ctx = ForwardContext(meta=meta, kv_caches=self.kv_caches, aux_layers=tuple(aux_layers),
                             kv_cache=self.kv_cache if self.device.type == "cpu" else None)
        ids = (token_ids if token_ids is not None
               else torch.tensor(flat, dtype=torch.long, device=self.device))
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(ids, pos, ctx)
        for s, q in zip(seqs, query_lens):
            s.num_cached_tokens += q
        aux = torch.cat(ctx.aux_hidden, dim=-1) if ctx.aux_hidden else None
        return hidden, aux

    @torch.inference_mode()
    def score(
        self,
        seqs: list[Sequence],
        new_tokens: list[list[int]],
        aux_layers: tuple[int, ...] = (),
        greedy: bool = False,
        keep_hidden: bool = True,
        trees: list[list[int] | None] | None = None,  # per sequence: its tree's parents, or None
        token_ids: torch.Tensor | None = None,  # [num_tokens] int64 on the device, or None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """``forward`` (``trees``: a tree step, see there) plus the logits of every row: (hidden [T, hidden], aux [T, n_aux * hidden]
        or None, logits [T, vocab] float32, greedy [T, 2] float64 or None). ``greedy`` holds each
        row's argmax (lowest index on ties) and its log-probability
        (:func:`speculant.engine.sampler.greedy_pack`).

        A verification step that a CUDA graph of at most ``HEAD_MAX_ROWS`` rows can run replays
        a head graph: the LM head and the greedy pack are inside it, so nothing more is launched
        from the host, and ``greedy`` is always returned. Its ``logits`` and ``greedy`` (and
        ``hidden`` / ``aux`` unless ``keep_hidden``) are views of the graph's buffers, valid until
        this runner's next forward. Any other step runs ``forward`` and the LM head eagerly, and
        computes ``greedy`` only when asked. A vocab-parallel target (``graphs.decode_head``)
        replays head graphs for one-token steps too. ``token_ids``: as in ``forward``."""
        query_lens = [len(t) for t in new_tokens]
        g = self.graphs
        is_tree = trees is not None and any(t is not None for t in trees)
        plan = g.plan(seqs, query_lens, wide=True) if g is not None else None
        if (plan is not None and (2 <= plan[2] or g.decode_head) and plan[2] <= TREE_MAX_ROWS
                and g.head_fits(plan[1])):
            kw = {"tree": tree_step_rows(seqs, query_lens, trees)} if is_tree else {}
            return g.run_head(seqs, new_tokens, tuple(aux_layers), plan, keep_hidden,
                              token_ids=token_ids, **kw)
        hidden, aux = self.forward(seqs, new_tokens, aux_layers, token_ids=token_ids, trees=trees)
        logits = self.logits(hidden)
        return hidden, aux, logits, (greedy_pack(logits) if greedy else None)

    def decode(
        self,
        seqs: list[Sequence],
        new_tokens: list[list[int]],  # one token per sequence
        aux_layers: tuple[int, ...] = (),
        token_ids: torch.Tensor | None = None,  # [num_seqs] int64 on the device, or None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """A decode step: (hidden [n, hidden], aux [n, n_aux * hidden] or None, logits [n, vocab]
        float32), as ``forward`` then ``logits``. A vocab-parallel target replays a head graph
        instead (``score``; its LM head is a collective, so it runs inside a graph that every
        rank replays); ``logits`` is then a view of the graph's buffer, valid until the next
        forward."""
        if self.graphs is not None and self.graphs.decode_head:
            hidden, aux, logits, _ = self.score(seqs, new_tokens, aux_layers, token_ids=token_ids)
            return hidden, aux, logits
        hidden, aux = self.forward(seqs, new_tokens, aux_layers, token_ids=token_ids)
        return hidden, aux, self.logits(hidden)

    @torch.inference_mode()
    def compact_tree(self, seqs: list[Sequence], ctx_starts: list[int],
                     paths: list[list[int]]) -> None:
        """After a tree step: move the K/V of each sequence's accepted nodes (``paths[i]``,
        in-step rows >= 1, increasing) to the positions right after its root at
        ``ctx_starts[i]``, in every layer (``kernels.tree_kv.compact_tree_kv``; with CUDA graphs
        a replay of ``engine.tree_compaction``'s). Sequences whose path is already in place need
        not be passed."""
        if not seqs:
            return
        if self.compactions is None:
            self.compactions = CompactionGraphs(self.kv_cache, self.graphs.W if self.graphs else 0)
        tables = [s.block_table for s in seqs]
        # with CUDA graphs a replay (no launch or copy call), else one pinned copy and a launch
        if self.graphs is None or not self.compactions.run(tables, ctx_starts, paths):
            self.compactions.eager(tables, ctx_starts, paths)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.model.compute_logits(hidden)  # [rows, vocab] float32
