"""Model implementations of our own, chosen by the checkpoint's ``model_type``."""

from __future__ import annotations

from speculant.models.llama import LlamaForCausalLM
from speculant.models.opt import OPTForCausalLM

MODEL_REGISTRY = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "opt": OPTForCausalLM,
}


def model_class_for(config, source: str):
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_REGISTRY:
        raise ValueError(
            f"{source}: model_type {model_type!r} (architectures={getattr(config, 'architectures', None)}) "
            f"is not supported; supported: {', '.join(sorted(MODEL_REGISTRY))}"
        )
    return MODEL_REGISTRY[model_type]


__all__ = ["MODEL_REGISTRY", "model_class_for", "LlamaForCausalLM", "OPTForCausalLM"]
