"""SamplingParams: vLLM's fields, meanings and defaults, validated by pydantic."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_GREEDY_EPS = 1e-5
# The sampler computes in float32 and keeps top_k in an int32 tensor; a seed keys a 64-bit stream.
FLOAT32_MAX = 3.4028234663852886e38
INT32_MAX = 2**31 - 1
SEED_RANGE = (-(2**63), 2**63)  # [min, max): a 64-bit signed integer, as vLLM's server takes


class SamplingParams(BaseModel):
    """How to sample one request. ``temperature=0`` means greedy decoding.

    ``best_of`` samples that many sequences and returns the ``n`` with the highest cumulative
    log-probability, as vLLM did. Beam search (``use_beam_search``, and its ``length_penalty`` /
    ``early_stopping`` at other than their neutral values) is refused with a clear message rather
    than ignored.

    Every field is checked here (a ``ValidationError``, a ``ValueError``, naming the field and its
    range; floats must be finite). What needs the model is checked when a request is added
    (:meth:`check_vocab`): ``logprobs`` / ``prompt_logprobs`` at most the vocabulary size (the
    server allows at most 20) and ``stop_token_ids`` inside the vocabulary.
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, validate_assignment=True,
                              allow_inf_nan=False)

    n: int = Field(1, ge=1, description="Number of output sequences per prompt.")
    temperature: float = Field(1.0, ge=0.0, le=FLOAT32_MAX, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=INT32_MAX,
                       description="0 or -1 disables top-k; a k of at least the vocabulary keeps all")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=FLOAT32_MAX)
    seed: int | None = Field(None, ge=SEED_RANGE[0], lt=SEED_RANGE[1],
                             description="a 64-bit signed integer: [-2**63, 2**63)")
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = Field(16, ge=1)
    min_tokens: int = Field(0, ge=0)
    logprobs: int | None = Field(None, ge=0)
    prompt_logprobs: int | None = Field(None, ge=0)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logits_processors: list[Callable[..., Any]] | None = None
    best_of: int | None = Field(
        None, ge=1, description="sample this many sequences, return the n most likely (>= n)")
    # beam search fields of vLLM's: accepted only at their neutral values.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [v]
        return v

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(t < 0 for t in v):
            raise ValueError(f"token ids must be >= 0, got {[t for t in v if t < 0][:5]}")
        return v

    @model_validator(mode="after")
    def _check(self) -> SamplingParams:
        beam = [f for f, neutral in (("use_beam_search", False), ("length_penalty", 1.0),
                                     ("early_stopping", False)) if getattr(self, f) != neutral]
        if beam:
            raise ValueError(
                f"{', '.join(beam)}: beam search is not supported by speculant (these options "
                "only apply to it); sample instead (temperature > 0, with n or best_of > 1)"
            )
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be >= n ({self.n})")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if self.is_greedy and self.n > 1 and self.seed is None:
            pass  # n identical greedy samples, as vLLM does
        return self

    def vocab_errors(self, vocab_size: int) -> list[tuple[str, str]]:
        """(field, message) for each value that does not fit a model of ``vocab_size`` tokens."""
        errors = []
        for f in ("logprobs", "prompt_logprobs"):
            v = getattr(self, f)
            if v is not None and v > vocab_size:
                errors.append((f, f"{f} must be in [0, {vocab_size}] (the vocabulary size), "
                                  f"got {v}"))
        bad = [t for t in self.stop_token_ids or () if t >= vocab_size]
        if bad:
            errors.append(("stop_token_ids", f"stop_token_ids {bad[:5]} are outside the "
                                             f"vocabulary [0, {vocab_size})"))
        return errors

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError naming the first field that does not fit a model of ``vocab_size``
        tokens (called when a request is added)."""
        errors = self.vocab_errors(vocab_size)
        if errors:
            raise ValueError(errors[0][1])

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def num_samples(self) -> int:
        """Sequences to run: ``best_of`` when sampling (the ``n`` best are returned), else ``n``
        (greedy samples are identical)."""
        return self.n if self.is_greedy else max(self.n, self.best_of or 1)

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self, **update: Any) -> SamplingParams:
        return self.model_copy(update=update)


def _num(x: float) -> str:
    if isinstance(x, int) and abs(x) >= 2**20 and (abs(x) & (abs(x) - 1) == 0
                                                  or abs(x + 1) & abs(x) == 0):
        p = abs(x).bit_length() - 1
        return f"-2**{p}" if x < 0 else (f"2**{p}" if x == 2**p else f"2**{p + 1}-1")
    return f"{x:g}" if isinstance(x, float) else str(x)


def field_range(name: str) -> str | None:
    """The valid range of a numeric SamplingParams field, e.g. ``"(0, 1]"``; None without bounds."""
    f = SamplingParams.model_fields.get(name)
    if f is None:
        return None
    lo = hi = None
    for m in f.metadata:
        for attr, side in (("ge", "["), ("gt", "("), ("le", "]"), ("lt", ")")):
            v = getattr(m, attr, None)
            if v is not None:
                if side in "[(":
                    lo = side + _num(v)
                else:
                    hi = _num(v) + side
    if lo is None and hi is None:
        return None
    return f"{lo or '(-inf'}, {hi or 'inf)'}"
