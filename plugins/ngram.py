"""n-gram speculation (prompt lookup decoding): find the latest earlier occurrence of the
sequence's last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) in the
prompt and generated text, and propose the tokens that followed it. No model, no weights.

The search is an incremental hash index per sequence (:class:`NgramIndex`): every n-gram
(n in [``prompt_lookup_min``, ``prompt_lookup_max``]) maps to the position after its most recent
occurrence, and each step only indexes the tokens appended since the last one, so a lookup costs
a few dictionary probes whatever the sequence length (:func:`find_draft`, the vectorised rescan
of the whole history, is the reference the index is tested against; on a GPU host it cost a
tenth of an 8B decode step at batch 16).

With ``adaptive=True`` (default) each sequence's draft length follows its recent acceptance
(last accepted + 1, at least ``min_draft``, capped at ``num_speculative_tokens``), and after a
draft of which nothing was accepted the sequence proposes nothing for the next 1, 2, 4, ...
tokens (up to ``max_backoff``, reset by the first accepted draft token). A verification pass over
k + 1 tokens costs more than a plain decode step (on the CPU markedly so), so lookups that keep
failing must not run at all. Proposing fewer tokens never changes the output (verification is
lossless).

``min_draft``: when a sequence proposes at all it proposes at least this many tokens. On a GPU a
pass over k + 1 tokens costs about what a decode step costs, so short drafts waste the pass
(default 4 there). On the CPU each extra row costs (a pass over 6 rows costs ~1.8 decode steps
for SmolLM2-135M on one core), so after a failure the draft restarts at 1 token and grows by one
per fully accepted draft (default 1 there).

Tree mode (``tree_branches`` >= 2, docs/trees.md): the continuations of up to ``tree_branches``
earlier occurrences (longest n first, most recent first, each with a different next token) are
proposed together as one :class:`DraftTree`: their common prefixes merged, nodes added level by
level (every branch's first token, then every branch's second, ...) until the sequence's budget
of ``max_draft`` nodes is spent. The first branch is the chain mode's draft. With one
occurrence, or ``tree_branches=1`` (the default), the draft is a chain.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from speculant import hookimpl
from speculant.drafting import NgramIndex, check_lookup_range
from speculant.hookspecs import Strategy
from speculant.spec_types import DraftTree, Proposal, SpecBatch, StrategyContext


class NgramConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_speculative_tokens: int = Field(..., ge=1, le=64)
    prompt_lookup_max: int = Field(4, ge=1, le=64)
    prompt_lookup_min: int = Field(1, ge=1, le=64)
    adaptive: bool = True
    max_backoff: int = Field(16, ge=0, le=4096)  # adaptive: most tokens to skip after failures
    # adaptive: shortest draft proposed (capped at k); None: 1 on the CPU, 4 on an accelerator
    min_draft: int | None = Field(None, ge=1, le=64)
    # tree mode: propose the continuations of up to this many earlier occurrences as the
    # branches of one DraftTree (1: a chain, the default)
    tree_branches: int = Field(1, ge=1, le=16)

    @model_validator(mode="after")
    def _order(self) -> NgramConfig:
        check_lookup_range(self.prompt_lookup_min, self.prompt_lookup_max)
        return self


def merge_branches(branches: list[list[int]], budget: int) -> DraftTree:
    """The branches as one tree: common prefixes shared, nodes added level by level (each
    branch's token at depth 1, then at depth 2, ...) while fewer than ``budget`` exist."""
    ids: list[int] = []
    parents: list[int] = []
    child: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    at = [-1] * len(branches)  # each branch's deepest node so far (-1: the root)
    for d in range(max((len(b) for b in branches), default=0)):
        for j, b in enumerate(branches):
            if d >= len(b) or (d > 0 and at[j] < 0):
                continue  # a branch cut by the budget stays cut
            node = child.get((at[j], b[d]))
            if node is None:
                if len(ids) >= budget:
                    at[j] = -2
                    continue
                node = child[(at[j], b[d])] = len(ids)
                ids.append(b[d])
                parents.append(at[j])
            at[j] = node
    return DraftTree(ids, parents)


class NgramStrategy(Strategy):
    name = "ngram"
    aliases = ("prompt_lookup", "[ngram]")
    Config = NgramConfig

    def __init__(self, config: NgramConfig, ctx: StrategyContext) -> None:
        super().__init__(config, ctx)
        self.num_speculative_tokens = config.num_speculative_tokens
        self._last: dict[int, tuple[int, list[int]]] = {}  # seq_id -> (num_tokens, draft)
        self._k: dict[int, int] = {}  # adaptive draft length per sequence
        self._fails: dict[int, int] = {}  # consecutive drafts with nothing accepted
        self._resume: dict[int, int] = {}  # no proposals until the sequence has this many tokens
        self._index: dict[int, NgramIndex] = {}  # seq_id -> its lookup index
        on_cpu = ctx is None or getattr(ctx, "device", None) is None or ctx.device.type == "cpu"
        self.min_draft = config.min_draft or (1 if on_cpu else 4)

    @hookimpl
    def propose(self, batch: SpecBatch) -> Proposal:
        cfg = self.config
        drafts: list[list[int]] = []
        for s in batch.seqs:
            k = min(
                s.max_draft, self._adapt(s.seq_id, s.token_ids) if cfg.adaptive else s.max_draft
            )
            draft: list[int] | DraftTree = []
            if k > 0:
                index = self._index.get(s.seq_id)
                if index is None:
                    index = self._index[s.seq_id] = NgramIndex(
                        cfg.prompt_lookup_min, cfg.prompt_lookup_max, cfg.tree_branches > 1
                    )
                index.update(s.token_ids)
                if cfg.tree_branches > 1:
                    found = index.find_branches(k, cfg.tree_branches)
                    draft = (merge_branches(found, k) if len(found) > 1
                             else (found[0] if found else []))
                else:
                    draft = index.find(k)
            self._last[s.seq_id] = (len(s.token_ids), draft)
            drafts.append(draft)
        return Proposal(token_ids=drafts)

    def _adapt(self, seq_id: int, tokens: list[int]) -> int:
        k = self._k.get(seq_id, self.num_speculative_tokens)
        last = self._last.get(seq_id)
        if last is not None and last[1]:
            n0, draft = last
            accepted, full = _accepted(draft, tokens[n0:])
            k = min(self.num_speculative_tokens, k + 1 if full else accepted + 1)
            fails = 0 if accepted else self._fails.get(seq_id, 0) + 1
            self._fails[seq_id] = fails
            if fails and self.config.max_backoff:
                self._resume[seq_id] = len(tokens) + min(2 ** (fails - 1), self.config.max_backoff)
        self._k[seq_id] = max(1, min(self.min_draft, self.num_speculative_tokens), k)
        if len(tokens) < self._resume.get(seq_id, 0):
            return 0
        return self._k[seq_id]

    @hookimpl
    def on_requests_finished(self, seq_ids: list[int]) -> None:
        for i in seq_ids:
            self._last.pop(i, None)
            self._k.pop(i, None)
            self._fails.pop(i, None)
            self._resume.pop(i, None)
            self._index.pop(i, None)


def _accepted(draft: list[int] | DraftTree, new: list[int]) -> tuple[int, bool]:
    """How many tokens of ``draft`` (a chain, or a tree's deepest matching path) the tokens
    ``new`` appended after it agree with, and whether the whole draft (a tree: a leaf's path)
    was."""
    if not isinstance(draft, DraftTree):
        accepted = 0
        for a, b in zip(draft, new):
            if a != b:
                break
            accepted += 1
        return accepted, accepted == len(draft)
    node, accepted = -1, 0
    for t in new:
        kids = draft.children(node)
        if not kids:
            return accepted, True
        node = next((c for c in kids if draft.token_ids[c] == t), None)
        if node is None:
            return accepted, False
        accepted += 1
    return accepted, not draft.children(node)


@hookimpl
def register_strategies(register: Callable[[type], None]) -> None:
    register(NgramStrategy)
