"""Request outputs, vLLM-compatible, plus speculation metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class SpecMetrics:
    """Speculation counters for one request (or, aggregated, for a whole run)."""

    num_drafts: int = 0  # speculative steps in which at least one token was proposed
    num_draft_tokens: int = 0  # tokens proposed
    num_accepted_tokens: int = 0  # proposed tokens accepted
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: accepted at position j
    proposed_per_position: list[int] = field(default_factory=list)  # [k]: proposed at position j
    num_spec_steps: int = 0  # decode steps run with speculation on
    num_plain_steps: int = 0  # decode steps run without speculation (disabled or no drafts)
    num_emitted_tokens: int = 0  # tokens emitted by decode steps (accepted + bonus)
    # run-level (LLM.get_metrics() only): times a modifier (batch_size_disable) or the engine's
    # auto_disable controller switched speculation off / back on
    num_times_disabled: int = 0
    num_times_enabled: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target forward in decode steps (1.0 means no gain)."""
        steps = self.num_spec_steps + self.num_plain_steps
        return self.num_emitted_tokens / steps if steps else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_per_position, self.proposed_per_position)]

    def record(self, num_proposed: int, num_accepted: int) -> None:
        if num_proposed > 0:
            self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        grow = num_proposed - len(self.proposed_per_position)
        if grow > 0:
            self.proposed_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for j in range(num_proposed):
            self.proposed_per_position[j] += 1
            if j < num_accepted:
                self.accepted_per_position[j] += 1

    def merge(self, other: SpecMetrics) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_spec_steps += other.num_spec_steps
        self.num_plain_steps += other.num_plain_steps
        self.num_emitted_tokens += other.num_emitted_tokens
        self.num_times_disabled += other.num_times_disabled
        self.num_times_enabled += other.num_times_enabled
        for name in ("accepted_per_position", "proposed_per_position"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if len(theirs) > len(mine):
                mine.extend([0] * (len(theirs) - len(mine)))
            for j, v in enumerate(theirs):
                mine[j] += v

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "accepted_per_position": list(self.accepted_per_position),
            "per_position_acceptance": [round(x, 4) for x in self.per_position_acceptance],
            "num_spec_steps": self.num_spec_steps,
            "num_plain_steps": self.num_plain_steps,
            "num_times_disabled": self.num_times_disabled,
            "num_times_enabled": self.num_times_enabled,
        }


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_output_tokens: int = 0
    spec: SpecMetrics = field(default_factory=SpecMetrics)

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        if self.finished_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)

    # Flat accessors, so ``out.metrics.acceptance_rate`` works.
    def __getattr__(self, name: str):
        if name != "spec" and hasattr(SpecMetrics, name):
            return getattr(self.spec, name)
        raise AttributeError(name)

    def as_dict(self) -> dict:
        return {
            "time_to_first_token": self.time_to_first_token,
            "time_per_output_token": self.time_per_output_token,
            "num_output_tokens": self.num_output_tokens,
            **self.spec.as_dict(),
        }


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
