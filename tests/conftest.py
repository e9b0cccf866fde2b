"""Shared fixtures: tiny random checkpoints written in the real Hugging Face on-disk layout
(config.json + model.safetensors with the real key names, plus a tokenizer), so the real loading
code is what the tests exercise. Nothing is downloaded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from checkpoints import make_tiny_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# engines with device="auto" run on the CPU even on a GPU machine (the CPU suite's assumptions,
# and one process holding dozens of engines); the GPU tests ask for device="cuda"
os.environ.setdefault("SPECULANT_DEVICE", "cpu")

@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from speculant.models.loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory):
    cache: dict = {}

    def make(arch: str = "llama", **kw) -> Path:
        key = (arch, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = make_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, **kw)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_factory) -> Path:
    return tiny_factory("llama")


@pytest.fixture(scope="session")
def smollm(default_model_path):
    """One shared LLM on the embedded default model (CPU fp32)."""
    from speculant import LLM

    return LLM(model=str(default_model_path), max_num_seqs=16)
