"""Shared fixtures: tiny random checkpoints written in the real Hugging Face on-disk layout
(config.json + model.safetensors with the real key names, plus a tokenizer), so the real loading
code is what the tests exercise. Nothing is downloaded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=512)


def _tokenizer_folder() -> Path:
    """The embedded default's tokenizer (vocab 49152), materialized once; tiny models use it."""
    from speculant.models.loader import resolve_model

    return resolve_model(None)


def make_tiny_checkpoint(path: Path, arch: str = "llama", vocab_size: int = 49152, seed: int = 0,
                         tokenizer: bool = True, **overrides) -> Path:
    """Write a random tiny HF checkpoint of ``arch`` (llama, qwen2, mistral, opt) into ``path``."""
    import transformers

    torch.manual_seed(seed)
    if arch == "opt":
        cfg = transformers.OPTConfig(
            vocab_size=vocab_size, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=512, word_embed_proj_dim=64,
            bos_token_id=1, eos_token_id=2, pad_token_id=2, **overrides)
        model = transformers.OPTForCausalLM(cfg)
    else:
        cls_cfg = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                   "mistral": transformers.MistralConfig}[arch]
        kw = dict(TINY, vocab_size=vocab_size, num_key_value_heads=2, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False, rope_theta=10000.0)
        kw.update(overrides)
        cfg = cls_cfg(**kw)
        model = getattr(transformers, {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                       "mistral": "MistralForCausalLM"}[arch])(cfg)
    with torch.no_grad():  # make logits peaky enough that greedy ties are vanishingly rare
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(_tokenizer_folder())).save_pretrained(path)
    return path


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
