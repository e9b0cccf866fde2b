"""Turn speculation off while the decode batch is large, and back on when it shrinks.

A modifier (``kind = "modifier"``), not a proposer: the engine registers it next to the chosen
strategy when ``speculative_config`` has ``disable_by_batch_size=N``. Speculation pays off when the
target forward is memory-bound; with many sequences in the batch the extra draft tokens make the
target step compute-bound and speculation stops paying. Semantics follow vLLM's
``speculative_disable_by_batch_size``: speculation is off while the number of running sequences is
**larger than** ``N`` (``N`` itself still speculates). Unlike vLLM, which disables it for new
requests for good, speculation comes back as soon as the batch shrinks to ``N`` or fewer.

While speculation is off the engine runs plain decode steps and does not call ``propose`` at all
(strategies with per-sequence state, like ``draft_model``, catch up on the tokens they missed when
it comes back). Every decision is logged on the ``speculant`` logger (switches at INFO, unchanged
decisions at DEBUG) and counted: ``num_disabled`` / ``num_enabled`` / ``decisions`` here, and the
engine's run metrics (``LLM.get_metrics()``) count switches in ``num_times_disabled`` /
``num_times_enabled`` and plain steps in ``num_plain_steps``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field

from speculant import hookimpl
from speculant.hookspecs import Strategy
from speculant.spec_types import StrategyContext

logger = logging.getLogger("speculant")


class BatchSizeDisableConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    disable_by_batch_size: int = Field(..., ge=1)


class BatchSizeDisable(Strategy):
    name = "batch_size_disable"
    kind = "modifier"
    Config = BatchSizeDisableConfig

    def __init__(self, config: BatchSizeDisableConfig, ctx: StrategyContext | None = None) -> None:
        super().__init__(config, ctx)
        self.threshold = config.disable_by_batch_size
        self.speculating = True
        self.num_disabled = 0  # times this modifier switched speculation off
        self.num_enabled = 0  # times it switched speculation back on
        self.decisions: list[tuple[int, int, bool]] = []  # (old_size, new_size, speculate)

    @hookimpl
    def on_batch_size_change(self, old_size: int, new_size: int) -> bool:
        speculate = new_size <= self.threshold
        self.decisions.append((old_size, new_size, speculate))
        if speculate != self.speculating:
            self.speculating = speculate
            if speculate:
                self.num_enabled += 1
            else:
                self.num_disabled += 1
            logger.info(
                "batch_size_disable: batch size %d -> %d, speculation %s "
                "(disable_by_batch_size=%d)",
                old_size,
                new_size,
                "back on" if speculate else "off",
                self.threshold,
            )
        else:
            logger.debug(
                "batch_size_disable: batch size %d -> %d, speculation stays %s",
                old_size,
                new_size,
                "on" if speculate else "off",
            )
        return speculate

    def stats(self) -> dict:
        return {
            "disable_by_batch_size": self.threshold,
            "num_disabled": self.num_disabled,
            "num_enabled": self.num_enabled,
            "num_decisions": len(self.decisions),
        }


@hookimpl
def register_strategies(register: Callable[[type], None]) -> None:
    register(BatchSizeDisable)
