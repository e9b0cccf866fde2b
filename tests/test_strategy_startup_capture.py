"""Start-up capture of the strategies' own CUDA graphs (the ``capture_graphs`` hook), on the CPU:
the graphs' functions run eagerly as their "capture" (as in test_draft_graph.py and
test_eagle_graph.py). Each strategy captures exactly the keys its greedy proposes can use for up
to ``max_num_seqs`` sequences, on padding inputs that write nothing to its draft cache and leave
its per-sequence state alone; proposing afterwards (on the buffers made by the capture) gives
the drafts of the eager path; the engine calls the hook at start-up unless capture is lazy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import H, make_eagle1, make_eagle3, make_mlp
from test_eagle_graph import _kernel_attention

import speculant.drafting.draft_graph as draft_graph
import speculant.models.attention as attention_mod
from speculant import LLM, SamplingParams, hookimpl
from speculant.drafting import BUCKETS
from speculant.drafting.head_graph import QUERY_BUCKETS
from speculant.engine.spec_decode import SpecDecoder

V = 64
PROMPT_LENS = [3, 9, 5, 12, 4, 7]
MAX_TOKENS = [20, 13, 24, 9, 17, 22]


@pytest.fixture(scope="module")
def target(tiny_factory) -> Path:
    return tiny_factory("llama", vocab_size=V, tokenizer=False, num_hidden_layers=3)


def _prompts(vocab: int = V) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _generate(llm: LLM, vocab: int = V) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts(vocab)], params,
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _eager_graphs(monkeypatch, graphs) -> list:
    """Turn ``graphs`` (a GraphCache) on with each "capture" and replay running its function
    eagerly on the static inputs (the outputs static, as a graph's); returns the list of keys
    captured, in order."""
    captured, static = [], {}
    graphs.enabled = True

    def replay(key, fn):
        if key not in graphs.graphs:
            captured.append(key)
            graphs.graphs[key] = (None, None)
        out = fn(*graphs.inputs[key])
        graphs.inflight = True
        return static.setdefault(key, out).copy_(out)

    monkeypatch.setattr(graphs, "replay", replay)
    return captured


def _llm(target: Path, spec: dict, max_num_seqs: int = 4, **kw) -> LLM:
    return LLM(model=str(target), skip_tokenizer_init=True, device="cpu", max_num_seqs=max_num_seqs,
               speculative_config=spec, **kw)


def test_draft_model_captures_its_keys_and_writes_nothing(target, monkeypatch):
    monkeypatch.setattr(attention_mod, "attention", _kernel_attention)
    spec = {"model": str(target), "num_speculative_tokens": 3}
    reference = _generate(_llm(target, spec))  # eager proposes throughout

    llm = _llm(target, spec)
    strat = llm.engine.spec.strategy
    assert strat.capture_graphs(max_num_seqs=4, progress=False) == 0  # CPU: nothing to capture
    captured = _eager_graphs(monkeypatch, strat.graphs)
    _generate(llm)  # the draft cache now holds K/V, the states their sequences' tokens...
    llm.engine.add_request("kept", None, _prompts()[0], SamplingParams(max_tokens=50))
    llm.engine.step()  # ... and one sequence stays mid-request
    strat.graphs.graphs.clear()
    captured.clear()
    cache = strat.runner.kv_cache.clone()
    states = {i: (list(s.tokens), s.num_cached_tokens, list(s.block_table))
              for i, s in strat.runner.states.items()}
    free = strat.runner.block_manager.num_free_blocks

    n = strat.capture_graphs(max_num_seqs=4, progress=False)
    keys = draft_graph.startup_keys(strat.runner, 4)
    assert n == len(keys) == len(captured) and set(captured) == set(keys)
    assert {b for b, _, _ in keys} == {1, 2, 4} and {q for _, q, _ in keys} == {1, 2, 3, 4}
    assert {k for _, _, k in keys} == {3}
    assert torch.equal(strat.runner.kv_cache, cache)  # padding rows: slot -1, no K/V written
    assert {i: (list(s.tokens), s.num_cached_tokens, list(s.block_table))
            for i, s in strat.runner.states.items()} == states
    assert strat.runner.block_manager.num_free_blocks == free
    assert strat.capture_graphs(max_num_seqs=4, progress=False) == 0  # all there already
    llm.engine.abort_request("kept")
    llm.engine.step()

    captured.clear()
    assert _generate(llm) == reference  # proposes on the buffers the capture made
    # only a request's first propose (its prompt and first token, catch-ups of up to 16 tokens
    # take the one-graph propose too) found no graph: every steady-state propose found its own
    assert captured and all(q > 4 for _, q, _ in captured)


def test_draft_padding_ints_layout():
    Bp, Q, K, W = 2, 3, 4, 5
    out = torch.full((sum(draft_graph._sizes(Bp, Q, K, W)),), 7, dtype=torch.long).numpy()
    draft_graph.padding_ints(out, Bp, Q, K, W)
    parts = dict(zip(["ids", "pos", "slots", "ctx", "qsl", "last", "spos", "sslots", "sctx",
                      "sqsl", "tables"], torch.from_numpy(out).split(draft_graph._sizes(Bp, Q, K, W))))
    assert (parts["slots"] == -1).all() and (parts["sslots"] == -1).all()
    for name in ("ids", "pos", "ctx", "qsl", "last", "spos", "sctx", "sqsl", "tables"):
        assert (parts[name] == 0).all(), name


@pytest.mark.parametrize("version", [1, 3])
def test_eagle_captures_its_keys_and_writes_nothing(target, tmp_path, monkeypatch, version):
    monkeypatch.setattr(attention_mod, "attention", _kernel_attention)
    if version == 1:
        head = make_eagle1(tmp_path / "e1", target, V, "safetensors", seed=2, copy=True)
    else:
        head = make_eagle3(tmp_path / "e3", V, 40, "safetensors", seed=3, target=target)
    spec = {"model": str(head), "num_speculative_tokens": 3}
    reference = _generate(_llm(target, spec, max_num_seqs=6))

    llm = _llm(target, spec, max_num_seqs=6)
    strat = llm.engine.spec.strategy
    captured = _eager_graphs(monkeypatch, strat.graphs)
    _generate(llm)  # K/V in the draft cache
    strat.graphs.graphs.clear()
    captured.clear()
    cache = [(k.clone(), v.clone()) for k, v in strat.cache.kv_caches]
    n = strat.capture_graphs(max_num_seqs=6, progress=False)
    batches = [b for b in BUCKETS if b <= 8]  # bucket(6) = 8
    want = {("fused", b, q, 3) for b in batches for q in QUERY_BUCKETS if q <= 4}
    want |= {(b, 3) for b in batches}  # the chain after a long catch-up (a first propose)
    assert n == len(captured) == len(want) and set(captured) == want
    for (k0, v0), (k1, v1) in zip(cache, strat.cache.kv_caches):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)

    captured.clear()
    assert _generate(llm) == reference
    # only first proposes over prompts of up to 16 tokens found no graph (longer ones take the
    # eager catch-up and a captured chain)
    assert all(len(key) == 4 and key[2] > 4 for key in captured)


def test_mlp_speculator_captures_every_bucket(tiny_factory, tmp_path, monkeypatch):
    target = tiny_factory("llama", tokenizer=False)
    ckpt = make_mlp(tmp_path / "mlp", emb_dim=H, seed=3)
    llm = LLM(model=str(target), skip_tokenizer_init=True, device="cpu", max_num_seqs=20,
              speculative_config={"model": str(ckpt)})
    strat = llm.engine.spec.strategy
    captured = _eager_graphs(monkeypatch, strat.graphs)
    n = strat.capture_graphs(max_num_seqs=20, progress=False)
    assert n == len(captured) and set(captured) == {(b, 3) for b in (1, 2, 4, 8, 16, 24)}


class _Counter:
    def __init__(self, n):
        self.n, self.calls = n, []

    @hookimpl
    def capture_graphs(self, max_num_seqs, progress):
        self.calls.append((max_num_seqs, progress))
        return self.n


@pytest.mark.parametrize("mode", ["startup", "lazy"])
def test_engine_calls_the_hook_at_startup(target, monkeypatch, mode):
    calls = []
    real = SpecDecoder.capture_graphs
    monkeypatch.setattr(SpecDecoder, "capture_graphs",
                        lambda self, progress=True: calls.append(progress) or real(self, progress))
    llm = _llm(target, {"method": "ngram", "num_speculative_tokens": 3}, max_num_seqs=5,
               cuda_graph_capture=mode)
    assert calls == ([True] if mode == "startup" else [])
    # collect-all: every plugin's count is summed (the n-gram strategy has no graphs)
    spec = llm.engine.spec
    a, b = _Counter(2), _Counter(None)
    spec.pm.register(a, name="test:a")
    spec.pm.register(b, name="test:b")
    try:
        assert llm.engine.capture_graphs(progress=False) == 2
        assert a.calls == b.calls == [(5, False)]
    finally:
        spec.pm.unregister(name="test:a")
        spec.pm.unregister(name="test:b")


def test_enforce_eager_reaches_the_strategies(target, monkeypatch):
    """``enforce_eager=True`` keeps the strategies' own forwards eager too: it reaches them in
    the StrategyContext, their graph caches stay off on CUDA, and the draft model's runner is
    built eager."""
    from speculant.drafting import GraphCache, graphs_wanted
    from speculant.engine import model_runner

    cuda = torch.device("cuda")
    assert not graphs_wanted(cuda, enforce_eager=True)  # decided before any CUDA call
    assert not GraphCache(cuda, "test", enforce_eager=True).enabled
    built = []
    real = model_runner.ModelRunner.__init__

    def spy(self, *a, **kw):
        built.append(kw.get("enforce_eager", False))
        real(self, *a, **kw)

    monkeypatch.setattr(model_runner.ModelRunner, "__init__", spy)
    for eager in (True, False):
        built.clear()
        llm = _llm(target, {"model": str(target), "num_speculative_tokens": 3},
                   enforce_eager=eager)
        assert llm.engine.spec.ctx.enforce_eager is eager
        assert built == [eager, eager]  # the target's runner, then the draft model's
