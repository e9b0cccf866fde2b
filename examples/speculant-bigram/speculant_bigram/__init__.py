"""A complete third-party speculant strategy in one file (see docs/plugin_tutorial.md).

``bigram`` proposes, for each sequence, a chain of "most frequent successor" tokens: it counts
which token followed which in the prompt and the text generated so far, then walks that table
from the last token.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from pydantic import BaseModel, ConfigDict, Field

from speculant import Proposal, SpecBatch, StrategyContext, hookimpl

__version__ = "0.1.0"


class BigramConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_speculative_tokens: int = Field(..., ge=1, le=16)
    min_count: int = Field(1, ge=1, description="ignore successors seen fewer times than this")


class BigramStrategy:
    name = "bigram"
    Config = BigramConfig

    def __init__(self, config: BigramConfig, ctx: StrategyContext) -> None:
        self.config = config
        self.num_speculative_tokens = config.num_speculative_tokens
        self.calls = 0

    @hookimpl
    def propose(self, batch: SpecBatch) -> Proposal:
        self.calls += 1
        drafts = []
        for seq in batch.seqs:
            table: dict[int, Counter] = defaultdict(Counter)
            toks = seq.token_ids
            for a, b in zip(toks, toks[1:]):
                table[a][b] += 1
            draft, cur = [], toks[-1]
            while len(draft) < seq.max_draft and table[cur]:
                nxt, count = table[cur].most_common(1)[0]
                if count < self.config.min_count:
                    break
                draft.append(nxt)
                cur = nxt
            drafts.append(draft)
        return Proposal(token_ids=drafts)


@hookimpl
def register_strategies(register) -> None:
    register(BigramStrategy)
