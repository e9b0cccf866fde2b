"""Token maps (frequency-ranked draft vocabulary, FR-Spec; plugins/token_map.py): the file loader
and its errors, the builder and the ``speculant token-map`` command, and the ``token_map`` option of
EAGLE-1, MLPSpeculator and draft_model on tiny random checkpoints (tests/checkpoints.py): greedy
output identical to plain decoding, every draft inside the hot set (in the eager path and in the
one-graph greedy propose run eagerly on the CPU), sampled runs with q = 0 outside the hot set,
and hot logits equal to the full head's logits restricted to the hot ids."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoints import H, make_eagle1, make_mlp
from test_eagle_graph import _kernel_attention

import speculant.engine.attention as attention_mod
from speculant import LLM, SamplingParams
from speculant.cli import main
from speculant.plugins.token_map import (
    TokenMapError,
    build_token_map,
    count_tokens,
    load_token_map,
    special_token_ids,
)
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
    """The greedy draft loops that run as one CUDA graph on a GPU (eagle_graph.py, draft_graph.py,
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
            nxt, a = full.model.stage(j, state, toks)
            pairs.append((a, hot.model.stage(j, state, toks)[1]))
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
    from checkpoints import make_eagle3

    e3 = make_eagle3(tmp_path / "e3", V, 40, "safetensors", seed=3)
    with pytest.raises(StrategyError, match=r"token_map is not supported for EAGLE-3: .* d2t"):
        LLM(model=str(target), skip_tokenizer_init=True, device="cpu",
            speculative_config={"model": str(e3), "token_map": str(hot_file)})  # fmt: skip
