"""speculant: fast LLM inference with speculative decoding, every strategy a plugin."""

from speculant.hookspecs import hookimpl, hookspec

__version__ = "0.1.0"

__all__ = [
    "LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "hookimpl", "hookspec",
    "Proposal", "SpecBatch", "SpecSequence", "ScoreResult", "VerifyResult", "StrategyContext",
]


def __getattr__(name: str):  # lazy: `from speculant import hookimpl` must not load torch models
    if name == "LLM":
        from speculant.llm import LLM

        return LLM
    if name == "SamplingParams":
        from speculant.sampling_params import SamplingParams

        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput", "Logprob", "SpecMetrics"):
        from speculant import outputs

        return getattr(outputs, name)
    if name in ("Proposal", "SpecBatch", "SpecSequence", "ScoreResult", "VerifyResult", "StrategyContext"):
        from speculant import spec_types

        return getattr(spec_types, name)
    raise AttributeError(f"module 'speculant' has no attribute {name!r}")
