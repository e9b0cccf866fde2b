"""Request outputs, vLLM-compatible, plus speculation metrics.

Every metric is defined in docs/metrics.md. Besides our own fields, the metrics offer vLLM's
shapes: iterating ``LLM.get_metrics()`` yields vLLM V1-style metric objects (``Counter``,
``Vector``, ... as in ``vllm.v1.metrics.reader``; also importable from ``speculant.metrics``)
with vLLM's names and definitions, and ``RequestOutput.metrics.spec_token_acceptance_counts``
is vLLM V0's per-request list."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field


# ----------------------------------------------------------------- vLLM V1-style metric objects
@dataclass
class Metric:
    """A named metric, as vLLM's ``vllm.v1.metrics.reader.Metric`` (what iterating
    ``LLM.get_metrics()`` yields). ``labels`` is empty here: one engine, one model."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A monotonically increasing integer counter."""

    value: int


@dataclass
class Vector(Metric):
    """An ordered array of integer counters (vLLM's type for
    ``vllm:spec_decode_num_accepted_tokens_per_pos``; one entry per draft position)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    """A numerical value that can go up or down."""

    value: float


@dataclass
class Histogram(Metric):
    """Observations in buckets (upper limit -> count, '+Inf' included), their count and sum."""

    count: int
    sum: float
    buckets: dict[str, int]


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class SpecMetrics:
    """Speculation counters for one request (``RequestOutput.metrics.spec``) or, aggregated, for
    a whole run (``LLM.get_metrics()``). Counts are per sequence-step: a decode step of a batch of
    8 sequences counts 8 steps. Definitions: docs/metrics.md.

    Iterating it yields vLLM V1-style ``Metric`` objects (``vllm:spec_decode_num_drafts``, ...;
    see ``vllm_metrics()``), so vLLM code that loops over ``llm.get_metrics()`` runs as written;
    attribute access and ``as_dict()`` are ours."""

    num_drafts: int = 0  # sequence-steps that verified >= 1 draft token (vLLM's num_drafts)
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # draft tokens accepted (before any stop rule cuts them)
    # [j]: accepted at position j (a tree: accepted paths that reached depth j + 1)
    accepted_per_position: list[int] = field(default_factory=list)
    # [j]: verified at position j (a tree: steps whose tree had a node at depth j + 1)
    proposed_per_position: list[int] = field(default_factory=list)
    # sequence-steps that verified a token tree (docs/trees.md); they count in num_drafts too,
    # with every node in num_draft_tokens
    num_tree_drafts: int = 0
    num_spec_steps: int = 0  # sequence decode steps inside a verification batch
    num_plain_steps: int = 0  # sequence decode steps without verification (off, or no drafts)
    num_emitted_tokens: int = 0  # tokens appended by decode steps (accepted + bonus, after stops)
    num_prefill_steps: int = 0  # sequence prefills (each emits one token); not a decode step
    num_speculative_tokens: int = 0  # k, the configured draft length (0: not known)
    # run-level (LLM.get_metrics() only): times a modifier (batch_size_disable) or the engine's
    # auto_disable controller switched speculation off / back on
    num_times_disabled: int = 0
    num_times_enabled: int = 0
    # faults of a plugin (a bad proposal, a hook that raised; docs/hooks.md "Faults"): contained,
    # each cost its sequences their drafts (per request: this request's; per run: all of them)
    num_faults: int = 0
    # run-level: False when the verifier (or the strategy) is not lossless (hookspecs
    # Strategy.lossless): outputs may differ from plain decoding
    lossless: bool = True

    @property
    def acceptance_rate(self) -> float:
        """num_accepted_tokens / num_draft_tokens (vLLM's draft acceptance rate)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """vLLM's mean acceptance length: 1 + num_accepted_tokens / num_drafts, the tokens a
        step that drafted yields (the bonus token included); 1.0 if nothing was drafted. Steps
        without drafts do not count: see ``tokens_per_step`` for the mean over every step."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def num_decode_steps(self) -> int:
        """Sequence decode steps: num_spec_steps + num_plain_steps."""
        return self.num_spec_steps + self.num_plain_steps

    @property
    def tokens_per_step(self) -> float:
        """Tokens emitted per sequence decode step, drafting or not: num_emitted_tokens /
        num_decode_steps (1.0 means no gain; 0.0 before any decode step). The figure the
        speedup follows (this was ``mean_accepted_length`` before it took vLLM's definition)."""
        steps = self.num_decode_steps
        return self.num_emitted_tokens / steps if steps else 0.0

    @property
    def draft_fraction(self) -> float:
        """Fraction of sequence decode steps that drafted: num_drafts / num_decode_steps."""
        steps = self.num_decode_steps
        return self.num_drafts / steps if steps else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """[j]: accepted / verified at draft position j (ours: conditional on a draft reaching
        position j; vLLM's per-position rate divides by num_drafts instead)."""
        return [a / p if p else 0.0
                for a, p in zip(self.accepted_per_position, self.proposed_per_position)]

    def _per_position(self, values: list[int]) -> list[int]:
        """``values`` padded with zeros to k positions (vLLM's vectors always have k)."""
        return list(values) + [0] * (self.num_speculative_tokens - len(values))

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

    def record_tree(self, num_nodes: int, depth: int, num_accepted: int) -> None:
        """One verified token tree of ``num_nodes`` nodes, ``depth`` deep, whose accepted path
        has ``num_accepted`` nodes: the per-position vectors count depths (acceptance by depth)."""
        if num_nodes > 0:
            self.num_drafts += 1
            self.num_tree_drafts += 1
        self.num_draft_tokens += num_nodes
        self.num_accepted_tokens += num_accepted
        grow = depth - len(self.proposed_per_position)
        if grow > 0:
            self.proposed_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for j in range(depth):
            self.proposed_per_position[j] += 1
            if j < num_accepted:
                self.accepted_per_position[j] += 1

    def merge(self, other: SpecMetrics) -> None:
        self.num_drafts += other.num_drafts
        self.num_tree_drafts += other.num_tree_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_spec_steps += other.num_spec_steps
        self.num_plain_steps += other.num_plain_steps
        self.num_emitted_tokens += other.num_emitted_tokens
        self.num_prefill_steps += other.num_prefill_steps
        self.num_speculative_tokens = max(self.num_speculative_tokens, other.num_speculative_tokens)
        self.num_times_disabled += other.num_times_disabled
        self.num_times_enabled += other.num_times_enabled
        self.num_faults += other.num_faults
        self.lossless = self.lossless and other.lossless
        for name in ("accepted_per_position", "proposed_per_position"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if len(theirs) > len(mine):
                mine.extend([0] * (len(theirs) - len(mine)))
            for j, v in enumerate(theirs):
                mine[j] += v

    # ------------------------------------------------------------- vLLM V1's shape
    def vllm_metrics(self) -> list[Metric]:
        """These counters as vLLM V1's ``LLM.get_metrics()`` lists them: ``vllm:`` names with
        vLLM's definitions, then ours (``speculant:`` names). Per-position vectors have
        ``num_speculative_tokens`` entries (more if a draft was longer)."""
        def c(name: str, value: int) -> Counter:
            return Counter(name=name, labels={}, value=int(value))

        def v(name: str, values: list[int]) -> Vector:
            return Vector(name=name, labels={}, values=self._per_position(values))

        return [
            c("vllm:spec_decode_num_drafts", self.num_drafts),
            c("vllm:spec_decode_num_draft_tokens", self.num_draft_tokens),
            c("vllm:spec_decode_num_accepted_tokens", self.num_accepted_tokens),
            v("vllm:spec_decode_num_accepted_tokens_per_pos", self.accepted_per_position),
            v("speculant:spec_decode_num_draft_tokens_per_pos", self.proposed_per_position),
            c("speculant:spec_decode_num_spec_steps", self.num_spec_steps),
            c("speculant:spec_decode_num_plain_steps", self.num_plain_steps),
            c("speculant:spec_decode_num_emitted_tokens", self.num_emitted_tokens),
            c("speculant:spec_decode_num_times_disabled", self.num_times_disabled),
            c("speculant:spec_decode_num_times_enabled", self.num_times_enabled),
        ]

    def __iter__(self) -> Iterator[Metric]:
        return iter(self.vllm_metrics())

    def __len__(self) -> int:
        return len(self.vllm_metrics())

    def __getitem__(self, i):
        return self.vllm_metrics()[i]

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_tree_drafts": self.num_tree_drafts,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "tokens_per_step": round(self.tokens_per_step, 4),
            "draft_fraction": round(self.draft_fraction, 4),
            "accepted_per_position": list(self.accepted_per_position),
            "per_position_acceptance": [round(x, 4) for x in self.per_position_acceptance],
            "num_spec_steps": self.num_spec_steps,
            "num_plain_steps": self.num_plain_steps,
            "num_emitted_tokens": self.num_emitted_tokens,
            "num_times_disabled": self.num_times_disabled,
            "num_times_enabled": self.num_times_enabled,
            "num_faults": self.num_faults,
            "lossless": self.lossless,
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

    @property
    def spec_token_acceptance_counts(self) -> list[int]:
        """vLLM V0's ``RequestMetrics.spec_token_acceptance_counts``: k + 1 entries, [0] the
        steps that emitted a token for this request (its prefill and every decode step), [i]
        for i >= 1 the steps whose draft token at position i - 1 was accepted (so
        ``sum(counts) / counts[0]`` is V0's mean acceptance length over all steps). ``[0]``
        without speculation, as in V0. With n > 1 the request's sequences add up."""
        s = self.spec
        if not s.num_speculative_tokens and not s.num_decode_steps:
            return [0]
        steps = s.num_prefill_steps + s.num_decode_steps
        return [steps, *s._per_position(s.accepted_per_position)]

    # Flat accessors, so ``out.metrics.acceptance_rate`` works.
    def __getattr__(self, name: str):
        if name != "spec" and not name.startswith("__") and (
                name in SpecMetrics.__dataclass_fields__ or hasattr(SpecMetrics, name)):
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
    # set when the request was aborted for an error: a logits processor that raised or left
    # nothing to sample (naming the request and the processor), or a strategy's verify that
    # raised (the fault's public message, naming the plugin); its outputs then end as far as
    # they got, finish_reason "abort"
    error: str | None = None
