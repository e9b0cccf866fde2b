from __future__ import annotations

import pytest
import torch

from speculant.kernels.logprobs import _chunking, row_argmax, token_logprobs, token_logprobs_ref

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-5, torch.float16: 2e-5}  # fp32 arithmetic inside


def _logits(R, V, dtype, scale=4.0):
    return (torch.randn(R, V) * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("R,V", [(1, 7), (3, 1000), (2, 5000), (5, 40_000)])
def test_greedy_token_and_logprob_match_reference(device, dtype, R, V):
    x = _logits(R, V, dtype)
    tok, lp = token_logprobs(x.to(device), force_triton=True)
    rtok, rlp = token_logprobs_ref(x)
    assert tok.dtype == torch.int64 and lp.dtype == torch.float32
    assert torch.equal(tok.cpu(), rtok)
    torch.testing.assert_close(lp.cpu(), rlp, atol=TOL[dtype], rtol=TOL[dtype])


def test_given_tokens_with_row_map(device):
    R, V = 4, 3000
    x = _logits(R, V, torch.float32)
    rows = torch.tensor([0, 3, 3, 1, 2, 0], dtype=torch.int64)
    toks = torch.randint(0, V, (6,), dtype=torch.int64)
    tok, lp = token_logprobs(x.to(device), toks.to(device), rows.to(device), force_triton=True)
    rtok, rlp = token_logprobs_ref(x, toks, rows)
    assert torch.equal(tok.cpu(), toks)
    torch.testing.assert_close(lp.cpu(), rlp, atol=2e-5, rtol=2e-5)
    # against the plain definition, row by row
    for i in range(6):
        want = torch.log_softmax(x[rows[i]], -1)[toks[i]]
        torch.testing.assert_close(lp[i].cpu(), want, atol=2e-5, rtol=2e-5)


def test_ties_take_the_lowest_index_across_chunks(device):
    V = 9000
    chunk, _, nc = _chunking(V)
    assert nc > 2  # the maxima below sit in different chunks
    x = torch.randn(2, V)
    x[0, [chunk + 5, 2 * chunk + 1, V - 1]] = 50.0  # first maximum in the second chunk
    x[1, [3, 4]] = 50.0  # a tie inside the first chunk
    tok, lp = token_logprobs(x.to(device), force_triton=True)
    assert tok.tolist() == [chunk + 5, 3]
    torch.testing.assert_close(lp.cpu(), token_logprobs_ref(x)[1], atol=2e-5, rtol=2e-5)


def test_masked_logits_and_large_index(device):
    """-inf entries (a logits processor's mask) carry no mass; a vocabulary past 2**17 whose
    maximum sits in its last chunk, read through a strided row."""
    V = 150_001
    big = torch.randn(2, V + 16) * 3
    x = big[:, :V]  # rows strided by V + 16
    x[0, : V // 2] = float("-inf")
    x[1, V - 2] = 40.0
    tok, lp = token_logprobs(x.to(device), force_triton=True)
    rtok, rlp = token_logprobs_ref(x)
    assert torch.equal(tok.cpu(), rtok) and tok[1].item() == V - 2
    torch.testing.assert_close(lp.cpu(), rlp, atol=2e-5, rtol=2e-5)


def test_bad_arguments_name_the_problem():
    x = torch.randn(2, 10)
    with pytest.raises(ValueError, match="tokens must have shape"):
        token_logprobs(x, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="rows must have dtype"):
        token_logprobs(x, rows=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="logits must have 2 dims"):
        token_logprobs(torch.randn(10))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 150001 columns (~1.5 s each on the interpreter) are slow; 32000 spans several tiles too
@pytest.mark.parametrize(
    "R,V", [(1, 5), (4, 32000), pytest.param(3, 150_001, marks=pytest.mark.slow)]
)
def test_row_argmax_matches_torch(device, dtype, R, V):
    big = torch.randn(R, V + 8) * 3
    x = big[:, :V].to(dtype)  # strided rows
    chunk, _, nc = _chunking(V)
    if nc > 1:  # a tie between the last two chunks' entries, and one inside a chunk
        x[0, [V - 1, V - 1 - chunk]] = 30.0
        x[-1, [1, 2]] = 31.0
    got = row_argmax(x.to(device), force_triton=True)
    assert got.dtype == torch.int64
    assert torch.equal(got.cpu(), x.float().argmax(dim=-1))
