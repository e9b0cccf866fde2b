"""Batch invariance on CUDA with ``EngineConfig.batch_invariant=True`` (models/batch_invariant.py):
a sequence's logits rows are bit for bit the same computed alone or within a batch of 4, 16 or 64
other sequences (any mix of query lengths), for a query of 1 row or k+1 rows (a verification
pass), replayed from CUDA graphs (padded buckets) or eager; so greedy output, plain or with n-gram
speculation, and its log-probabilities do not depend on the batch. bf16, the dtype whose
roundings make the default mode's rows differ. Skipped without CUDA; run on the device machine
with ``python -m pytest -m gpu tests/test_batch_invariance_gpu.py``."""

from __future__ import annotations

import pytest
import torch

from speculant import LLM, SamplingParams
from speculant.engine.sequence import Sequence
from speculant.models import batch_invariant
from speculant.models.batch_invariant import BatchInvariantLinear, chunked_linear
from speculant.outputs import RequestMetrics

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VOCAB = 2000
# head_dim 64, GQA 4, two layers; wide enough that cuBLAS / the GEMVs pick different kernels
# (split-K) for different row counts in the default mode
GEOMETRY = dict(vocab_size=VOCAB, tokenizer=False, hidden_size=512, intermediate_size=1536,
                num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
BLOCKS = 8  # cache blocks per sequence in the logits test (block size 16: up to 128 tokens)
NEW = [5, 77, 123, 9, 42]  # sequence 0's new tokens: decoded one by one, or verified at once


@pytest.fixture(scope="module")
def path(tiny_factory):
    return tiny_factory("llama", **GEOMETRY)


def _llm(path, **kw) -> LLM:
    return LLM(model=str(path), skip_tokenizer_init=True, dtype="bfloat16", device="cuda",
               max_model_len=1024, max_num_seqs=64, kv_cache_memory=512 << 20,
               batch_invariant=True, **kw)


@pytest.fixture(scope="module")
def llm(path):
    llm = _llm(path)
    assert llm.engine.runner.graphs is not None  # CUDA graphs on
    assert isinstance(llm.engine.model.lm_head, BatchInvariantLinear)
    return llm


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (20 + 3 * (i % 24),), generator=g).tolist() for i in range(n)]


def _seq(i: int, blocks: list[int]) -> Sequence:
    s = Sequence(f"b{i}", 0, [1], SamplingParams(), RequestMetrics(arrival_time=0.0), None)
    s.block_table = blocks
    return s


def _rows(llm, n: int, qlen: int) -> torch.Tensor:
    """Sequence 0's logits rows for its ``qlen`` new tokens, fed with ``n - 1`` other sequences
    (prompts of other lengths, query lengths 1 .. 5) after a batched prefill of all ``n``."""
    runner = llm.engine.runner
    seqs = [_seq(i, list(range(i * BLOCKS, (i + 1) * BLOCKS))) for i in range(n)]
    runner.forward(seqs, _prompts(n))
    new = [NEW[:qlen]] + [[11 + i, 12, 13, 14, 15][: 1 + i % 5] for i in range(1, n)]
    h, _ = runner.forward(seqs, new)
    return runner.logits(h)[:qlen]


def test_logits_rows_do_not_depend_on_the_batch_or_query_length(llm):
    """Reference: sequence 0 alone, prefilled then fed one token per step (batch-1 decode
    graphs); then as a 5-row verification alone, and as a decode step or a verification pass
    within batches of 4, 16 and 64."""
    runner = llm.engine.runner
    assert runner.kv_cache.shape[2] >= 64 * BLOCKS
    s = _seq(0, list(range(BLOCKS)))
    runner.forward([s], _prompts(1))
    ref = torch.cat([runner.logits(runner.forward([s], [[t]])[0]) for t in NEW])  # [5, vocab]
    assert torch.equal(_rows(llm, 1, 5), ref)
    for n in (4, 16, 64):
        assert torch.equal(_rows(llm, n, 1), ref[:1]), n
        assert torch.equal(_rows(llm, n, 5), ref), n


@pytest.mark.parametrize("gemm", ["cublas", "triton"])
@pytest.mark.parametrize("k,n", [(4096, 6144), (14336, 4096), (4096, 128256)])
def test_linear_rows_do_not_depend_on_the_row_count(monkeypatch, gemm, k, n):
    """The mode's linear at Llama-3-8B shapes (QKV, down, LM head), bf16, with either GEMM
    (``batch_invariant.GEMM``; the engine uses the module's choice): each row bit for bit the same
    alone, among 7, 64 or 130 rows, at any place. If "cublas" fails here, cuBLAS's kernel for the
    64-row shape splits the rows unevenly: set ``GEMM = "triton"``."""
    monkeypatch.setattr(batch_invariant, "GEMM", gemm)
    g = torch.Generator("cuda").manual_seed(k + n)
    w = (torch.randn(n, k, generator=g, device="cuda") * 0.02).bfloat16()
    x = torch.randn(130, k, generator=g, device="cuda").bfloat16()
    full = chunked_linear(x, w)  # [130, n]
    for rows in (slice(0, 1), slice(64, 65), slice(3, 10), slice(60, 124)):
        assert torch.equal(chunked_linear(x[rows], w), full[rows]), rows
    assert torch.equal(chunked_linear(x.flip(0), w).flip(0), full)


def test_prefill_equals_token_by_token(llm):
    runner = llm.engine.runner
    prompt = _prompts(1, seed=3)[0]
    a, b = _seq(0, list(range(BLOCKS))), _seq(1, list(range(BLOCKS, 2 * BLOCKS)))
    whole = runner.logits(runner.forward([a], [prompt])[0])[-1]
    for t in prompt:
        last = runner.logits(runner.forward([b], [[t]])[0])[-1]
    assert torch.equal(whole, last)


def _greedy(llm, prompts, batch):
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    outs = []
    for i in range(0, len(prompts), batch):
        group = [{"prompt_token_ids": p} for p in prompts[i : i + batch]]
        outs += llm.generate(group, sp, use_tqdm=False)
    return [(o.outputs[0].token_ids, [
        {t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs
    ]) for o in outs]


def test_greedy_outputs_do_not_depend_on_the_batch(llm, path):
    """64 prompts (repetitive, so n-gram speculation drafts) at batch 1, 4, 16 and 64: the same
    tokens and log-probabilities; with n-gram speculation the same tokens."""
    g = torch.Generator().manual_seed(7)
    prompts = []
    for i in range(64):
        motif = torch.randint(10, VOCAB, (3 + i % 4,), generator=g).tolist()
        prompts.append(motif * 4 + torch.randint(10, VOCAB, (i % 5,), generator=g).tolist())
    plain = _greedy(llm, prompts, 1)
    for batch in (4, 16, 64):
        assert _greedy(llm, prompts, batch) == plain, batch
    ngram = _llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                           "prompt_lookup_max": 3})
    for batch in (1, 16, 64):
        spec = _greedy(ngram, prompts, batch)
        assert [t for t, _ in spec] == [t for t, _ in plain], batch
    assert ngram.engine.spec_metrics().num_draft_tokens > 0  # speculation did draft
