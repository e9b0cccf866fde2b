"""End to end on a CUDA GPU: the engine's Triton path (paged attention, KV-cache writes,
rejection sampling) against its torch path on the same fp32 model, for plain decoding and for
speculative strategies. Skipped without CUDA (CI has none); run on the device machine with
``python -m pytest -m gpu tests/test_gpu_engine.py``.

``SPECULANT_DISABLE_TRITON=1`` sends CUDA tensors down the torch paths (the engine's SDPA-based
paged attention and the torch rejection-sampling reference), so the two runs differ only in the
kernels."""

from __future__ import annotations

import pytest
import torch

from speculant import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VOCAB = 1000
# head_dim 64, GQA 4 (8 query heads over 2 KV heads), two layers, fp32 weights
GEOMETRY = dict(vocab_size=VOCAB, tokenizer=False, hidden_size=512, intermediate_size=1024,
                num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
# ragged prompts: one token, within one block, several blocks, long enough for split-K
PROMPT_LENS = [1, 5, 16, 37, 130, 400]
MAX_TOKENS = 48


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _generate(llm: LLM, params: SamplingParams) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _llm(path, **kw) -> LLM:
    return LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", device="cuda",
               max_model_len=1024, max_num_seqs=8, kv_cache_memory=256 << 20, **kw)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
RANDOM = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=MAX_TOKENS, ignore_eos=True,
                        seed=1234)


@pytest.fixture(scope="module")
def target(tiny_factory):
    return tiny_factory("llama", seed=0, **GEOMETRY)


@pytest.fixture(scope="module")
def draft(tiny_factory):
    return tiny_factory("llama", seed=1, **{**GEOMETRY, "num_hidden_layers": 1})


@pytest.fixture(scope="module")
def torch_path_greedy(target):
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECULANT_DISABLE_TRITON", "1")
    # the torch attention path cannot be captured in a CUDA graph: run it eagerly
    mp.setenv("SPECULANT_ENFORCE_EAGER", "1")
    try:
        return _generate(_llm(target, enforce_eager=True), GREEDY)
    finally:
        mp.undo()
        torch.cuda.empty_cache()


def _spec(kind: str, draft_path) -> dict | None:
    if kind == "plain":
        return None
    if kind == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 4}
    return {"model": str(draft_path), "num_speculative_tokens": 3}


@pytest.mark.parametrize("kind,eager", [("plain", True), ("plain", False), ("ngram", False),
                                        ("draft_model", False), ("draft_model", True)])
def test_triton_greedy_equals_torch_path(target, draft, torch_path_greedy, kind, eager,
                                         monkeypatch):
    """Triton kernels, eagerly and inside the engine's CUDA graphs, vs the eager torch path."""
    monkeypatch.delenv("SPECULANT_DISABLE_TRITON", raising=False)
    monkeypatch.setenv("SPECULANT_ENFORCE_EAGER", "1" if eager else "0")
    out = _generate(_llm(target, speculative_config=_spec(kind, draft), enforce_eager=eager),
                    GREEDY)
    assert [len(o) for o in out] == [MAX_TOKENS] * len(PROMPT_LENS)
    for i, (a, b) in enumerate(zip(out, torch_path_greedy)):
        assert a == b, f"prompt {i} (len {PROMPT_LENS[i]}): triton {a} != torch {b}"
    torch.cuda.empty_cache()


@pytest.mark.parametrize("kind", ["plain", "ngram", "draft_model"])
def test_random_sampling_runs_and_is_reproducible(target, draft, kind, monkeypatch):
    monkeypatch.delenv("SPECULANT_DISABLE_TRITON", raising=False)
    llm = _llm(target, speculative_config=_spec(kind, draft))
    a = _generate(llm, RANDOM)
    b = _generate(llm, RANDOM)
    assert a == b  # per-request seed
    for o in a:
        assert len(o) == MAX_TOKENS and all(0 <= t < VOCAB for t in o)
    torch.cuda.empty_cache()
