"""Token trees under tensor parallelism (docs/trees.md, docs/tensor_parallel.md): a tree step's
parents reach every worker in the step's one message, so every rank scores the same tree rows,
and rank 0's K/V compaction after verification rides on the next call's message, so every rank
compacts its own cache the same way. Greedy tree output at TP 2 is the TP 1 plain output (the
tree oracle and n-gram trees at batch 1 and 4, EAGLE-2 trees of an EAGLE-3 head), seeded sampled
tree requests at TP 2 are their TP 1 runs (point-mass trees and trees with probs), and a tree
message packs and unpacks to what was sent (CPU, gloo, 2 processes); on 2 GPUs, tree steps at
TP 2 (tree graphs and eager) give TP 2 plain output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from greedy_refs import greedy_with_references, tokens
from pydantic import BaseModel, ConfigDict

from speculant import LLM, Proposal, SamplingParams, hookimpl
from speculant.drafting import sibling_draft_probs
from speculant.engine.tp_runner import (
    _COMPACT,
    _TOKENS_ON_DEVICE,
    _TREES,
    FORWARD,
    SCORE,
    SHUTDOWN,
    Compaction,
    RemoteSeq,
    apply_call,
    pack_call,
    unpack_call,
)
from speculant.hookspecs import Strategy
from speculant.plugin_manager import register, unregister
from speculant.spec_types import DraftTree

K = 5
MAX_TOKENS = 24
PROMPTS = [[1, 5, 6, 5, 7, 5, 8, 5], [1, 9, 9, 9], [1, 2000, 31, 77, 5, 6, 7], [1, 5, 6, 5, 6, 5]]


# -------------------------------------------------------------------------------- messages
def test_tree_message_round_trip():
    seqs = [RemoteSeq(5, [3, 1, 4]), RemoteSeq(0, [9]), RemoteSeq(17, list(range(20)))]
    trees = [[-1, -1, 0, 1, 1], None, [-1, 0, 0]]
    toks = [[11, 5, 7, 3, 3, 8], [1, 2, 3], [40, 41, 42, 43]]
    done = [Compaction([RemoteSeq(0, [7, 8]), RemoteSeq(0, list(range(9)))], [4, 30],
                       [[2, 5], [1, 3, 4]]),
            Compaction([RemoteSeq(0, [2])], [0], [[3]])]
    msg = pack_call(SCORE, 2 | 4, (1, 3), seqs, toks, trees=trees, compactions=done)
    assert msg[0] == len(msg)
    call = unpack_call(msg)
    assert call.op == SCORE and call.flags == 2 | 4 | _TREES | _COMPACT
    assert call.aux_layers == (1, 3) and call.new_tokens == toks and call.seqs == seqs
    assert call.trees == trees and call.compactions == done
    # tokens still on the device: the trees and the compactions still follow the tables
    call = unpack_call(pack_call(FORWARD, _TOKENS_ON_DEVICE, (), seqs, toks, trees=trees,
                                 compactions=done[:1]))
    assert [len(t) for t in call.new_tokens] == [6, 3, 4] and call.seqs == seqs
    assert call.trees == trees and call.compactions == done[:1]
    # no tree in the step: no tree section (the flags are the message's, not the caller's)
    call = unpack_call(pack_call(SCORE, _TREES, (), seqs, toks, trees=[None] * 3))
    assert call.flags == 0 and call.trees is None and call.compactions == []
    assert len(pack_call(SCORE, 0, (), seqs, toks, trees=[None] * 3)) == len(
        pack_call(SCORE, 0, (), seqs, toks))
    # a compaction alone, with no sequence of its own (the next call of any op carries it)
    call = unpack_call(pack_call(SHUTDOWN, compactions=done[1:]))
    assert call.op == SHUTDOWN and call.seqs == [] and call.compactions == done[1:]
    with pytest.raises(ValueError, match="3 sequences with 2 trees"):
        pack_call(SCORE, 0, (), seqs, toks, trees=trees[:2])
    with pytest.raises(ValueError, match="feeds 6 rows for a tree of 4 nodes"):
        pack_call(SCORE, 0, (), seqs, toks, trees=[trees[0][:4], None, trees[2]])


class _Recorder:
    """A worker's runner that records what ``apply_call`` makes it do."""

    def __init__(self, graphs=None) -> None:
        self.log: list[tuple] = []
        self.graphs = graphs  # a worker without CUDA graphs runs a score call's forward alone

    def compact_tree(self, seqs, ctx_starts, paths) -> None:
        self.log.append(("compact", [s.block_table for s in seqs], ctx_starts, paths))

    def score(self, seqs, new_tokens, aux_layers=(), greedy=False, keep_hidden=True, trees=None,
              token_ids=None):
        self.log.append(("score", [len(t) for t in new_tokens], greedy, trees))

    def forward(self, seqs, new_tokens, aux_layers=(), token_ids=None, trees=None):
        self.log.append(("forward", [len(t) for t in new_tokens], trees))


def test_a_worker_compacts_before_the_call_and_scores_the_same_trees():
    seqs = [RemoteSeq(5, [3, 1]), RemoteSeq(9, [4])]
    toks = [[1, 2, 3], [4, 5]]
    done = [Compaction([RemoteSeq(0, [3, 1])], [4], [[2]]),
            Compaction([RemoteSeq(0, [4]), RemoteSeq(0, [6])], [8, 2], [[1, 3], [2]])]
    runner = _Recorder(graphs=object())
    assert apply_call(runner, unpack_call(pack_call(SCORE, 2, (), seqs, toks,
                                                    trees=[[-1, -1], None], compactions=done)))
    assert runner.log == [("compact", [[3, 1]], [4], [[2]]),
                          ("compact", [[4], [6]], [8, 2], [[1, 3], [2]]),
                          ("score", [3, 2], True, [[-1, -1], None])]
    runner = _Recorder()
    assert apply_call(runner, unpack_call(pack_call(SCORE, 2, (), seqs, toks,
                                                    trees=[[-1, -1], None])))
    assert runner.log == [("forward", [3, 2], [[-1, -1], None])]  # no LM head on a worker
    runner.log.clear()
    assert apply_call(runner, unpack_call(pack_call(FORWARD, 0, (), seqs, [[1], [2]],
                                                    compactions=done[:1])))
    assert runner.log == [("compact", [[3, 1]], [4], [[2]]), ("forward", [1, 1], None)]
    assert not apply_call(runner, unpack_call(pack_call(SHUTDOWN)))


# -------------------------------------------------------------------------------- runtime
@pytest.fixture(scope="module")
def tiny(tiny_factory):
    return str(tiny_factory("llama", tokenizer=False))


@pytest.fixture(scope="module")
def plain(tiny):
    """TP 1 plain greedy outputs and oracle references K tokens longer."""
    return greedy_with_references(tiny, PROMPTS, MAX_TOKENS, K)


def _spec(how: str, refs) -> dict:
    if how == "oracle":
        return {"method": "oracle", "num_speculative_tokens": K, "alpha": 0.7,
                "references": refs, "tree_width": 2, "rank_probs": [0.5, 0.3]}
    return {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1, "tree_branches": 3, "adaptive": False}


def _count_compactions(llm: LLM) -> list[int]:
    """Rank 0's compaction groups handed to the workers (a list growing by one per group)."""
    runner, seen = llm.engine.runner, []
    real = runner.compact_tree

    def counted(seqs, ctx_starts, paths):
        real(seqs, ctx_starts, paths)
        if seqs:
            seen.append(len(seqs))

    runner.compact_tree = counted
    return seen


def _count_calls(monkeypatch, owner, name: str) -> list[int]:
    """Count the calls of ``owner.name`` (the list grows by one per call)."""
    seen, real = [], getattr(owner, name)

    def counted(*a, **k):
        seen.append(1)
        return real(*a, **k)

    monkeypatch.setattr(owner, name, counted)
    return seen


# the default run's tensor-parallel greedy equality (~8 s on a busy 2-core machine): oracle
# trees at batch 4; the others are slow, as test_tensor_parallel.py's plain TP 2 runs
@pytest.mark.parametrize(("how", "batch"), [
    ("oracle", 4),
    pytest.param("oracle", 1, marks=pytest.mark.slow),
    pytest.param("ngram", 1, marks=pytest.mark.slow),
    pytest.param("ngram", 4, marks=pytest.mark.slow),
])
@pytest.mark.slow
def test_tp2_tree_greedy_equals_tp1_plain(tiny, plain, how, batch, monkeypatch):
    import speculant.engine.tp_runner as tp_runner

    want, refs = plain
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(model=tiny, skip_tokenizer_init=True, max_num_seqs=8, tensor_parallel_size=2,
             speculative_config=_spec(how, refs)) as llm:
        compacted = _count_compactions(llm)
        sent = _count_calls(monkeypatch, tp_runner.dist, "broadcast")
        steps = _count_calls(monkeypatch, llm.engine.runner.local, "forward")  # score's too
        assert tokens(llm.generate(PROMPTS[:batch], greedy, use_tqdm=False)) == want[:batch]
        monkeypatch.undo()
        # one broadcast per step, tree steps and their compactions included
        assert len(steps) > 0 and len(sent) == len(steps)
        m = llm.get_metrics()
        # tree steps scored and verified (a step fault would have run them plainly)
        assert m.num_faults == 0 and m.num_tree_drafts > 0 and m.num_accepted_tokens > 0, \
            m.as_dict()
        if how == "oracle":  # siblings of rank 1 accepted: their K/V moved on every rank
            assert compacted, "no tree step needed a compaction: the test checks nothing"


@pytest.mark.slow
def test_tp2_seeded_sampled_tree_request_equals_tp1(tiny_factory):
    path = str(tiny_factory("llama", vocab_size=512, tokenizer=False))
    prompts = [[t % 512 for t in p] for p in PROMPTS]
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=MAX_TOKENS,
                             ignore_eos=True, seed=123 + i) for i in range(len(prompts))]
    # the oracle replays the plain seeded outputs: its true siblings are the tokens the seeded
    # draws pick, so trees are accepted (the greedy continuation would match only by chance)
    llm = LLM(model=path, skip_tokenizer_init=True, max_num_seqs=8)
    plain = tokens(llm.generate(prompts, params, use_tqdm=False))
    refs = [{"prompt_token_ids": p, "output_token_ids": t} for p, t in zip(prompts, plain)]
    spec = {"method": "oracle", "num_speculative_tokens": K, "alpha": 0.7, "references": refs,
            "tree_width": 3}

    def run(tp: int) -> tuple[list[list[int]], int]:
        with LLM(model=path, skip_tokenizer_init=True, max_num_seqs=8, tensor_parallel_size=tp,
                 speculative_config=spec) as llm:
            out = tokens(llm.generate(prompts, params, use_tqdm=False))
            m = llm.get_metrics()
            assert m.num_tree_drafts > 0 and m.num_accepted_tokens > m.num_drafts // 2, m.as_dict()
            return out, m.num_faults

    one, faults_one = run(1)
    two, faults_two = run(2)
    assert faults_one == faults_two == 0
    assert two == one == plain


# ------------------------------------------------------- sampled drafts (trees with probs)
REFS: dict[tuple[int, ...], list[int]] = {}  # prompt -> prompt + plain greedy continuation


class DrawnConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_speculative_tokens: int = 4


class Drawn(Strategy):
    """2 x 2 trees drawn from the request's own generator: two siblings without replacement from
    q1 = 0.6 at the reference's next token + 0.4 uniform, each followed by one draw from the
    same mixture at the token after (so nodes of rank 1 are accepted too), with their probs."""

    name = "tp_drawn"
    Config = DrawnConfig

    def __init__(self, config: DrawnConfig, ctx) -> None:
        super().__init__(config, ctx)
        self.V = ctx.vocab_size

    def _q(self, s, ahead: int) -> torch.Tensor:
        ref = REFS[tuple(s.token_ids[: s.num_prompt_tokens])]
        n = len(s.token_ids) + ahead - 1
        q = torch.full((self.V,), 0.4 / self.V)  # [V]
        q[ref[n] if n < len(ref) else 0] += 0.6
        return q

    @hookimpl
    def propose(self, batch):
        drafts = []
        for s in batch.seqs:
            if s.max_draft < 4:
                drafts.append([])
                continue
            q1, q2 = self._q(s, 1), self._q(s, 2)
            first = torch.multinomial(q1, 2, replacement=False, generator=s.generator).tolist()
            second = [int(torch.multinomial(q2, 1, generator=s.generator)) for _ in first]
            probs = torch.cat([sibling_draft_probs(q1, first, replacement=False),
                               q2[None].repeat(2, 1)])  # [4, V]
            drafts.append(DraftTree([*first, *second], [-1, -1, 0, 1], probs))
        return Proposal(token_ids=drafts)


class _Plugin:
    @hookimpl
    def register_strategies(self, register):
        register(Drawn)


@pytest.mark.slow  # a TP 2 and a TP 1 run (~8 s busy)
def test_tp2_seeded_tree_with_probs_equals_tp1(tiny_factory):
    path = str(tiny_factory("llama", vocab_size=512, tokenizer=False))
    prompts = [[t % 512 for t in p] for p in PROMPTS]
    llm = LLM(model=path, skip_tokenizer_init=True, max_num_seqs=8)
    long = tokens(llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30,
                                                        ignore_eos=True), use_tqdm=False))
    REFS.update({tuple(p): p + t for p, t in zip(prompts, long)})
    name = register(_Plugin(), name="test-tp-trees")
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=MAX_TOKENS,
                             ignore_eos=True, seed=321 + i) for i in range(len(prompts))]

    def run(tp: int) -> list[list[int]]:
        with LLM(model=path, skip_tokenizer_init=True, max_num_seqs=8, tensor_parallel_size=tp,
                 speculative_config={"method": "tp_drawn"}) as llm:
            compacted = _count_compactions(llm)
            out = tokens(llm.generate(prompts, params, use_tqdm=False))
            m = llm.get_metrics()
            assert m.num_faults == 0 and m.num_tree_drafts > 0, m.as_dict()
            assert compacted, "no accepted node of rank 1: the test checks no compaction"
            return out

    try:
        assert run(2) == run(1)
    finally:
        unregister(name)
        REFS.clear()


@pytest.mark.slow
def test_tp2_eagle3_dynamic_tree_equals_tp1_plain(tiny_factory, tmp_path):
    """EAGLE-2 dynamic trees from an EAGLE-3 head: the tree steps' aux hidden states (layers
    0, 1 and 3 of a 4-layer target) reach the head on rank 0 as at TP 1."""
    from checkpoints import BIG_V, make_eagle3

    deep = str(tiny_factory("llama", num_hidden_layers=4, tokenizer=False))
    head = str(make_eagle3(tmp_path / "e3", BIG_V, 40, target=Path(deep)))
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = tokens(LLM(model=deep, skip_tokenizer_init=True, max_num_seqs=8).generate(
        PROMPTS, greedy, use_tqdm=False))
    spec = {"model": head, "aux_hidden_layers": [0, 1, 3], "num_speculative_tokens": 3,
            "eagle_topk": 2, "num_draft_tokens": 6}
    with LLM(model=deep, skip_tokenizer_init=True, max_num_seqs=8, tensor_parallel_size=2,
             speculative_config=spec) as llm:
        assert llm.engine.spec.name == "eagle3"
        assert tokens(llm.generate(PROMPTS, greedy, use_tqdm=False)) == want
        m = llm.get_metrics()
        assert m.num_faults == 0 and m.num_tree_drafts > 0, m.as_dict()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("eager", [False, True])
def test_cuda_tp2_tree_steps_equal_plain(tiny, plain, eager):
    """On 2 GPUs (float32): tree steps at TP 2, in tree graphs (captured on first use on every
    rank) or eagerly, with the Triton compaction on every rank, give TP 2 plain greedy's tokens
    (speculation is lossless at that size; TP 1 may differ at float32 near-ties)."""
    _, refs = plain
    kw = {"device": "cuda", "dtype": "float32", "enforce_eager": eager,
          "kv_cache_memory": 1 << 26, "skip_tokenizer_init": True, "max_num_seqs": 8,
          "tensor_parallel_size": 2}
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(model=tiny, **kw) as llm:
        want = tokens(llm.generate(PROMPTS, greedy, use_tqdm=False))
    for how in ("oracle", "ngram"):
        with LLM(model=tiny, **kw, speculative_config=_spec(how, refs)) as llm:
            for batch in (1, 4):
                out = tokens(llm.generate(PROMPTS[:batch], greedy, use_tqdm=False))
                assert out == want[:batch], (how, batch)
            m = llm.get_metrics()
            assert m.num_faults == 0 and m.num_tree_drafts > 0, (how, m.as_dict())
            g = llm.engine.runner.graphs
            assert (g is None) == eager and (eager or len(g.tree_graphs) > 0)
