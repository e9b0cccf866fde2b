"""A complete third-party speculant strategy in one file (see docs/plugin_tutorial.md).

``bigram`` proposes, for each sequence, a chain of "most frequent successor" tokens: it counts
which token followed which in the prompt and the text generated so far, then walks that table
from the last token.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from pydantic import BaseModel, ConfigDict, Field

from speculant import Proposal, SpecBatch, StrategyContext, hookimpl
from speculant.hookspecs import Strategy

__version__ = "0.1.0"


class BigramConfig(BaseModel):
    """This strategy's options in ``speculative_config`` (an unknown option is an error)."""

    model_config = ConfigDict(extra="forbid")

    num_speculative_tokens: int = Field(4, ge=1, le=16)
    min_count: int = Field(1, ge=1, description="ignore successors seen fewer times than this")


class BigramStrategy(Strategy):  # the contract: speculant.hookspecs.Strategy
    name = "bigram"  # speculative_config={"method": "bigram", ...}
    Config = BigramConfig

    def __init__(self, config: BigramConfig, ctx: StrategyContext) -> None:
        super().__init__(config, ctx)  # keeps self.config, self.ctx
        # k, read by the engine after __init__: no sequence gets a larger seq.max_draft
        self.num_speculative_tokens = config.num_speculative_tokens
        self.tables: dict[int, defaultdict[int, Counter]] = {}  # seq_id -> token -> successors
        self.counted: dict[int, int] = {}  # seq_id -> tokens of seq.token_ids already counted
        self.calls = 0

    @hookimpl
    def propose(self, batch: SpecBatch) -> Proposal:
        self.calls += 1
        drafts = []
        for seq in batch.seqs:
            table = self.tables.setdefault(seq.seq_id, defaultdict(Counter))
            toks = seq.token_ids  # prompt + generated tokens so far (read-only)
            start = max(self.counted.get(seq.seq_id, 0) - 1, 0)
            for a, b in zip(toks[start:], toks[start + 1 :]):  # the pairs not counted yet
                table[a][b] += 1
            self.counted[seq.seq_id] = len(toks)
            draft, cur = [], toks[-1]
            while len(draft) < seq.max_draft and table[cur]:
                nxt, count = table[cur].most_common(1)[0]
                if count < self.config.min_count:
                    break
                draft.append(nxt)
                cur = nxt
            drafts.append(draft)  # may be empty: no speculation for this sequence this step
        return Proposal(token_ids=drafts)

    @hookimpl
    def on_requests_finished(self, seq_ids: list[int]) -> None:
        # finished, aborted or preempted (a preempted sequence comes back with the same id and
        # all its tokens, and is counted again)
        for seq_id in seq_ids:
            self.tables.pop(seq_id, None)
            self.counted.pop(seq_id, None)


@hookimpl
def register_strategies(register) -> None:
    register(BigramStrategy)
