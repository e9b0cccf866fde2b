"""Oracle speculation, for benchmarks and research: acceptance controlled exactly.

The oracle replays the target's own greedy continuation, recorded in a first (plain, greedy)
pass, and corrupts each proposed token with probability ``1 - alpha`` (seeded). Under greedy
verification a draft position is then accepted with probability ``alpha`` given that the previous
ones were, which is the i.i.d. acceptance model of Leviathan et al. (2211.17192): the mean number
of tokens per target step is ``(1 - alpha^(k+1)) / (1 - alpha)``.

How the corruptions are drawn (``draws``):

* ``"stratified"`` (default): each draft's pattern has exactly the law of independent draws, but
  successive drafts of a sequence are stratified. Under greedy verification only the first
  corrupted position matters (it ends the accepted prefix); the oracle takes it from a Weyl
  sequence ``u_n = frac(u_0 + n / golden ratio)`` (``u_0`` seeded per sequence): the accepted
  prefix is the largest ``j <= L`` (``L``: the draft's length) with ``u_n < alpha^j``, so
  ``P(j >= m) = alpha^m`` exactly as for independent draws, position ``j`` is corrupted, and
  the positions after it are corrupted independently with probability ``1 - alpha``. Over a run the empirical distribution of the
  accepted prefix then matches the truncated geometric law to within O(log n / n) instead of
  O(1 / sqrt(n)): a benchmark of a few dozen steps measures the system, not the luck of its
  draws. (Simulated for 255 tokens at alpha = 0.9, k = 5: with independent draws the realized
  tokens per step fall more than 3% below the formula from the measured acceptance in one run
  of ten.)
* ``"independent"``: every proposed token is corrupted independently (the textbook model).

Proposing costs a list slice and a few random numbers, so the measured speedup isolates the
target's side of speculation while the target still does its real work (every draft is verified
by a real forward pass, and the output is exactly that of plain decoding).

Tree mode (``tree_width`` >= 2, docs/trees.md): each draft is a :class:`DraftTree` of
``tree_width`` siblings per level, as many levels as the sequence's budget (``max_draft`` nodes)
allows. At each level the true token is the sibling of rank ``j`` with probability
``rank_probs[j]`` (default ``alpha * (1 - alpha)^j``), or none of them with the rest; the other
siblings are corrupted tokens, and the next level hangs off the true sibling (off rank 0 when
there is none). Under greedy verification a level is then accepted with probability
``sum(rank_probs)`` given the ones before it, whatever the ranks: a chain at ``alpha =
sum(rank_probs)`` verifies ``k`` tokens for ``k`` levels, a tree ``tree_width`` times fewer
levels for the same count. Draws are independent (``draws`` applies to chains).

The recording is given either inline (``references``) or as a JSON file (``reference_file``),
each entry ``{"prompt_token_ids": [...], "output_token_ids": [...]}``. A sequence is matched to
its reference by its prompt. A sequence with no reference (or past its end) gets no drafts, so it
decodes plainly. ``speculant bench`` records the references itself.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from speculant import hookimpl
from speculant.hookspecs import Strategy
from speculant.spec_types import DraftTree, Proposal, SpecBatch, StrategyContext


class OracleReference(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt_token_ids: list[int] = Field(..., min_length=1)
    output_token_ids: list[int]


class OracleConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_speculative_tokens: int = Field(..., ge=1, le=64)
    alpha: float = Field(..., ge=0.0, le=1.0, description="probability a proposed token is right")
    seed: int = 0
    draws: Literal["stratified", "independent"] = Field(
        "stratified", description="how corruptions are drawn (see the module docstring)")
    references: list[OracleReference] | None = None
    reference_file: str | None = Field(None, description="JSON list of references")
    tree_width: int = Field(1, ge=1, le=63, description="siblings per level of a token tree; "
                            "1: chains (the default)")
    rank_probs: list[float] | None = Field(
        None, description="tree mode: P(the true token is the sibling of rank j), one per rank; "
        "default alpha * (1 - alpha)^j")

    @model_validator(mode="after")
    def _one_source(self) -> OracleConfig:
        if (self.references is None) == (self.reference_file is None):
            raise ValueError("the oracle needs exactly one of `references` (inline) or "
                             "`reference_file` (a JSON file of recorded greedy continuations)")
        return self

    @model_validator(mode="after")
    def _tree(self) -> OracleConfig:
        probs = self.rank_probs
        if probs is None:
            return self
        if self.tree_width == 1:
            raise ValueError("rank_probs is for tree mode: set tree_width >= 2 (one probability "
                             "per sibling rank), or leave rank_probs out for chains")
        if len(probs) != self.tree_width:
            raise ValueError(f"rank_probs has {len(probs)} entries for tree_width="
                             f"{self.tree_width}: give one probability per sibling rank")
        if any(not 0.0 <= p <= 1.0 for p in probs) or sum(probs) > 1.0 + 1e-9:
            raise ValueError(f"rank_probs={probs}: each in [0, 1] and their sum (the "
                             "probability that some sibling is right) at most 1")
        return self

    def tree_rank_probs(self) -> list[float]:
        """P(true token at rank j) of tree mode."""
        if self.rank_probs is not None:
            return list(self.rank_probs)
        return [self.alpha * (1.0 - self.alpha) ** j for j in range(self.tree_width)]

    def load_references(self) -> list[OracleReference]:
        if self.references is not None:
            return self.references
        path = Path(self.reference_file).expanduser()
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"oracle reference_file {path}: {e}") from None
        if not isinstance(data, list):
            raise ValueError(f"oracle reference_file {path}: expected a JSON list of "
                             "{prompt_token_ids, output_token_ids} objects")
        return [OracleReference(**d) for d in data]


_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0  # 1 / golden ratio: the Weyl sequence's step


class OracleStrategy(Strategy):
    name = "oracle"
    Config = OracleConfig

    def __init__(self, config: OracleConfig, ctx: StrategyContext) -> None:
        super().__init__(config, ctx)
        self.num_speculative_tokens = config.num_speculative_tokens
        self.alpha = config.alpha
        self.vocab_size = ctx.vocab_size
        self.rng = random.Random(config.seed)
        # prompt -> full reference sequence (prompt + recorded greedy continuation)
        self.by_prompt: dict[tuple[int, ...], list[int]] = {}
        for r in config.load_references():
            self.by_prompt[tuple(r.prompt_token_ids)] = r.prompt_token_ids + r.output_token_ids
        self._ref: dict[int, list[int] | None] = {}  # seq_id -> its reference (cached lookup)
        self.stratified = config.draws == "stratified"
        self._weyl: dict[int, float] = {}  # seq_id -> its sequence's next point u_n in [0, 1)
        self.num_proposed = 0
        self.num_corrupted = 0
        self.tree_width = config.tree_width
        self.rank_probs = config.tree_rank_probs() if config.tree_width > 1 else []
        self.rank_cum = list(itertools.accumulate(self.rank_probs))  # for the rank draws

    def _reference(self, seq) -> list[int] | None:
        if seq.seq_id not in self._ref:
            self._ref[seq.seq_id] = self.by_prompt.get(tuple(seq.token_ids[: seq.num_prompt_tokens]))
        return self._ref[seq.seq_id]

    def _corrupt(self, token: int) -> int:
        """A token different from ``token``, uniform over the rest of the vocabulary."""
        return (token + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size

    def _accepted_prefix(self, seq_id: int, n: int) -> int:
        """Stratified draws: the accepted-prefix length of this draft of ``n`` tokens, from the
        sequence's next Weyl point ``u`` (the largest j <= n with u < alpha^j)."""
        u = self._weyl.get(seq_id)
        if u is None:
            u = self.rng.random()
        self._weyl[seq_id] = (u + _GOLDEN) % 1.0
        j = 0
        while j < n and u < self.alpha ** (j + 1):
            j += 1
        return j

    def _tree(self, true: list[int], budget: int) -> DraftTree | list[int]:
        """Tree mode's draft over the true continuation ``true`` (module doc). A level's
        corrupted siblings are distinct tokens other than the true one, from one random offset
        (a tree's draw costs two random numbers per level, not one per node)."""
        w = min(self.tree_width, budget)
        levels = min(len(true), budget // w)
        V = self.vocab_size
        ids: list[int] = []
        parents: list[int] = []
        parent = -1
        cum = self.rank_cum[:w]
        for d in range(levels):
            rank = bisect.bisect_right(cum, self.rng.random())  # w: none of the siblings
            t = true[d]
            off = t + 1 + self.rng.randrange(max(V - w, 1))  # corrupted sibling m: off + m (mod V), != t
            level = [(off + m) % V for m in range(w)]
            if rank < w:
                level[rank] = t
                self.num_corrupted += w - 1
            else:
                self.num_corrupted += w
            ids += level
            parents += [parent] * w
            parent = len(ids) - w + (rank if rank < w else 0)
        self.num_proposed += len(ids)
        return DraftTree(ids, parents) if ids else []

    @hookimpl
    def propose(self, batch: SpecBatch) -> Proposal:
        drafts: list[list[int] | DraftTree] = []
        for s in batch.seqs:
            ref = self._reference(s)
            n = len(s.token_ids)
            true = ref[n : n + s.max_draft] if ref is not None else []
            if self.tree_width > 1:
                drafts.append(self._tree(true, s.max_draft) if true else [])
                continue
            # stratified: clean up to the drawn prefix, corrupted at it, independent after it
            first_bad = self._accepted_prefix(s.seq_id, len(true)) if self.stratified and true else -1
            draft = []
            for i, t in enumerate(true):
                bad = (i == first_bad) if i <= first_bad else self.rng.random() >= self.alpha
                if bad:
                    t = self._corrupt(t)
                    self.num_corrupted += 1
                draft.append(t)
            self.num_proposed += len(draft)
            drafts.append(draft)
        return Proposal(token_ids=drafts)

    @hookimpl
    def on_requests_finished(self, seq_ids: list[int]) -> None:
        for i in seq_ids:
            self._ref.pop(i, None)
            self._weyl.pop(i, None)


@hookimpl
def register_strategies(register: Callable[[type], None]) -> None:
    register(OracleStrategy)
