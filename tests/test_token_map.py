"""Token maps (frequency-ranked draft vocabulary, FR-Spec; drafting/token_map.py): the file loader
and its errors, the builder and the ``speculant token-map`` command, and the ``token_map`` option of
EAGLE-1, MLPSpeculator and draft_model on tiny random checkpoints (tests/checkpoints.py): greedy
output identical to plain decoding, every draft inside the hot set (in the eager path and in the
one-graph greedy propose run eagerly on the CPU), sampled runs with q = 0 outside the hot set,
and hot logits equal to the full head's logits restricted to the hot ids. Greedy drafting takes
the argmax over the hot logits and maps it through the hot ids (``hot_argmax``): the token the
argmax of the -inf-filled full-vocabulary row gives, ties included, checked on tie-laden logits,
in every strategy (EAGLE-3's draft vocabulary too) and against runs that draft with the full
rows."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoints import (
    H,
    eagle3_tensors,
    llama_config,
    make_eagle1,
    make_eagle3,
    make_mlp,
    target_embedding,
    write_checkpoint,
)
from test_eagle_graph import _kernel_attention
from torch import nn

import speculant.drafting.token_map as token_map_mod
import speculant.models.attention as attention_mod
import speculant.plugins.eagle as eagle_mod
import speculant.plugins.mlp_speculator as mlp_mod
from speculant import LLM, SamplingParams
from speculant.cli import main
from speculant.drafting import prepare_cpu_linears
from speculant.drafting.token_map import (
    HotHead,
    TokenMapError,
    build_token_map,
    count_tokens,
    hot_argmax,
    load_token_map,
    scatter_hot,
    special_token_ids,
)
from speculant.kernels.logprobs import row_argmax
from speculant.spec_registry import StrategyError

V = 64
HOT = list(range(0, V, 2))  # 32 hot ids: the even ones
COLD = [i for i in range(V) if i not in HOT]
K = 3
MAX_TOKENS = [20, 14, 24, 11]


# --------------------------------------------------------------------------------------------
# the loader
# --------------------------------------------------------------------------------------------
def _write(path: Path, obj) -> Path:
    """Write ``obj`` in the format of ``path``'s suffix (raw text for .txt / str objects)."""
    if isinstance(obj, str):
        path.write_text(obj)
    elif path.suffix == ".pt":
        torch.save(obj, path)
    elif path.suffix == ".json":
        path.write_text(json.dumps(obj))
    elif path.suffix == ".npy":
        np.save(path, obj)
    else:
        raise AssertionError(path)
    return path


IDS = [9, 1, 33, 5, 62, 0]  # unsorted on purpose


@pytest.mark.parametrize(
    "name,obj",
    [
        ("map.pt", torch.tensor(IDS)),  # SGLang's --speculative-token-map: a tensor ...
        ("list.pt", IDS),  # ... or a list, torch.save'd
        ("int32.pt", torch.tensor(IDS, dtype=torch.int32)),
        ("map.json", IDS),
        ("map.npy", np.array(IDS, dtype=np.int32)),
        ("map.txt", "9 1\n33\t5\n62\n0\n"),
    ],
)
def test_load_formats(tmp_path, name, obj):
    ids = load_token_map(_write(tmp_path / name, obj), V)
    assert ids.dtype == torch.int64 and ids.dim() == 1
    assert ids.tolist() == sorted(IDS)


BAD = [
    ("2d.pt", torch.tensor([[1, 2], [3, 4]]), r"shape \(2, 2\), expected a 1-D list"),
    ("float.pt", torch.tensor([1.0, 2.0]), r"float32 values, expected integer token ids"),
    ("bool.pt", torch.tensor([True, False]), r"torch.bool values, expected integer"),
    ("dict.pt", {"ids": torch.tensor([1])}, r"holds a dict, expected a 1-D integer tensor"),
    ("empty.pt", torch.tensor([], dtype=torch.long), r"is empty"),
    ("float.json", [1, 2.5], r"holds 2\.5 \(float\), expected integer token ids"),
    ("bool.json", [1, True], r"holds True \(bool\)"),
    ("nested.json", [[1, 2], [3]], r"element 0 is a list, expected a 1-D list"),
    ("obj.json", {"ids": [1]}, r"expected a JSON list of token ids, got a dict"),
    ("broken.json", "[1, 2", r"invalid JSON"),
    ("empty.json", [], r"is empty"),
    ("float.npy", np.array([1.0, 2.0]), r"float64 values, expected integer"),
    ("2d.npy", np.zeros((2, 3), dtype=np.int64), r"shape \(2, 3\)"),
    ("empty.txt", "\n  \n", r"is empty"),
    ("word.txt", "4 x 6", r"entry 1 is 'x', not an integer token id"),
    ("range.txt", "3 64 1", r"1 id\(s\) outside the model's vocabulary \[0, 64\) \(e\.g\. 64\)"),
    ("negative.json", [3, -1], r"outside the model's vocabulary \[0, 64\) \(e\.g\. -1\)"),
    ("dup.txt", "3 7 3 9", r"1 duplicate id\(s\) \(e\.g\. 3 appears 2 times\)"),
    ("map.csv", "1,2,3", r"unknown file type '\.csv'; use one of \.pt, \.pth, \.json"),
]


@pytest.mark.parametrize("name,obj,match", BAD, ids=[b[0] for b in BAD])
def test_load_errors_name_the_file_and_the_fix(tmp_path, name, obj, match):
    path = _write(tmp_path / name, obj)
    with pytest.raises(TokenMapError, match=match) as e:
        load_token_map(path, V)
    assert f"token map {path}" in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(TokenMapError, match=r"no such file; fix the token_map path or build one"):
        load_token_map(tmp_path / "nope.pt", V)
    with pytest.raises(TokenMapError, match=r"is a directory, not a file"):
        load_token_map(tmp_path, V)


# --------------------------------------------------------------------------------------------
# the builder and the CLI
# --------------------------------------------------------------------------------------------
def test_build_from_ids_and_counts():
    stream = [5] * 4 + [2] * 3 + [9] * 3 + [7] + [1]  # 9 and 2 tie: the lower id first
    assert build_token_map(stream, 3).tolist() == [2, 5, 9]
    assert build_token_map(iter(stream), 2).tolist() == [2, 5]
    assert build_token_map(stream, 2, always=[0]).tolist() == [0, 5]
    # counts indexed by id (tensor, array, mapping) are the same thing
    counts = count_tokens(stream, vocab_size=12)
    assert counts.shape == (12,) and counts[5] == 4
    for c in (counts, torch.tensor(counts), {5: 4, 2: 3, 9: 3, 7: 1, 1: 1}):
        assert build_token_map(c, 3).tolist() == [2, 5, 9]
    # ids never seen come last, by id, up to the vocabulary size
    assert build_token_map(stream, 7, vocab_size=12).tolist() == [0, 1, 2, 3, 5, 7, 9]
    with pytest.raises(TokenMapError, match=r"size=13: a token map holds between 1 and .* 12"):
        build_token_map(stream, 13, vocab_size=12)
    with pytest.raises(TokenMapError, match=r"smaller than the 3 ids that must be included"):
        build_token_map(stream, 2, always=[0, 1, 3])
    with pytest.raises(TokenMapError, match=r"token id 9 was counted but the vocabulary has 8"):
        build_token_map(stream, 2, vocab_size=8)


def _tiny_tokenizer(folder: Path) -> Path:
    """A 24-token word-level tokenizer (4 special tokens, words w0..w19), written locally."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "<s>", "</s>", "<pad>"] + [f"w{i}" for i in range(20)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>", eos_token="</s>",
        pad_token="<pad>",
    )  # fmt: skip
    fast.save_pretrained(str(folder))
    return folder


def test_cli_builds_the_most_frequent_ids(tmp_path, capsys):
    tok = _tiny_tokenizer(tmp_path / "tok")  # word wN has id N + 4
    (tmp_path / "a.txt").write_text("w3 w3 w5 w0\nw7 w3 w5\n\nw19 w0\n")
    with open(tmp_path / "b.jsonl", "w") as f:
        f.write(json.dumps({"text": "w7 w7 w7 w7 w12", "id": 1}) + "\n\n")
        f.write(json.dumps({"text": "w12 w12 w0"}) + "\n")
    # counts: w7 5, w3 3, w0 3, w12 3, w5 2, w19 1; ties (w0 4, w3 7, w12 16) by the lower id
    out = tmp_path / "hot.pt"
    argv = ["token-map", "--tokenizer", str(tok), "--corpus", str(tmp_path / "a.txt"),
            str(tmp_path / "b.jsonl"), "--size", "8", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    specials = [0, 1, 2, 3]  # always kept, though they never occur
    ids = torch.load(out, weights_only=True)
    assert ids.dtype == torch.int64
    assert ids.tolist() == sorted(specials + [4 + 7, 4 + 0, 4 + 3, 4 + 12])  # w7, w0, w3, w12
    assert load_token_map(out, 24).tolist() == ids.tolist()
    printed = capsys.readouterr().out
    assert "wrote 8 of 24 token ids" in printed
    assert "cover 82.35% of the corpus's 17 tokens" in printed  # 14 of 17: all but w5, w19
    # other output formats, --include, and the same ids from the Python API
    for suffix in (".json", ".npy", ".txt"):
        more = [str(out.with_suffix(suffix)), "--include", "23", "--no-progress"]
        assert main([*argv[:-1], *more]) == 0
        got = load_token_map(out.with_suffix(suffix), 24).tolist()
        assert got == sorted(specials + [23, 11, 4, 7]), suffix  # 23 (w19) forced in, w12 out
    from transformers import AutoTokenizer

    assert special_token_ids(AutoTokenizer.from_pretrained(str(tok))) == specials


def test_cli_errors(tmp_path, capsys):
    tok = _tiny_tokenizer(tmp_path / "tok")
    (tmp_path / "bad.jsonl").write_text('{"text": "w1"}\n{"body": "w2"}\n')
    base = ["token-map", "--tokenizer", str(tok), "--size", "6", "--out", str(tmp_path / "o.pt")]
    assert main([*base, "--corpus", str(tmp_path / "bad.jsonl")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'bad.jsonl'}:2: no string field 'text'" in err and "--text-field" in err
    assert main([*base, "--corpus", str(tmp_path / "missing.txt")]) == 2
    assert "corpus file" in capsys.readouterr().err
    (tmp_path / "ok.txt").write_text("w1 w2\n")
    assert main([*base[:-1], str(tmp_path / "o.csv"), "--corpus", str(tmp_path / "ok.txt")]) == 2
    assert "unknown file type '.csv'" in capsys.readouterr().err
    assert main([*base[:3], "--size", "3", *base[5:], "--corpus", str(tmp_path / "ok.txt")]) == 2
    assert "smaller than the 4 ids that must be included" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# the strategies
# --------------------------------------------------------------------------------------------
def _prompts(n: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    lens = torch.randint(4, 13, (n,), generator=g).tolist()
    return [torch.randint(3, V, (m,), generator=g).tolist() for m in lens]


def _greedy() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]


def _ids(llm: LLM, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _spy(llm: LLM) -> list:
    """Every speculative step's Proposal (its drafts and, when sampled, its q)."""
    spec, seen = llm.engine.spec, []
    real = spec._propose

    def spy(batch):
        prop = real(batch)
        if prop is not None:
            seen.append(prop)
        return prop

    spec._propose = spy
    return seen


def _drafted(seen: list) -> set[int]:
    return {t for prop in seen for toks in prop.token_ids for t in toks}


@pytest.fixture(scope="module")
def target(tiny_factory) -> Path:
    return tiny_factory("llama", vocab_size=V, tokenizer=False, num_hidden_layers=3)


@pytest.fixture(scope="module")
def plain(target) -> list[list[int]]:
    llm = LLM(model=str(target), skip_tokenizer_init=True, device="cpu", max_num_seqs=4)
    return _ids(llm, _greedy())


@pytest.fixture(scope="module")
def hot_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tokmap") / "hot.pt"
    torch.save(torch.tensor(HOT[::-1]), path)  # any order: the loader sorts
    return path


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory) -> dict[str, dict]:
    d = tmp_path_factory.mktemp("heads")
    return {
        "eagle": {"model": str(make_eagle1(d / "e1", target, V, "safetensors", seed=2, copy=True))},
        "mlp_speculator": {"model": str(make_mlp(d / "mlp", emb_dim=H, vocab=V, seed=3))},
        "draft_model": {"model": str(target)},  # the target as its own draft
        # no token_map: its own draft vocabulary (40 of the 64 ids, ascending, mapped by d2t)
        "eagle3": {"model": str(make_eagle3(d / "e3", V, 40, seed=3, target=target))},
    }


def _llm(target: Path, heads: dict, method: str, token_map: Path | None, **kw) -> LLM:
    spec = {"method": method, **heads[method], "num_speculative_tokens": K}
    if token_map is not None:
        spec["token_map"] = str(token_map)
    return LLM(model=str(target), skip_tokenizer_init=True, device="cpu", max_num_seqs=4,
               speculative_config=spec, **kw)  # fmt: skip


METHODS = ["eagle", "mlp_speculator", "draft_model"]


@pytest.mark.parametrize("method", METHODS)
def test_greedy_is_lossless_and_drafts_stay_hot(target, plain, heads, hot_file, method):
    # without a token map the proposer drafts cold tokens too: the hot-set check below can fail
    llm = _llm(target, heads, method, None)
    seen = _spy(llm)
    assert _ids(llm, _greedy()) == plain
    assert _drafted(seen) & set(COLD), "the plain proposer never drafted a cold token"

    llm = _llm(target, heads, method, hot_file)
    assert llm.engine.spec.name == method
    seen = _spy(llm)
    assert _ids(llm, _greedy()) == plain  # token for token
    drafted = _drafted(seen)
    assert drafted and drafted <= set(HOT), sorted(drafted - set(HOT))
    m = llm.get_metrics()
    assert m.num_draft_tokens > 0 and m.num_spec_steps > 0
    if method != "mlp_speculator":  # a copy head / the target itself: hot drafts get accepted
        assert m.num_accepted_tokens > 0, m.as_dict()


@pytest.mark.parametrize("method", METHODS)
def test_sampled_run_with_token_map(target, heads, hot_file, method):
    llm = _llm(target, heads, method, hot_file, seed=5)
    seen = _spy(llm)
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=11 + i, max_tokens=m, ignore_eos=True)
        for i, m in enumerate(MAX_TOKENS)
    ]
    out = _ids(llm, params)
    assert [len(o) for o in out] == MAX_TOKENS
    assert all(0 <= t < V for o in out for t in o)
    assert _ids(llm, params) == out  # seeded: reproducible
    drafted = _drafted(seen)
    assert drafted and drafted <= set(HOT)
    qs = [p.probs for p in seen if p.probs is not None]
    assert qs, "sampled drafts must carry their distribution q"
    for q in qs:  # q is a distribution over the hot ids only
        assert float(q[..., COLD].abs().max()) == 0.0
    assert llm.get_metrics().num_draft_tokens > 0


@pytest.mark.parametrize("method", METHODS)
def test_one_graph_greedy_propose_uses_the_token_map(target, heads, hot_file, method, monkeypatch):
    """The greedy draft loops that run as one CUDA graph on a GPU (head_graph.py, draft_graph.py,
    MLPSpeculatorStrategy._greedy_graph), here run eagerly on the CPU: they draft hot tokens only
    and the output stays the plain greedy output."""
    monkeypatch.setattr(attention_mod, "attention", _kernel_attention)
    ref = _ids(LLM(model=str(target), skip_tokenizer_init=True, device="cpu", max_num_seqs=4), _greedy())
    llm = _llm(target, heads, method, hot_file)
    strat = llm.engine.spec.strategy
    if method == "draft_model":
        strat.model._cpu_plan = False  # the layers' path, attention through attend()
    graphs, calls = strat.graphs, []
    graphs.enabled = True

    def replay(key, fn):  # "capture" = run the graph's function on the static inputs
        calls.append(key)
        return fn(*graphs.inputs[key])

    monkeypatch.setattr(graphs, "replay", replay)
    seen = _spy(llm)
    assert _ids(llm, _greedy()) == ref
    assert len(calls) > len(seen) // 2, (len(calls), len(seen))  # mostly the graph function
    drafted = _drafted(seen)
    assert drafted and drafted <= set(HOT)


@pytest.mark.parametrize("mapped", [False, True])
def test_mlp_speculator_graph_drafts_equal_eager(target, heads, hot_file, mapped, monkeypatch):
    """The MLPSpeculator's one-graph greedy propose (its inputs staged through the graph cache's
    pinned host vector, copied by the graph's first node) drafts exactly what the eager stages
    draft, step by step; every call's inputs are written only after the last replay was read
    back."""
    runs = []
    for graph in (False, True):
        llm = _llm(target, heads, "mlp_speculator", hot_file if mapped else None)
        graphs, calls = llm.engine.spec.strategy.graphs, []
        if graph:
            graphs.enabled = True

            def replay(key, fn, graphs=graphs, calls=calls):  # "capture": fn on the inputs
                calls.append(key)
                out = fn(*graphs.inputs[key])
                graphs.inflight = True  # as GraphCache.replay
                return out

            def writable(host, graphs=graphs, real=graphs.writable):
                # the last replay's drafts were read back (split_drafts marked it): no wait
                assert not graphs.inflight
                return real(host)

            monkeypatch.setattr(graphs, "replay", replay)
            monkeypatch.setattr(graphs, "writable", writable)
        seen = _spy(llm)
        out = _ids(llm, _greedy())
        assert bool(calls) == graph
        runs.append((out, [p.token_ids for p in seen]))
    assert runs[0] == runs[1]


def _strategies(target, heads, hot_file, method):
    full = _llm(target, heads, method, None).engine.spec.strategy
    hot = _llm(target, heads, method, hot_file).engine.spec.strategy
    return full, hot


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("method", METHODS)
@torch.inference_mode()
def test_hot_logits_equal_the_full_head_on_the_hot_ids(target, heads, hot_file, method, rows):
    full, hot = _strategies(target, heads, hot_file, method)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, H, generator=g)  # [rows, H]
    if method == "eagle":
        pairs = [(full._logits(x), hot._logits(x))]
    elif method == "draft_model":
        pairs = [(full.draft_logits(x), hot.draft_logits(x))]
    else:  # every stage's head, on the same states
        toks = torch.randint(0, V, (rows,), generator=g)  # [rows]
        state, pairs = full.model.prepare_state(x), []
        for j in range(3):
            nxt, a = full.model.stage_head(j, state, toks)
            b = hot.model.expand(hot.model.stage_head(j, state, toks)[1])
            pairs.append((full.model.expand(a), b))
            state = nxt
        assert hot.model.head[0].weight.shape == (len(HOT), 32)  # the full heads are gone
    for a, b in pairs:  # [rows, V] each
        assert a.shape == b.shape == (rows, V) and b.dtype == torch.float32
        torch.testing.assert_close(b[:, HOT], a[:, HOT], rtol=1e-5, atol=1e-5)
        assert bool(torch.isneginf(b[:, COLD]).all())
        assert not torch.equal(a[:, COLD], b[:, COLD])  # the full head differs there


def test_bad_token_map_options(target, heads, tmp_path):
    bad = tmp_path / "big.json"
    bad.write_text(json.dumps([1, 2, V]))
    for method in METHODS:
        want = rf"token map {re.escape(str(bad))}: 1 id\(s\) outside .*\[0, {V}\)"
        with pytest.raises(StrategyError, match=want):
            _llm(target, heads, method, bad)
    with pytest.raises(StrategyError, match=r"token map .*nope\.pt: no such file"):
        _llm(target, heads, "draft_model", tmp_path / "nope.pt")


def test_eagle3_refuses_a_token_map(target, tmp_path, hot_file):
    e3 = make_eagle3(tmp_path / "e3", V, 40, "safetensors", seed=3)
    with pytest.raises(StrategyError, match=r"token_map is not supported for EAGLE-3: .* d2t"):
        LLM(model=str(target), skip_tokenizer_init=True, device="cpu",
            speculative_config={"model": str(e3), "token_map": str(hot_file)})  # fmt: skip


# --------------------------------------------------------------------------------------------
# greedy drafting over the hot logits: hot_argmax is the argmax of the full -inf-filled row
# --------------------------------------------------------------------------------------------
def _full_row_argmax(small: torch.Tensor, ids: torch.Tensor, vocab: int = V) -> torch.Tensor:
    """What greedy drafting computed before hot_argmax: [rows, N] -> [rows] via [rows, vocab]."""
    return row_argmax(scatter_hot(small, ids, vocab))


def test_hot_argmax_by_hand():
    ids = torch.tensor([3, 7, 9, 20])  # [N] ascending
    small = torch.tensor(
        [
            [1.0, 5.0, 5.0, 2.0],  # 7 and 9 tie: the lower id
            [4.0, 4.0, 4.0, 4.0],  # all tie: 3
            [0.0, 1.0, 2.0, 2.0],  # 9 and 20 tie: 9
            [-1.0, -3.0, -2.0, -1.0],  # 3 and 20 tie: 3
            [0.0, 0.0, 1.0, 0.0],  # 9 alone (hot index 2: the token id, not the index)
        ]
    )  # [rows, N]
    want = [7, 3, 9, 3, 9]
    got = hot_argmax(small, ids)
    assert got.dtype == torch.int64 and got.tolist() == want
    assert _full_row_argmax(small, ids, 32).tolist() == want
    # a map without the full head's argmax (11): the best hot token, as the -inf row gives
    full = torch.full((1, 32), -5.0)
    full[0, 11] = 9.0
    full[0, ids] = torch.tensor([1.0, 2.0, 2.0, 0.0])
    assert row_argmax(full).tolist() == [11]
    assert hot_argmax(full[:, ids], ids).tolist() == [7]
    assert _full_row_argmax(full[:, ids], ids, 32).tolist() == [7]
    # the one documented difference: hot logits all -inf (the full row's argmax is token 0)
    assert hot_argmax(torch.full((1, 4), -math.inf), ids).tolist() == [3]


@pytest.mark.parametrize("n", [1, 5, 32, 63])
@pytest.mark.parametrize("seed", [0, 1])
def test_hot_argmax_is_the_full_row_argmax_with_ties(n, seed):
    g = torch.Generator().manual_seed(100 * seed + n)
    ids = torch.randperm(V, generator=g)[:n].sort().values  # [n] ascending
    cold = next(i for i in range(V) if i not in set(ids.tolist()))
    full = torch.randint(-3, 3, (300, V), generator=g).float()  # [rows, V]: 6 values, many ties
    full[:, cold] = 9.0  # the full head's argmax, outside the map
    small = full[:, ids].contiguous()  # [rows, n]
    got = hot_argmax(small, ids)
    assert got.shape == (300,) and got.dtype == torch.int64
    assert torch.equal(got, _full_row_argmax(small, ids))
    top = small == small.max(-1, keepdim=True).values  # [rows, n]: the maxima of each row
    if n > 1:
        assert int((top.sum(-1) > 1).sum()) > 50  # the premise: plenty of tied rows
    assert got.tolist() == [int(ids[t].min()) for t in top]  # the lowest tied id
    assert cold not in got.tolist()


@pytest.mark.parametrize("prepared", [False, True], ids=["plain", "cpu_linear"])
@torch.inference_mode()
def test_hot_head_greedy_is_the_argmax_of_its_full_rows(prepared):
    """HotHead.greedy == row_argmax(HotHead(x)) on integer weights and states (exact products:
    ties are exact whatever the summation order), with duplicated hot rows and cold rows that
    hold most rows' full-head argmax; the ids are sorted whatever order they come in."""
    g = torch.Generator().manual_seed(7)
    hd, rows = 16, 64
    w = torch.randint(-2, 3, (V, hd), generator=g).float()  # [V, hd]
    w[HOT[4]] = w[HOT[9]] = w[HOT[2]]  # duplicated hot rows: exact ties
    w[HOT[30]] = w[HOT[11]]
    w[COLD] *= 4
    x = torch.randint(-2, 3, (rows, hd), generator=g).float()  # [rows, hd]
    like = None
    if prepared:  # the CPU-prepared copy (as a loaded target's lm_head)
        from speculant.models.loader import prepare_cpu_linears

        like = nn.Linear(hd, V, bias=False)
        like.weight = nn.Parameter(w.clone(), requires_grad=False)
        prepare_cpu_linears(like)
    head = HotHead(w, torch.tensor(HOT[::-1]), V, like=like)
    assert head.ids.tolist() == HOT
    small = head.small(x)  # [rows, N]
    got = head.greedy(x)  # [rows]
    assert torch.equal(got, row_argmax(head(x)))
    top = small == small.max(-1, keepdim=True).values
    assert int((top.sum(-1) > 1).sum()) >= 5  # tied rows
    assert got.tolist() == [HOT[int(t.nonzero()[0])] for t in top]
    outside = torch.isin(row_argmax(x @ w.T), torch.tensor(COLD))  # the map misses the argmax
    assert int(outside.sum()) > rows // 2
    assert not bool(torch.isin(got, torch.tensor(COLD)).any())


STRATEGIES = [*METHODS, "eagle3"]
LIVE = [0, 1, 7]  # the head rows (hot / draft-vocabulary index) left random by _tie_heads


def _tie_pattern(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """[rows, cols] head rows, zero but ``LIVE`` (random). A zero row's logit is exactly 0 for
    any input, so wherever the live rows' logits are all negative the argmax is an exact tie of
    every zero row, whose lowest id (index 2, not 0) must win."""
    w = torch.zeros(rows, cols)
    w[LIVE] = torch.randn(len(LIVE), cols, generator=g)
    return w


@torch.no_grad()
def _tie_heads(strat, method: str, seed: int = 11) -> torch.Tensor | None:
    """Give the strategy's drafting head tie-laden hot rows (``_tie_pattern``). EAGLE-1 and the
    draft model: a new HotHead over a full head [V, H] whose cold rows are large (returned: the
    full head's argmax is mostly outside the map); MLPSpeculator: every stage's hot head;
    EAGLE-3: its draft-vocabulary head."""
    g = torch.Generator().manual_seed(seed)
    if method in ("eagle", "draft_model"):
        w = torch.randn(V, H, generator=g) * 4  # [V, H]
        w[HOT] = _tie_pattern(len(HOT), H, g)
        like = strat.model.lm_head if method == "draft_model" else strat.target.lm_head
        strat.hot = HotHead(w.to(like.weight.dtype), torch.tensor(HOT), V, like=like)
        return w
    heads = strat.model.head if method == "mlp_speculator" else [strat.draft.lm_head]
    for head in heads:
        head.weight.copy_(_tie_pattern(*head.weight.shape, g))  # [N or draft vocab, inner]
        prepare_cpu_linears(head)  # a CPU head's Linear keeps a blocked copy: remake it
    return None


def _lowest_zero_row(strat, method: str) -> int:
    return int(strat.targets[2]) if method == "eagle3" else HOT[2]


def _strategy(target, heads, hot_file, method: str):
    token_map = None if method == "eagle3" else hot_file
    return _llm(target, heads, method, token_map).engine.spec.strategy


@pytest.mark.parametrize("method", STRATEGIES)
@torch.inference_mode()
def test_greedy_choice_is_the_full_row_argmax_with_ties(target, heads, hot_file, method):
    """Each strategy's greedy choice (draft_greedy, _greedy, MLPSpeculatorModel.greedy) on
    tie-laden heads equals the argmax of the full-vocabulary rows its sampled path uses."""
    strat = _strategy(target, heads, hot_file, method)
    w = _tie_heads(strat, method)
    rows = 96
    g = torch.Generator().manual_seed(5)
    if method == "draft_model":
        x = torch.randn(rows, H, generator=g)  # [rows, H] final hidden states
        got, full = strat.draft_greedy(x), strat.draft_logits(x)
    elif method == "mlp_speculator":
        model = strat.model
        state = model.prepare_state(torch.randn(rows, H, generator=g))
        toks = torch.randint(0, V, (rows,), generator=g)  # [rows]
        got, full = [], []
        for j in range(3):  # every stage's head
            state, small = model.stage_head(j, state, toks)  # [rows, N]
            assert small.shape == (rows, len(HOT))
            got.append(model.greedy(small))
            full.append(model.expand(small))  # [rows, V]
            toks = got[-1]
        got, full = torch.cat(got), torch.cat(full)
    else:
        x = torch.randn(rows, strat.draft.lm_head.weight.shape[1] if method == "eagle3" else H,
                        generator=g)  # fmt: skip
        got, full = strat._greedy(x), strat._logits(x)
    assert full.shape[1] == V and got.dtype == torch.int64 and got.shape == full.shape[:1]
    assert torch.equal(got, row_argmax(full))
    tied = (full == full.max(-1, keepdim=True).values).sum(-1) > 1  # the premise: exact ties
    assert int(tied.sum()) >= 3, int(tied.sum())
    assert set(got[tied].tolist()) == {_lowest_zero_row(strat, method)}
    if w is not None:  # the map leaves out the full head's argmax of most rows
        outside = torch.isin(row_argmax(x @ w.T), torch.tensor(COLD))
        assert int(outside.sum()) > rows // 2
        assert not bool(torch.isin(got, torch.tensor(COLD)).any())


def _full_row_greedy(strat, method: str) -> list[int]:
    """Make ``strat`` draft greedily as before hot_argmax (row_argmax over full-vocabulary
    rows). Returns a list that counts the tied rows it sees."""
    ties = [0]

    def choose(full: torch.Tensor) -> torch.Tensor:  # [rows, V] -> [rows]
        ties[0] += int(((full == full.max(-1, keepdim=True).values).sum(-1) > 1).sum())
        return row_argmax(full)

    if method == "draft_model":
        strat.draft_greedy = lambda h: choose(strat.draft_logits(h))
    elif method == "mlp_speculator":
        strat.model.greedy = lambda logits: choose(strat.model.expand(logits))
    else:
        strat._greedy = lambda x: choose(strat._logits(x))
    return ties


def _no_full_rows(*args, **kw):
    raise AssertionError("greedy drafting built a full-vocabulary row (scatter_hot)")


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "one_graph"])
@pytest.mark.parametrize("method", STRATEGIES)
def test_greedy_drafts_equal_full_row_argmax_drafts(target, heads, hot_file, plain, method, graph,
                                                     monkeypatch):  # fmt: skip
    """Whole greedy runs on tie-laden heads, in the eager path and in the one-graph greedy
    propose (draft_graph.py, head_graph.py, the MLPSpeculator's and EAGLE's greedy graphs, run
    eagerly on the CPU): every draft of every step equals that of a run taking the argmax of
    full-vocabulary rows, and the greedy run builds no full-vocabulary row at all."""
    if graph:
        monkeypatch.setattr(attention_mod, "attention", _kernel_attention)
    runs = []
    for old in (False, True):
        llm = _llm(target, heads, method, None if method == "eagle3" else hot_file)
        strat = llm.engine.spec.strategy
        _tie_heads(strat, method)
        calls: list = []
        if graph:
            if method == "draft_model":
                strat.model._cpu_plan = False  # the layers' path, attention through attend()
            graphs = strat.graphs
            graphs.enabled = True

            def replay(key, fn, graphs=graphs, calls=calls):  # "capture": run fn on the inputs
                calls.append(key)
                return fn(*graphs.inputs[key])

            monkeypatch.setattr(graphs, "replay", replay)
        ties = _full_row_greedy(strat, method) if old else None
        seen = _spy(llm)
        with monkeypatch.context() as m:
            if not old:
                for mod in (token_map_mod, mlp_mod, eagle_mod):
                    m.setattr(mod, "scatter_hot", _no_full_rows)
            out = _ids(llm, _greedy())
        assert bool(calls) == graph
        runs.append((out, [p.token_ids for p in seen], ties))
    (new, new_drafts, _), (ref, ref_drafts, ties) = runs
    assert new == ref
    if not graph:
        assert new == plain  # lossless
    assert new_drafts == ref_drafts  # draft for draft
    assert any(t for step in new_drafts for t in step)
    assert ties[0] > 0, "no tied row in the reference run: the ties went untested"


@torch.inference_mode()
def test_eagle3_draft_vocabulary_out_of_order(target, tmp_path):
    """An EAGLE-3 d2t whose target ids do not ascend with the draft ids (the EAGLE-3 scripts
    write them ascending): mapping the first maximum's draft index would not give the lowest
    target id, so greedy drafting goes through the full row there and still equals its argmax."""
    t = eagle3_tensors(V, 40, 3, embedding=target_embedding(target))
    sel = torch.arange(40) + t["d2t"]
    t["d2t"] = sel.flip(0) - torch.arange(40)  # descending target ids
    cfg = llama_config(V, 1, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=40)
    e3 = write_checkpoint(tmp_path / "e3", cfg, t, "safetensors")
    llm = LLM(model=str(target), skip_tokenizer_init=True, device="cpu", max_num_seqs=4,
              speculative_config={"model": str(e3), "num_speculative_tokens": K})  # fmt: skip
    strat = llm.engine.spec.strategy
    assert strat.name == "eagle3" and not strat.ascending_targets
    _tie_heads(strat, "eagle3")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(96, strat.draft.lm_head.weight.shape[1], generator=g)  # [rows, H]
    got, full = strat._greedy(x), strat._logits(x)
    assert torch.equal(got, row_argmax(full))
    tied = (full == full.max(-1, keepdim=True).values).sum(-1) > 1
    assert int(tied.sum()) >= 3
    # hot_argmax's premise fails here: it would pick the highest target id of the tie
    assert not torch.equal(hot_argmax(strat._draft_logits(x), strat.targets)[tied], got[tied])
