"""Drafting with a head that runs on the target's features and keeps a paged KV cache (EAGLE-1,
EAGLE-3, an MTP layer, ...): :class:`HeadDrafter` does everything around the head's forward.

At every ``propose`` the head re-runs the positions verified since the last call with the
target's features (``catch_up``: this overwrites the K/V its own draft steps wrote there, and
catches up on accepted tokens), then drafts ``k`` tokens autoregressively from its own output
(``step``). Rejected drafts need no rollback: their K/V slots are overwritten next time. While
speculation is switched off the engine keeps collecting the target's features, so the head
catches up on every position it missed when it comes back; only if it lacks features for a
position (e.g. its cache ran out of blocks) does the sequence's context restart at the first
position it has features for. Greedy proposes run as one CUDA graph on a GPU
(:mod:`speculant.drafting.head_graph`), sampled ones keep the draft probabilities ``q`` the
lossless verifier needs (:class:`~speculant.drafting.sampling.DraftSampler`).

A strategy subclasses :class:`HeadStrategy` (its hooks), builds its head network, implements
the four :class:`DraftHead` methods and makes its drafter with itself as the head::

    class MyHead(HeadStrategy):
        def __init__(self, config, ctx):
            self.net = ...  # layers from speculant.drafting.heads
            k = self.num_speculative_tokens = config.num_speculative_tokens
            self.drafter = HeadDrafter(
                self, DraftKVCache.for_head(ctx, self.net, k + 1), ctx,
                num_speculative_tokens=k, hidden_size=H, feature_width=H,
                max_positions=ctx.max_model_len + k + 8, name="my-head")

        def catch_up(self, ids, feats, positions, fctx): ...
        def step(self, tokens, x, positions, fctx): ...
        def logits(self, x): ...
        def greedy(self, x): ...
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from speculant import hookimpl
from speculant.drafting import head_graph
from speculant.drafting.graphs import GraphCache, to_device_async
from speculant.drafting.kv_cache import DraftKVCache, SeqCache, cache_slot
from speculant.drafting.lookup import NgramIndex, check_lookup_range
from speculant.drafting.sampling import DraftSampler, row_argmax, split_drafts
from speculant.hookspecs import Strategy
from speculant.models.attention import AttentionMetadata, ForwardContext
from speculant.spec_types import Proposal, SpecBatch, StrategyContext

logger = logging.getLogger("speculant")


class DraftHead(Protocol):
    """What :class:`HeadDrafter` (and its one-graph propose) calls on a head. ``H`` is the width
    of the head's draft state, ``F`` that of the target's features it reads. ``fctx`` carries
    the paged-attention metadata and the :class:`DraftKVCache`'s ``kv_caches``: pass it to the
    head's attention layers (:mod:`speculant.drafting.heads`). Every method must run on the
    device only (no host reads): the greedy ones are captured in CUDA graphs."""

    def catch_up(
        self,
        ids: torch.Tensor,  # [rows] int64: the token at position p + 1 of each row
        feats: torch.Tensor,  # [rows, F] the target's features at position p
        positions: torch.Tensor,  # [rows] int64: p
        fctx: ForwardContext,
    ) -> torch.Tensor:  # [rows, H] draft states: they predict the token at p + 2
        """The head's forward over verified positions, with the target's features. A row's
        output stands in for the target's feature at p + 1 in the next draft step."""
        ...

    def step(
        self,
        tokens: torch.Tensor,  # [rows] int64: the draft just chosen, at position p + 1
        x: torch.Tensor,  # [rows, H] the draft state that chose it (the feature at p)
        positions: torch.Tensor,  # [rows] int64: p
        fctx: ForwardContext,
    ) -> torch.Tensor:  # [rows, H] the next draft state (predicts the token at p + 2)
        """One autoregressive draft step, the head's own state in place of the features."""
        ...

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Draft states [rows, H] -> full-vocabulary logits [rows, vocab] float32 (-inf for
        tokens the head never drafts): what sampled drafting draws from."""
        ...

    def greedy(self, x: torch.Tensor) -> torch.Tensor:
        """Draft states [rows, H] -> [rows] int64 token ids: ``row_argmax(logits(x))``, ties
        included (it may skip the full-vocabulary row, e.g. ``hot_argmax``)."""
        ...

    # optional: a head may define ``greedy_confidence(x) -> (tokens [rows] int64, top [rows]
    # float32)``, ``greedy(x)`` and the probability the head gives that token (softmax of its
    # logits). Only ``confidence_stop`` calls it; without it the drafter uses ``logits(x)``.


@dataclass
class CatchUp:
    """One sequence of a propose call: the positions it catches up on and its drafts."""

    i: int  # index in the batch
    st: SeqCache  # its draft cache
    row: int  # first row of its target features
    count: int  # rows of features (positions verified since the last call)
    start: int  # first position covered
    n: int  # tokens of the sequence
    k: int  # drafts wanted (0: catch up only)


def stage_ints(parts: list, device: torch.device) -> list[torch.Tensor]:
    """int64 tensors of ``parts`` (lists or arrays, flattened) on ``device``: one host array, one
    asynchronous copy, views into it.

    >>> [t.tolist() for t in stage_ints([[1, 2], [[3], [4]]], torch.device("cpu"))]
    [[1, 2], [3, 4]]
    """
    arrs = [np.asarray(p, dtype=np.int64).reshape(-1) for p in parts]
    flat = to_device_async(np.concatenate(arrs), torch.long, device)
    out, o = [], 0
    for a in arrs:
        out.append(flat[o : o + a.size])
        o += a.size
    return out


class HeadDrafter:
    """Proposes with a :class:`DraftHead`: plans each call's catch-up, runs the head over it,
    then ``k`` draft steps (one CUDA graph for greedy batches on a GPU), keeping ``cache``.

    ``hidden_size``: the head's draft-state width H; ``feature_width``: that of the target
    features ``propose`` gets (F); ``max_positions``: the most positions a sequence reaches
    (the graphs' block-table width follows from it); ``name``: for the capture progress bar;
    ``label``: names the head in warnings (default ``name``); ``seed_offset``: added to
    ``ctx.seed`` for the draft sampler's generator."""

    def __init__(
        self,
        head: DraftHead,
        cache: DraftKVCache,
        ctx: StrategyContext,
        *,
        num_speculative_tokens: int,
        hidden_size: int,
        feature_width: int,
        max_positions: int,
        name: str,
        label: str = "",
        seed_offset: int = 15485863,
    ) -> None:
        self.head = head
        self.cache = cache
        self.ctx = ctx
        self.num_speculative_tokens = num_speculative_tokens
        self.hidden_size = hidden_size
        self.feature_width = feature_width
        self.name = name
        self.generator = torch.Generator().manual_seed(ctx.seed + seed_offset)
        self.graphs = GraphCache(ctx.device, label or name, ctx.enforce_eager)
        # block-table width of the captured draft loop: the most blocks a sequence can hold
        self.graph_width = -(-(max_positions + 1) // cache.block_size) + 1
        # tree mode (speculant.drafting.HeadTreeDrafter): propose its trees instead of chains
        self.tree: Any = None
        # the head's HeadOptions.confidence_stop: an eager chain stops a row once the product
        # of its drafts' top probabilities falls under it (None: every row drafts its k)
        self.confidence_stop: float | None = getattr(
            getattr(head, "config", None), "confidence_stop", None)
        if self.confidence_stop is not None and self.graphs.enabled:
            logger.info("%s: confidence_stop applies to eager draft chains; greedy proposes "
                        "captured as CUDA graphs draft all k (enforce_eager=True applies it)",
                        self.name)

    def plan(self, batch: SpecBatch, ahead: int | None = None) -> tuple[list[CatchUp], int]:
        """The sequences of ``batch`` that catch up (their cache reserved up to the last
        position their drafts write) and K, the draft steps of the call: every drafting sequence
        runs K steps (a step of one row depends on that row only); rows that want fewer drafts
        drop the extra ones. A sequence without features right up to its last token is left
        out (it drafts nothing), as is one the cache has no blocks for. ``ahead``: cache
        positions a drafting sequence writes past its context (default ``K - 1``, a chain's;
        a tree's head levels write more: ``HeadTreeDrafter.max_rows``)."""
        row0 = [0, *itertools.accumulate(batch.hidden_counts)]
        ks = [min(s.max_draft, self.num_speculative_tokens) for s in batch.seqs]
        K = max((k for k, c in zip(ks, batch.hidden_counts) if c > 0), default=0)
        plan: list[CatchUp] = []
        for i, s in enumerate(batch.seqs):
            c, start, n = batch.hidden_counts[i], batch.hidden_start[i], s.num_tokens
            if c == 0 or start + c != n - 1:
                continue
            extra = max(0, K - 1) if ahead is None else ahead
            last = n - 2 + extra if ks[i] > 0 else n - 2  # last position written
            st = self.cache.reserve(s.seq_id, start, last)
            if st is not None:
                plan.append(CatchUp(i, st, row0[i], c, start, n, ks[i]))
        return plan, K

    def propose(self, batch: SpecBatch, feats: torch.Tensor | None) -> Proposal:
        """The drafts of ``batch`` from the target's features ``feats`` [rows, F] (the rows of
        ``batch.hidden_counts``, batch order; None: no drafts)."""
        if self.tree is not None:
            return self.tree.propose(batch, feats)
        B = len(batch.seqs)
        none = Proposal(token_ids=[[] for _ in range(B)])
        if feats is None or not B:
            return none
        plan, K = self.plan(batch)
        if not plan:
            return none
        if self.graphs.enabled:  # all greedy and short catch-ups: everything in one CUDA graph
            toks = head_graph.fused_greedy(self, batch, feats, plan, K)  # [drafting, K] or None
            if toks is not None:
                for p in plan:
                    p.st.valid = p.n - 1
                rows = [p for p in plan if p.k > 0]
                ids = [p.i for p in rows]
                drafts = split_drafts(toks, ids, [p.k for p in rows], B, self.graphs)
                return Proposal(token_ids=drafts)
        W = max(len(p.st.table) for p in plan)
        x = self.catch_up(batch, feats, plan, W)  # [drafting sequences, H]
        rows = [p for p in plan if p.k > 0]
        if not rows:
            return none

        # K draft steps, feeding the head's own output back; one device read at the end
        sampler = DraftSampler(
            [batch.seqs[p.i] for p in rows], [p.k for p in rows], self.generator, feats.device
        )
        ks = [p.k for p in rows]
        if sampler.all_greedy and self.graphs.enabled and len(rows) <= 256:
            toks = head_graph.chain_greedy(self, x, rows, K)  # [len(rows), K]
        else:
            bs = self.cache.block_size
            ints = stage_ints([head_graph.chain_ints(rows, K, len(rows), W, bs)], feats.device)
            ctx_lists = [[p.n - p.st.offset + j for p in rows] for j in range(K - 1)]
            choose = None if sampler.all_greedy else sampler  # all greedy: no q to keep
            toks, kept = self.chain(ints[0], x, K, W, choose, ctx_lists,
                                    stop=self.confidence_stop, wanted=ks)  # [len(rows), <= K]
            ks = [min(k, c) for k, c in zip(ks, kept)]
        ids = [p.i for p in rows]
        drafts = split_drafts(toks, ids, ks, B, self.graphs)
        return Proposal(token_ids=drafts, probs=sampler.probs(ids, B, self.ctx.vocab_size))

    def catch_up(
        self,
        batch: SpecBatch,
        feats: torch.Tensor,  # [rows, F] the target's features of the whole batch
        plan: list[CatchUp],
        W: int,  # block-table width: the longest table of the plan
    ) -> torch.Tensor:  # [drafting sequences, H] the draft state of each one's last position
        """The head over every verified position of ``plan`` (one staged copy of the ints), in
        one flat batch; marks those positions valid."""
        bs = self.cache.block_size
        ids, pos, slots, gather = [], [], [], []
        for p in plan:
            ids.extend(batch.seqs[p.i].token_ids[p.start + 1 : p.n])
            for q in range(p.start, p.n - 1):
                pos.append(q)
                slots.append(cache_slot(p.st.table, q - p.st.offset, bs))
            gather.extend(range(p.row, p.row + p.count))
        qlens = [p.count for p in plan]
        ctxs = [p.n - 1 - p.st.offset for p in plan]
        tables = [p.st.table + [0] * (W - len(p.st.table)) for p in plan]
        ends = list(itertools.accumulate(qlens))
        last_active = [ends[a] - 1 for a, p in enumerate(plan) if p.k > 0]
        whole = gather == list(range(feats.shape[0]))
        ids_t, pos_t, slots_t, ctx_t, qsl_t, tab_t, gather_t, last_t = stage_ints(
            [ids, pos, slots, ctxs, [0, *ends], tables, [] if whole else gather, last_active],
            feats.device,
        )
        meta = AttentionMetadata(
            slot_mapping=slots_t,
            block_tables=tab_t.view(len(plan), W).to(torch.int32),
            context_lens=ctx_t.to(torch.int32),
            query_start_loc=qsl_t.to(torch.int32),
            query_lens=qlens,
            context_lens_list=ctxs,
            block_size=bs,
        )
        hidden = (feats if whole else feats[gather_t]).to(self.ctx.dtype)  # [tokens, F]
        fctx = ForwardContext(meta=meta, kv_caches=self.cache.kv_caches)
        out = self.head.catch_up(ids_t, hidden, pos_t, fctx)  # [tokens, H]
        for p in plan:
            p.st.valid = p.n - 1
        return out[last_t] if last_active else out[:0]

    def chain(
        self,
        ints: torch.Tensor,  # [3 * (K - 1) * Bp + Bp + 1 + Bp * W] int64: head_graph.chain_ints
        x: torch.Tensor,  # [Bp, H] the draft state that predicts each row's first draft
        K: int,
        W: int,
        sampler: DraftSampler | None,  # None: every row greedy
        ctx_lists: list[list[int]] | None = None,  # context lengths per step (torch attention)
        stop: float | None = None,  # confidence_stop
        wanted: list[int] | None = None,  # [Bp] drafts each row uses (default K), with stop
    ) -> tuple[torch.Tensor, list[int]]:  # [Bp, steps run] draft tokens, drafts kept per row
        """K draft steps from the draft states ``x``: each step's tokens are ``sampler``'s choice
        from the head's full-vocabulary logits, or with no sampler the head's ``greedy``.

        With ``stop``, row r keeps only its first ``kept[r]`` drafts: those whose running
        product of top probabilities (the softmax of the head's logits, temperature 1, at the
        token it would draft greedily) stays >= ``stop``. The steps end once every row has
        stopped or has its ``wanted`` drafts (one host read per step). The rule reads only the head's outputs, never the
        target's, so verification stays lossless. Without ``stop``, ``kept`` is K per row."""
        Bp, S, bs = x.shape[0], K - 1, self.cache.block_size
        o = 3 * S * Bp
        pos = ints[: S * Bp].view(S, Bp)
        slots = ints[S * Bp : 2 * S * Bp].view(S, Bp)
        ctx = ints[2 * S * Bp : o].view(S, Bp).to(torch.int32)
        qsl = ints[o : o + Bp + 1].to(torch.int32)
        tables = ints[o + Bp + 1 : o + Bp + 1 + Bp * W].view(Bp, W).to(torch.int32)
        out = []
        kept = [K] * Bp
        wanted = wanted or kept
        run = torch.ones(Bp, device=x.device) if stop is not None else None  # [Bp] product
        for j in range(K):
            top = None
            if sampler is None:
                if run is None:
                    tok = self.head.greedy(x)  # [Bp]
                else:
                    tok, top = self._greedy_confidence(x)  # [Bp], [Bp]
            else:
                logits = self.head.logits(x)  # [Bp, vocab]
                tok = sampler(j, logits)  # [Bp]
                if run is not None:
                    top = torch.softmax(logits.float(), dim=-1).amax(dim=-1)  # [Bp]
            out.append(tok)
            if run is not None:
                run = run * top
                for r, low in enumerate((run < stop).tolist()):
                    if low and kept[r] == K:
                        kept[r] = j  # this draft and the later ones are dropped
                if all(c <= j or w <= j + 1 for c, w in zip(kept, wanted)):
                    break
            if j + 1 == K:
                break
            meta = AttentionMetadata(
                slot_mapping=slots[j],
                block_tables=tables,
                context_lens=ctx[j],
                query_start_loc=qsl,
                query_lens=[1] * Bp,
                context_lens_list=ctx_lists[j] if ctx_lists else [W * bs] * Bp,
                block_size=bs,
            )
            fctx = ForwardContext(meta=meta, kv_caches=self.cache.kv_caches)
            x = self.head.step(tok, x, pos[j], fctx)  # [Bp, H]
        return torch.stack(out, dim=1), kept  # [Bp, steps run]

    def _greedy_confidence(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft states [rows, H] -> (greedy tokens [rows] int64, their probability under the
        head [rows] float32): the head's ``greedy_confidence`` when it has one, else from
        ``logits(x)``."""
        own = getattr(self.head, "greedy_confidence", None)
        if own is not None:
            return own(x)
        logits = self.head.logits(x).float()  # [rows, vocab]
        return row_argmax(logits), torch.softmax(logits, dim=-1).amax(dim=-1)

    def capture_graphs(self, max_num_seqs: int, progress: bool) -> int:
        """The ``capture_graphs`` hook: the one-graph greedy proposes and draft-step chains of
        up to ``max_num_seqs`` sequences, captured now on padding inputs (nothing written to the
        cache); in tree mode the tree graphs instead (``HeadTreeDrafter.capture_graphs``: a
        propose's tree levels, one graph per batch bucket). Returns how many were captured."""
        if self.tree is not None:
            return self.tree.capture_graphs(max_num_seqs, progress)
        return head_graph.capture_all(self, max_num_seqs, progress)


class HeadOptions(BaseModel):
    """The options of a :class:`HeadStrategy` (its ``Config``; subclass it to add more):
    ``model``, the head's checkpoint; ``num_speculative_tokens``, k; ``token_map``, a file of
    hot token ids for heads that draft through the target's LM head (``target_hot_head``);
    ``prompt_lookup_min`` / ``prompt_lookup_max``, prompt lookup before the head."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field(..., description="folder (or hub id) of the head's checkpoint")
    num_speculative_tokens: int = Field(5, ge=1, le=64)
    token_map: str | None = Field(
        None,
        description="file of hot token ids (.pt, .json, .npy or .txt; speculant.drafting."
        "load_token_map): the draft's LM head runs over those rows of the target's head only "
        "(FR-Spec)",
    )
    prompt_lookup_min: int | None = Field(
        None,
        ge=1,
        le=64,
        description="prompt lookup before the head: a sequence whose last n tokens (n from "
        "prompt_lookup_max down to prompt_lookup_min) occurred earlier in its prompt or output "
        "proposes the tokens that followed that occurrence (up to k, as the ngram method) "
        "instead of the head's drafts; None: the head's drafts only",
    )
    prompt_lookup_max: int = Field(4, ge=1, le=64, description="longest n-gram looked up")
    confidence_stop: float | None = Field(
        None,
        gt=0.0,
        lt=1.0,
        description="stop a sequence's draft chain once the product of its drafts' "
        "probabilities under the head (the top probability of each step) falls under this: "
        "fewer draft steps and verification rows where the head is unsure (applies where the "
        "chain runs eagerly: the CPU, or enforce_eager; a CUDA-graph propose drafts all k). "
        "None: every chain drafts num_speculative_tokens",
    )

    @model_validator(mode="after")
    def _lookup_order(self) -> HeadOptions:
        check_lookup_range(self.prompt_lookup_min, self.prompt_lookup_max)
        return self


class HeadStrategy(Strategy):
    """Base class of a strategy that drafts with a :class:`DraftHead`: the ``propose``,
    ``on_requests_finished`` and ``capture_graphs`` hooks, handed to ``self.drafter`` (the
    :class:`HeadDrafter` the subclass builds in ``__init__`` with itself as the head). A subclass
    implements the four ``DraftHead`` methods and, if its head reads other features than the
    target's final hidden states, ``features``.

    With ``prompt_lookup_min`` set in its options (:class:`HeadOptions`), a sequence whose
    suffix occurred earlier proposes a chain of the tokens that followed (prompt lookup,
    :class:`~speculant.drafting.NgramIndex`) and the head only catches up on it that step; in a
    batch with sampled head drafts its rows of ``Proposal.probs`` are one-hot (a point-mass
    draft, which the lossless verifier takes as it takes n-gram drafts)."""

    needs_hidden_states = True
    drafter: HeadDrafter

    @functools.cached_property
    def _lookups(self) -> dict[int, NgramIndex]:  # seq_id -> its index (prompt_lookup_min)
        return {}

    def features(self, batch: SpecBatch) -> torch.Tensor | None:
        """The target features of ``batch`` the head reads, ``[rows, F]``; None: no drafts.
        Default: the final hidden states (``batch.hidden_states``); EAGLE-3 reads
        ``batch.aux_hidden_states``."""
        return batch.hidden_states

    @property
    def cache(self) -> DraftKVCache:
        """The drafter's KV cache."""
        return self.drafter.cache

    @property
    def graphs(self) -> GraphCache:
        """The drafter's CUDA graphs (``enabled`` False on the CPU or with ``enforce_eager``)."""
        return self.drafter.graphs

    @hookimpl
    def on_requests_finished(self, seq_ids: list[int]) -> None:
        """Release the finished sequences' blocks of the cache (and their lookup indices)."""
        self.drafter.cache.free(seq_ids)
        for i in seq_ids:
            self._lookups.pop(i, None)

    @hookimpl
    @torch.inference_mode()
    def propose(self, batch: SpecBatch) -> Proposal:
        """The drafter's proposal from ``features(batch)``; with ``prompt_lookup_min``, the
        prompt-lookup chain instead for the sequences that have one."""
        found = self.prompt_lookup(batch)
        if not found:
            return self.drafter.propose(batch, self.features(batch))
        seqs = [dataclasses.replace(s, max_draft=0) if i in found else s
                for i, s in enumerate(batch.seqs)]
        batch = dataclasses.replace(batch, seqs=seqs)  # the head catches up on those only
        return merge_lookups(self.drafter.propose(batch, self.features(batch)), found)

    def prompt_lookup(self, batch: SpecBatch) -> dict[int, list[int]]:
        """``{index in batch: draft}`` for the sequences of ``batch`` whose last n tokens (n in
        [``prompt_lookup_min``, ``prompt_lookup_max``]) occurred earlier: up to k tokens that
        followed the most recent occurrence of the longest. ``{}`` without the option."""
        cfg = getattr(self, "config", None)
        low = getattr(cfg, "prompt_lookup_min", None)
        if low is None:
            return {}
        indices = self._lookups
        k = getattr(self, "num_speculative_tokens", None) or cfg.num_speculative_tokens
        found: dict[int, list[int]] = {}
        for i, s in enumerate(batch.seqs):
            if s.max_draft <= 0:
                continue
            index = indices.get(s.seq_id)
            if index is None:
                index = indices[s.seq_id] = NgramIndex(low, cfg.prompt_lookup_max)
            index.update(s.token_ids)
            draft = index.find(min(s.max_draft, k))
            if draft:
                found[i] = draft
        return found

    @hookimpl
    @torch.inference_mode()
    def capture_graphs(self, max_num_seqs: int, progress: bool) -> int:
        """The drafter's one-graph proposes and chains (tree mode: its tree graphs), captured
        at start-up."""
        return self.drafter.capture_graphs(max_num_seqs, progress)


def merge_lookups(proposal: Proposal, found: dict[int, list[int]]) -> Proposal:
    """``proposal`` with the chains ``found`` (``{index in batch: draft}``, point-mass drafts)
    in place of those sequences' entries; where ``proposal.probs`` holds draft distributions,
    their rows become one-hot (the tensor widened if a chain is longer than its drafts)."""
    probs = proposal.probs  # [batch, max_len, vocab] or None (every draft a point mass)
    if probs is not None:
        longest = max(len(d) for d in found.values())
        if longest > probs.shape[1]:
            wider = probs.new_zeros(probs.shape[0], longest, probs.shape[2])
            wider[:, : probs.shape[1]] = probs
            probs = wider
    for i, draft in found.items():
        proposal.token_ids[i] = draft
        if probs is not None:
            probs[i].zero_()
            rows = torch.arange(len(draft), device=probs.device)
            probs[i, rows, torch.tensor(draft, device=probs.device)] = 1.0
    proposal.probs = probs
    return proposal


__all__ = ["CatchUp", "DraftHead", "HeadDrafter", "HeadOptions", "HeadStrategy", "merge_lookups",
           "stage_ints"]
