"""End to end on a CUDA GPU: the engine's Triton path (paged attention, KV-cache writes,
rejection sampling) against its torch path on the same fp32 model, for plain decoding and for
speculative strategies. Skipped without CUDA (CI has none); run on the device machine with
``python -m pytest -m gpu tests/test_gpu_engine.py``.

``SPECULANT_DISABLE_TRITON=1`` sends CUDA tensors down the torch paths (the engine's SDPA-based
paged attention and the torch rejection-sampling reference), so the two runs differ only in the
kernels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from speculant import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VOCAB = 1000
# head_dim 64, GQA 4 (8 query heads over 2 KV heads), two layers, fp32 weights
GEOMETRY = dict(
    vocab_size=VOCAB,
    tokenizer=False,
    hidden_size=512,
    intermediate_size=1024,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)
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
    return LLM(
        model=str(path),
        skip_tokenizer_init=True,
        dtype="float32",
        device="cuda",
        max_model_len=1024,
        max_num_seqs=8,
        kv_cache_memory=256 << 20,
        **kw,
    )


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
RANDOM = SamplingParams(
    temperature=0.9, top_p=0.95, max_tokens=MAX_TOKENS, ignore_eos=True, seed=1234
)


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
    try:  # the torch attention path cannot be captured in a CUDA graph: run it eagerly
        return _generate(_llm(target, enforce_eager=True), GREEDY)
    finally:
        mp.undo()
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ EAGLE / MLPSpeculator heads
H, NKV_DIM, INTER = GEOMETRY["hidden_size"], 2 * 64, GEOMETRY["intermediate_size"]


def _save(folder: Path, cfg: dict, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return folder


def _llama_cfg(**extra) -> dict:
    return dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=H,
        intermediate_size=INTER,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_hidden_layers=1,
        vocab_size=VOCAB,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        hidden_act="silu",
        torch_dtype="float32",
        **extra,
    )


def _layer(g: torch.Generator, p: str, in_dim: int) -> dict[str, torch.Tensor]:
    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.05

    return {
        p + "self_attn.q_proj.weight": w(H, in_dim),
        p + "self_attn.k_proj.weight": w(NKV_DIM, in_dim),
        p + "self_attn.v_proj.weight": w(NKV_DIM, in_dim),
        p + "self_attn.o_proj.weight": w(H, H),
        p + "mlp.gate_proj.weight": w(INTER, H),
        p + "mlp.up_proj.weight": w(INTER, H),
        p + "mlp.down_proj.weight": w(H, INTER),
        p + "post_attention_layernorm.weight": torch.ones(H),
    }


@pytest.fixture(scope="module")
def eagle1(tmp_path_factory) -> Path:
    g = torch.Generator().manual_seed(11)
    t = {
        "fc.weight": torch.randn(H, 2 * H, generator=g) * 0.05,
        "fc.bias": torch.zeros(H),
        **_layer(g, "layers.0.", H),
    }
    return _save(tmp_path_factory.mktemp("eagle1"), _llama_cfg(bias=True), t)


@pytest.fixture(scope="module")
def eagle3(tmp_path_factory) -> Path:
    """A draft vocabulary of 600 of the 1000 target ids (d2t maps them): the scatter path."""
    g = torch.Generator().manual_seed(13)
    vd = 600
    ids = torch.randperm(VOCAB, generator=g)[:vd].sort().values
    p = "midlayer."
    t = {
        "fc.weight": torch.randn(H, 3 * H, generator=g) * 0.05,
        p + "input_layernorm.weight": torch.ones(H),
        p + "hidden_norm.weight": torch.ones(H),
        **_layer(g, p, 2 * H),
        "norm.weight": torch.ones(H),
        "lm_head.weight": torch.randn(vd, H, generator=g) * 0.05,
        "d2t": ids - torch.arange(vd),
    }
    cfg = _llama_cfg(draft_vocab_size=vd)
    cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    return _save(tmp_path_factory.mktemp("eagle3"), cfg, t)


@pytest.fixture(scope="module")
def mlp(tmp_path_factory) -> Path:
    g = torch.Generator().manual_seed(17)
    inner = 256
    t = {
        "emb.0.weight": torch.randn(VOCAB, inner, generator=g) * 0.1,
        "proj.0.weight": torch.randn(inner, H, generator=g) * 0.05,
        "proj.1.weight": torch.randn(inner, inner, generator=g) * 0.05,
        "head.0.weight": torch.randn(VOCAB, inner, generator=g) * 0.1,
        "ln.0.weight": torch.ones(inner),
        "ln.0.bias": torch.zeros(inner),
    }
    cfg = {
        "architectures": ["MLPSpeculatorPreTrainedModel"],
        "model_type": "mlp_speculator",
        "n_predict": 3,
        "emb_dim": H,
        "inner_dim": inner,
        "vocab_size": VOCAB,
        "tie_weights": True,
        "scale_input": True,
    }
    return _save(tmp_path_factory.mktemp("mlp"), cfg, t)


@pytest.fixture(scope="module")
def heads(draft, eagle1, eagle3, mlp, tmp_path_factory) -> dict[str, Path]:
    token_map = tmp_path_factory.mktemp("token_map") / "hot.json"
    token_map.write_text(json.dumps(list(range(0, VOCAB, 2))))
    return {
        "draft_model": draft,
        "eagle": eagle1,
        "eagle3": eagle3,
        "mlp_speculator": mlp,
        "token_map": token_map,
    }


def _spec(kind: str, heads: dict[str, Path]) -> dict | None:
    if kind == "plain":
        return None
    if kind == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 4}
    kind, _, tm = kind.partition("+")
    spec = {"method": kind, "model": str(heads[kind]), "num_speculative_tokens": 3}
    if tm:  # a token map of every other id: the draft's head over 500 of the 1000 rows
        spec["token_map"] = str(heads["token_map"])
    if kind == "eagle3":
        spec["aux_hidden_layers"] = [0, 1, 2]
    return spec


@pytest.mark.parametrize(
    "kind,eager",
    [
        ("plain", True),
        ("plain", False),
        ("ngram", False),
        ("draft_model", False),
        ("draft_model", True),
        ("eagle", False),
        ("eagle", True),
        ("mlp_speculator", False),
        ("mlp_speculator", True),
        ("draft_model+tm", False),
        ("eagle+tm", False),
        ("eagle+tm", True),
        ("mlp_speculator+tm", False),
    ],
)
def test_triton_greedy_equals_torch_path(
    target, heads, torch_path_greedy, kind, eager, monkeypatch
):
    """Triton kernels, eagerly and inside the engine's CUDA graphs (the draft loops of the draft
    model, EAGLE and the MLPSpeculator included), vs the eager torch path."""
    monkeypatch.delenv("SPECULANT_DISABLE_TRITON", raising=False)
    out = _generate(
        _llm(target, speculative_config=_spec(kind, heads), enforce_eager=eager), GREEDY
    )
    assert [len(o) for o in out] == [MAX_TOKENS] * len(PROMPT_LENS)
    for i, (a, b) in enumerate(zip(out, torch_path_greedy)):
        assert a == b, f"prompt {i} (len {PROMPT_LENS[i]}): triton {a} != torch {b}"
    torch.cuda.empty_cache()


@pytest.mark.parametrize("kind", ["plain", "eagle", "draft_model"])
def test_overlapped_steps_equal_torch_path(target, heads, torch_path_greedy, kind, monkeypatch):
    """Overlapped plain steps (engine/async_decode.py, on by default with CUDA graphs) and
    synchronous ones give the torch path's tokens; for a strategy, its plain steps (speculation
    disabled by batch size: 6 prompts) overlap, then it speculates alone on the last prompts."""
    monkeypatch.delenv("SPECULANT_DISABLE_TRITON", raising=False)
    spec = _spec(kind, heads)
    if spec is not None:
        spec["disable_by_batch_size"] = 3
    for async_scheduling in (None, False):
        llm = _llm(target, speculative_config=spec, async_scheduling=async_scheduling)
        assert (llm.engine.async_decoder is not None) == (async_scheduling is None)
        params = [GREEDY.clone(max_tokens=MAX_TOKENS - 6 * i) for i in range(len(PROMPT_LENS))]
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
        for i, (o, b) in enumerate(zip(outs, torch_path_greedy)):
            assert list(o.outputs[0].token_ids) == b[: MAX_TOKENS - 6 * i], f"prompt {i}"
    torch.cuda.empty_cache()


@pytest.mark.parametrize("kind", ["plain", "draft_model"])
def test_prefill_graphs_equal_torch_path(target, heads, torch_path_greedy, kind, monkeypatch):
    """Prefill steps replay token-bucket CUDA graphs (the six prompts, 589 tokens, in one
    640-token graph; the draft model's first feeds, one token longer each, in its own runner's)
    and give the torch path's tokens; with ``max_prefill_graph_tokens=0`` no prefill graph is
    captured and the tokens are the same."""
    monkeypatch.delenv("SPECULANT_DISABLE_TRITON", raising=False)
    for limit in (None, 0):
        llm = _llm(target, speculative_config=_spec(kind, heads), max_prefill_graph_tokens=limit)
        out = _generate(llm, GREEDY)
        runners = [llm.engine.runner]
        if kind != "plain":
            runners.append(llm.engine.spec.strategy.runner._runner)  # its forwards' runner
        for r in runners:
            g = r.graphs
            prefill = [key for key in g.graphs if key[2] > g.max_query]  # (B, M, Q, aux, head)
            assert bool(prefill) == (limit is None), list(g.graphs)
            assert all(M == Q and B == g.max_batch for B, M, Q, *_ in prefill)
        for i, (a, b) in enumerate(zip(out, torch_path_greedy)):
            assert a == b, f"prefill graphs {limit}, prompt {i}: {a} != torch {b}"
        del llm
        torch.cuda.empty_cache()


@pytest.mark.parametrize("kind", ["plain", "ngram", "eagle3"])
def test_startup_capture_covers_every_step(tiny_factory, target, heads, torch_path_greedy, kind,
                                           monkeypatch):
    """``cuda_graph_capture="startup"`` (the default) captures the target's decode,
    verification (k + 1 rows, EAGLE-3's residual streams included) and prefill graphs before
    the first request: generating the six ragged prompts then captures no new target graph,
    and gives the tokens of a lazily capturing engine (and of the torch path)."""
    monkeypatch.delenv("SPECULANT_DISABLE_TRITON", raising=False)
    tgt = target
    if kind == "eagle3":  # three layers for its three residual streams
        tgt = tiny_factory("llama", seed=0, **{**GEOMETRY, "num_hidden_layers": 3})
    outs = {}
    for mode in ("startup", "lazy"):
        llm = _llm(tgt, speculative_config=_spec(kind, heads), cuda_graph_capture=mode)
        g = llm.engine.runner.graphs
        before = set(g.graphs)
        assert bool(before) == (mode == "startup")
        if mode == "startup":
            aux = llm.engine.spec.aux_layers if llm.engine.spec else ()
            assert all(key[3] == tuple(aux) for key in before)
            assert any(key[2] > g.max_query for key in before)  # prefill buckets
        outs[mode] = _generate(llm, GREEDY)
        if mode == "startup":
            assert set(g.graphs) == before, sorted(set(g.graphs) - before)
            startup_keys = before
        else:
            assert set(g.graphs) <= startup_keys, sorted(set(g.graphs) - startup_keys)
        del llm
        torch.cuda.empty_cache()
    assert outs["startup"] == outs["lazy"]
    if kind != "eagle3":
        assert outs["startup"] == torch_path_greedy


@pytest.mark.parametrize("kind", ["ngram", "eagle3"])
def test_head_graphs_equal_the_eager_head(tiny_factory, target, heads, kind, monkeypatch):
    """Scored steps replayed through head graphs (the LM head and the greedy pack inside the
    verification graph, greedy verification on the host) give the tokens, and to fp32 rounding
    the log-probabilities, of the same engine with the LM head run eagerly after the graph
    (``HEAD_MAX_ROWS = 0``: the rejection kernels verify), top-N logprobs read from the head
    graph's logits included; and the head graphs are what ran."""
    from speculant.engine import cuda_graph

    monkeypatch.delenv("SPECULANT_DISABLE_TRITON", raising=False)
    tgt = target
    if kind == "eagle3":
        tgt = tiny_factory("llama", seed=0, **{**GEOMETRY, "num_hidden_layers": 3})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    outs = {}
    for rows in (cuda_graph.HEAD_MAX_ROWS, 0):
        monkeypatch.setattr(cuda_graph, "HEAD_MAX_ROWS", rows)
        llm = _llm(tgt, speculative_config=_spec(kind, heads))
        prompts = [{"prompt_token_ids": p} for p in _prompts()]
        res = llm.generate(prompts, params, use_tqdm=False)
        keys = set(llm.engine.runner.graphs.graphs)
        assert any(k[4] for k in keys) == (rows > 0), sorted(keys)
        assert llm.engine.spec.total.num_spec_steps > 0
        outs[rows] = [(list(o.outputs[0].token_ids), o.outputs[0].cumulative_logprob,
                       [sorted(d) for d in o.outputs[0].logprobs]) for o in res]
        del llm
        torch.cuda.empty_cache()
    for (toks, cum, tops), (toks0, cum0, tops0) in zip(outs[cuda_graph.HEAD_MAX_ROWS], outs[0]):
        assert toks == toks0
        assert cum == pytest.approx(cum0, rel=1e-4, abs=1e-3)
        assert tops == tops0


@pytest.mark.parametrize("kind", ["draft_model", "draft_model+tm", "eagle", "eagle3",
                                  "mlp_speculator"])
def test_strategy_startup_capture(tiny_factory, target, heads, kind, monkeypatch):
    """At start-up the strategy captures its own graphs too (the ``capture_graphs`` hook): the
    one-graph greedy proposes of every batch bucket and catch-up of up to k + 1 tokens (EAGLE's
    chains after longer catch-ups too, the draft model's runner graphs), on padding inputs.
    Generating the six ragged prompts then captures only the first proposes of the short
    prompts (catch-ups of 5-16 tokens), writes the tokens of a lazily capturing engine, and a
    startup engine's draft cache held nothing before the first request."""
    monkeypatch.delenv("SPECULANT_DISABLE_TRITON", raising=False)
    tgt = target
    if kind == "eagle3":
        tgt = tiny_factory("llama", seed=0, **{**GEOMETRY, "num_hidden_layers": 3})
    outs = {}
    for mode in ("startup", "lazy"):
        llm = _llm(tgt, speculative_config=_spec(kind, heads), cuda_graph_capture=mode)
        strat = llm.engine.spec.strategy
        before = set(strat.graphs.graphs)
        assert bool(before) == (mode == "startup")
        runner = getattr(strat, "runner", None)
        if mode == "startup" and runner is not None:  # the draft model: its runner's graphs
            assert runner.graphs.graphs
            assert not runner.kv_cache.any()  # padding steps wrote no K/V
        if mode == "startup" and hasattr(strat, "cache"):  # EAGLE's draft cache
            assert not any(k.any() or v.any() for k, v in strat.cache.kv_caches)
        outs[mode] = _generate(llm, GREEDY)
        if mode == "startup":
            new = set(strat.graphs.graphs) - before
            k1 = llm.engine.spec.k + 1
            # first proposes over short prompts only (their whole prompt is the catch-up)
            assert all(key[-2] > k1 for key in new if len(key) >= 3), sorted(new)
            assert not [key for key in new if len(key) == 2], sorted(new)  # stages / chains
        del llm
        torch.cuda.empty_cache()
    assert outs["startup"] == outs["lazy"]


@pytest.mark.parametrize("kind", ["plain", "draft_model"])
def test_one_row_gemv_path_equals_torch_path(target, heads, torch_path_greedy, kind, monkeypatch):
    """Batch-1 steps run the Llama layers as GEMVs with fused prologues (kernels/gemv.py) and RoPE
    fused with the K/V store, the draft model's one-row steps too: one prompt at a time, the
    torch path's tokens."""
    from speculant.models import llama

    monkeypatch.delenv("SPECULANT_DISABLE_TRITON", raising=False)
    calls = [0]
    real = llama.gemv

    def counting(*a, **kw):
        calls[0] += 1  # at capture time (replays do not come back to Python)
        return real(*a, **kw)

    monkeypatch.setattr(llama, "gemv", counting)
    llm = _llm(target, speculative_config=_spec(kind, heads))
    for i, p in enumerate(_prompts()[:3]):
        out = llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0].outputs[0]
        assert list(out.token_ids) == torch_path_greedy[i], f"prompt {i}"
    assert calls[0] > 0
    torch.cuda.empty_cache()


def test_eagle3_greedy_equals_plain(tiny_factory, heads, monkeypatch):
    """EAGLE-3 (fused features of 3 layers, 600-token draft vocabulary mapped by d2t) in CUDA
    graphs: the same greedy tokens as plain decoding of its 3-layer target."""
    monkeypatch.delenv("SPECULANT_DISABLE_TRITON", raising=False)
    target3 = tiny_factory("llama", seed=0, **{**GEOMETRY, "num_hidden_layers": 3})
    plain = _generate(_llm(target3), GREEDY)
    llm = _llm(target3, speculative_config=_spec("eagle3", heads))
    assert _generate(llm, GREEDY) == plain
    assert llm.get_metrics().num_draft_tokens > 0
    torch.cuda.empty_cache()


@pytest.mark.parametrize("kind", ["plain", "ngram", "draft_model", "eagle", "mlp_speculator"])
def test_random_sampling_runs_and_is_reproducible(target, heads, kind, monkeypatch):
    monkeypatch.delenv("SPECULANT_DISABLE_TRITON", raising=False)
    llm = _llm(target, speculative_config=_spec(kind, heads))
    a = _generate(llm, RANDOM)
    b = _generate(llm, RANDOM)
    assert a == b  # per-request seed
    for o in a:
        assert len(o) == MAX_TOKENS and all(0 <= t < VOCAB for t in o)
    torch.cuda.empty_cache()


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_eagle_one_graph_propose_equals_eager(tiny_factory, target, heads, kind, monkeypatch):
    """The whole greedy propose as one CUDA graph (drafting/head_graph.py: catch-up, gather,
    K draft steps) proposes exactly the drafts of the eager propose, step for step."""
    monkeypatch.delenv("SPECULANT_DISABLE_TRITON", raising=False)
    tgt = target
    if kind == "eagle3":
        tgt = tiny_factory("llama", seed=0, **{**GEOMETRY, "num_hidden_layers": 3})
    runs = []
    for graphs in (False, True):
        llm = _llm(tgt, speculative_config=_spec(kind, heads))
        strat = llm.engine.spec.strategy
        strat.graphs.enabled = graphs  # False: the eager propose (the target keeps its graphs)
        spec, seen = llm.engine.spec, []
        real = spec._propose

        def spy(batch, real=real, seen=seen):
            prop = real(batch)
            seen.append(prop.token_ids if prop is not None else None)
            return prop

        spec._propose = spy
        runs.append((_generate(llm, GREEDY), seen))
        if graphs:
            assert any(k[0] == "fused" for k in strat.graphs.graphs), list(strat.graphs.graphs)
        del llm
        torch.cuda.empty_cache()
    (out_e, seen_e), (out_g, seen_g) = runs
    assert out_g == out_e
    assert len(seen_g) == len(seen_e) and sum(map(bool, seen_g)) > 10
    for step, (a, b) in enumerate(zip(seen_g, seen_e)):
        assert a == b, f"step {step}: one-graph drafts {a} != eager {b}"


def test_draft_model_one_graph_propose_equals_eager(target, draft, monkeypatch):
    """The whole greedy draft-model propose as one CUDA graph (drafting/draft_graph.py: catch-up,
    gather, k draft steps) proposes exactly the drafts of the eager propose (the draft runner's
    graph per forward, LM head and argmax outside), step for step; the draft is the target too,
    so catch-ups of accepted drafts (query bucket 2) are exercised as well as bonus-only ones."""
    monkeypatch.delenv("SPECULANT_DISABLE_TRITON", raising=False)
    for d in (draft, target):
        runs = []
        for graphs in (False, True):
            spec = {"method": "draft_model", "model": str(d), "num_speculative_tokens": 3}
            llm = _llm(target, speculative_config=spec)
            strat = llm.engine.spec.strategy
            strat.graphs.enabled = graphs  # False: the eager propose (runner graphs per forward)
            spec_dec, seen = llm.engine.spec, []
            real = spec_dec._propose

            def spy(batch, real=real, seen=seen):
                prop = real(batch)
                seen.append(prop.token_ids if prop is not None else None)
                return prop

            spec_dec._propose = spy
            runs.append((_generate(llm, GREEDY), seen))
            if graphs:
                keys = list(strat.graphs.graphs)  # (Bp, Q, K)
                assert keys and (d is draft or 2 in {q for _, q, _ in keys}), keys
            del llm
            torch.cuda.empty_cache()
        (out_e, seen_e), (out_g, seen_g) = runs
        assert out_g == out_e
        assert len(seen_g) == len(seen_e) and sum(map(bool, seen_g)) > 10
        for step, (a, b) in enumerate(zip(seen_g, seen_e)):
            assert a == b, f"draft {d.name} step {step}: one-graph drafts {a} != eager {b}"
