"""speculant.drafting.DraftRunner on a tiny random Llama (tests/checkpoints.py), on the CPU: the
catch-up feeds exactly what the draft cache misses, ``k`` draft steps see the hidden states of a
plain forward of the draft model over the same tokens, a rejected suffix is rolled back (its
blocks freed) and recomputed, and ``free`` / ``prepare`` give every block back. The reference
("plain") is a fresh runner's single forward over the whole token list."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from speculant.drafting import (
    DraftBatch,
    DraftRunner,
    load_draft_config,
    load_draft_model,
    load_draft_tokenizer,
    resolve_draft_folder,
    row_argmax,
)
from speculant.spec_types import SpecSequence, StrategyContext

V, BS, K = 64, 4, 3  # vocabulary, KV block size (small: drafts cross block boundaries), drafts


@pytest.fixture(scope="module")
def draft(tiny_factory) -> Path:
    return tiny_factory("llama", vocab_size=V, tokenizer=False, seed=3)


@pytest.fixture(scope="module")
def model(draft):
    folder = resolve_draft_folder(str(draft))
    cfg = load_draft_config(folder)
    assert cfg.vocab_size == V and load_draft_tokenizer(folder) is None  # no tokenizer files
    return load_draft_model(folder, cfg, torch.float32, torch.device("cpu"), 128)


def _ctx(max_num_seqs: int = 4) -> StrategyContext:
    return StrategyContext(
        target_model=None,
        target_config=None,
        vocab_size=V,
        device=torch.device("cpu"),
        dtype=torch.float32,
        block_size=BS,
        max_model_len=128,
        max_num_seqs=max_num_seqs,
    )


def _runner(model, **kw) -> DraftRunner:
    return DraftRunner(
        model, _ctx(), dtype=torch.float32, max_len=128, num_speculative_tokens=K, **kw
    )


def _seq(i: int, tokens: list[int], max_draft: int = K) -> SpecSequence:
    return SpecSequence(i, list(tokens), 3, max_draft, None)


def _greedy(hidden: torch.Tensor, model) -> torch.Tensor:  # [rows, hidden] -> [rows]
    return row_argmax(model.compute_logits(hidden))


@torch.inference_mode()
def _plain_last(model, tokens: list[int]) -> torch.Tensor:
    """The draft's final hidden state [hidden] at the last of ``tokens``: one forward over all
    of them in a fresh cache."""
    r = _runner(model)
    return r.catch_up(r.prepare([_seq(0, tokens)], 1))[0]


PROMPTS = [[5, 9, 12, 3, 7], [40, 41, 2, 8, 8, 30, 11, 6, 1]]


@torch.inference_mode()
def test_catch_up_then_k_steps_equal_plain_forwards(model):
    r = _runner(model)
    seqs = [_seq(i, p) for i, p in enumerate(PROMPTS)]
    batch = r.prepare(seqs)
    assert isinstance(batch, DraftBatch) and len(batch) == 2
    assert batch.rows == [0, 1] and batch.ks == [K, K] and batch.feeds == PROMPTS
    assert r.propose_greedy(batch) is None  # CPU: no graphs, the caller runs propose
    seen: list[tuple[list[int], torch.Tensor]] = []

    def choose(hidden: torch.Tensor, rows: list[int], step: int) -> torch.Tensor:
        assert hidden.shape == (len(rows), model.lm_head.weight.shape[1]) and step == len(seen)
        seen.append((rows, hidden.clone()))
        return _greedy(hidden, model)

    drafts = r.propose(batch, choose)
    assert len(seen) == K and all(len(d) == K for d in drafts)
    for i, p in enumerate(PROMPTS):  # step j saw the plain forward over prompt + j drafts
        for j, (rows, hidden) in enumerate(seen):
            _close(hidden[rows.index(i)], _plain_last(model, p + drafts[i][:j]))
        # the greedy drafts are the plain greedy continuation
        toks = list(p)
        for _ in range(K):
            toks.append(int(_greedy(_plain_last(model, toks)[None], model)[0]))
        assert drafts[i] == toks[len(p):]
        st = r.states[i]  # the cache holds the prompt and the K - 1 drafts fed back
        assert st.tokens == p + drafts[i][: K - 1] and st.num_cached_tokens == len(st.tokens)
        assert len(st.block_table) == -(-(len(p) + K - 1) // BS)


def _propose(r: DraftRunner, seq: list[int], model) -> list[int]:
    """The greedy drafts of one sequence (id 0)."""
    return r.propose(r.prepare([_seq(0, seq)]), lambda h, rows, j: _greedy(h, model))[0]


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_accepted_drafts_are_fed_once(model):
    """All K drafts accepted plus a bonus token: the catch-up feeds the last draft (never fed
    back) and the bonus only."""
    r = _runner(model)
    p = PROMPTS[0]
    drafts = _propose(r, p, model)
    seq = p + drafts + [17]
    batch = r.prepare([_seq(0, seq)])
    assert batch.feeds == [[drafts[-1], 17]]
    _close(r.catch_up(batch)[0], _plain_last(model, seq))
    st = r.states[0]
    assert st.num_cached_tokens == len(seq) and st.tokens == seq


@torch.inference_mode()
def test_rejected_drafts_are_rolled_back(model):
    """Block size 4. After the prompt (5 tokens) and 2 fed-back drafts the cache holds 7
    positions; the target accepts those 2 and rejects the third (bonus b): the catch-up feeds
    only b (8 positions). The next propose caches 10; the target rejects its first draft:
    rolled back to 8 positions, the new token recomputed. Blocks wholly past the kept
    positions go back to the cache."""
    r = _runner(model)
    p = PROMPTS[0]
    d = _propose(r, p, model)
    st = r.states[0]
    assert st.num_cached_tokens == 7 and len(st.block_table) == 2
    seq = p + d[:2] + [(d[2] + 1) % V]
    batch = r.prepare([_seq(0, seq)])
    assert batch.feeds == [[seq[-1]]] and st.num_cached_tokens == 7  # nothing rolled back
    e = r.propose(batch, lambda h, rows, j: _greedy(h, model))[0]
    assert st.num_cached_tokens == 10 and len(st.block_table) == 3
    assert st.tokens == seq + e[:2]
    seq2 = seq + [(e[0] + 1) % V]
    batch = r.prepare([_seq(0, seq2)], 1)
    assert batch.feeds == [[seq2[-1]]] and st.num_cached_tokens == 8 and st.tokens == seq
    _close(r.catch_up(batch)[0], _plain_last(model, seq2))
    # and the drafts after a rollback are those of a fresh runner on the same tokens
    seq3 = seq2 + [5]
    assert _propose(r, seq3, model) == _propose(_runner(model), seq3, model)

    r = _runner(model)
    six = r.propose(r.prepare([_seq(0, p, max_draft=6)], 6), lambda h, rows, j: _greedy(h, model))
    st, free = r.states[0], r.block_manager.num_free_blocks
    assert len(six[0]) == 6 and st.num_cached_tokens == 10 and len(st.block_table) == 3
    seq4 = p + [(six[0][0] + 1) % V]  # the first of 6 drafts rejected: 6 positions, 2 blocks
    batch = r.prepare([_seq(0, seq4)], 1)
    assert batch.feeds == [[seq4[-1]]] and st.num_cached_tokens == 5 and len(st.block_table) == 2
    assert r.block_manager.num_free_blocks == free + 1
    _close(r.catch_up(batch)[0], _plain_last(model, seq4))


@torch.inference_mode()
def test_free_and_no_drafts(model):
    r = _runner(model)
    total = r.num_blocks
    seqs = [_seq(0, PROMPTS[0]), _seq(1, PROMPTS[1]), _seq(2, [4, 4, 4], max_draft=0)]
    batch = r.prepare(seqs)
    assert batch.rows == [0, 1] and 2 not in r.states  # may draft none: no state
    drafts = r.propose(batch, lambda h, rows, j: _greedy(h, model))
    assert drafts[2] == [] and len(drafts[0]) == len(drafts[1]) == K
    r.free([0])
    assert set(r.states) == {1}
    # sequence 1 may now draft none (e.g. speculation turned off): its state is dropped too
    assert len(r.prepare([_seq(1, PROMPTS[1] + drafts[1], max_draft=0)])) == 0
    assert not r.states and r.block_manager.num_free_blocks == total


@torch.inference_mode()
def test_a_full_cache_reclaims_absent_sequences_then_skips(model):
    """A cache of 4 blocks (16 positions): a sequence not in the call loses its blocks to one
    that needs them; one that cannot fit even then gets no drafts this call."""
    per_block = _runner(model).kv_cache[:, :, :1].numel() * 4  # fp32 bytes of one block
    r = _runner(model, kv_cache_memory=4 * per_block)
    assert r.num_blocks == 4
    r.propose(r.prepare([_seq(0, PROMPTS[0])]), lambda h, rows, j: _greedy(h, model))
    assert r.block_manager.num_free_blocks == 2
    long = list(range(1, 12))  # 11 tokens + 2 drafts: 4 blocks
    batch = r.prepare([_seq(1, long)])
    assert batch.rows == [0] and 0 not in r.states and r.block_manager.num_free_blocks == 0
    r.free([1])
    batch = r.prepare([_seq(2, list(range(1, 20)))])  # 19 tokens: more than the cache holds
    assert len(batch) == 0 and not r.states and r.block_manager.num_free_blocks == 4
