"""EAGLE-1 and EAGLE-3 strategies on tiny random checkpoints written here in the published layouts.

EAGLE-1 (``yuhuili/EAGLE-*``): a Llama ``config.json`` (``architectures: ["LlamaForCausalLM"]``,
``num_hidden_layers`` draft layers, optional ``bias``) and ``pytorch_model.bin`` with ``fc.weight``
``[H, 2H]``, ``fc.bias``, ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``layers.{i}.post_attention_layernorm.weight``,
``layers.{i}.input_layernorm.weight`` for i > 0 only, and a frozen copy ``embed_tokens.weight``.

EAGLE-3 (``yuhuili/EAGLE3-*``): ``config.json`` with ``architectures: ["LlamaForCausalLMEagle3"]``
and ``draft_vocab_size``; tensors ``fc.weight`` ``[H, 3H]``, ``midlayer.{input_layernorm,
hidden_norm,post_attention_layernorm}.weight``, ``midlayer.self_attn.{q,k,v}_proj.weight``
``[*, 2H]``, ``midlayer.self_attn.o_proj.weight``, ``midlayer.mlp.*``, ``norm.weight``,
``lm_head.weight`` ``[draft_vocab, H]``, ``d2t`` (int64 offsets, ``[draft_vocab]``) and ``t2d``
(bool, ``[vocab]``).

The tests check greedy equivalence with plain decoding (batch 1 and 8, both file formats), that
the drafted tokens are exactly what an independent float64 re-implementation of the published
EAGLE forward computes from the target's (Hugging Face) hidden states, method inference from the
path alone, and clear errors for mismatched checkpoints."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from checkpoints import (
    EPS,
    HD,
    NH,
    NKV,
    THETA,
    eagle1_tensors,
    eagle3_tensors,
    llama_config,
    make_eagle1,
    make_eagle3,
    smollm_eagle_heads,
    write_checkpoint,
)

from speculant import LLM, SamplingParams
from speculant.spec_registry import StrategyError, get_strategy, infer_method

SMALL_V = 64
TARGET_LAYERS = 7  # EAGLE-3's default feature layers (2, L // 2, L - 3) = (2, 3, 4) are distinct


# --------------------------------------------------------------------------------------------
# an independent float64 reference of the published EAGLE forward passes
# --------------------------------------------------------------------------------------------
def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _rope(x: torch.Tensor) -> torch.Tensor:  # x: [T, heads, HD], positions 0..T-1
    inv = 1.0 / THETA ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD)  # [HD / 2]
    ang = torch.arange(x.shape[0], dtype=torch.float64)[:, None] * inv[None]  # [T, HD / 2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None]  # [T, 1, HD]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    x1, x2 = x[..., : HD // 2], x[..., HD // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _attention(x: torch.Tensor, t: dict, p: str) -> torch.Tensor:  # x: [T, in] -> [T, H]
    T = x.shape[0]
    q = _rope((x @ t[p + "self_attn.q_proj.weight"].T).view(T, NH, HD))
    k = _rope((x @ t[p + "self_attn.k_proj.weight"].T).view(T, NKV, HD))
    v = (x @ t[p + "self_attn.v_proj.weight"].T).view(T, NKV, HD)
    k, v = k.repeat_interleave(NH // NKV, 1), v.repeat_interleave(NH // NKV, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HD)  # [NH, T, T]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    att = scores.masked_fill(~causal, -math.inf).softmax(-1)
    out = torch.einsum("hqk,khd->qhd", att, v).reshape(T, NH * HD)
    return out @ t[p + "self_attn.o_proj.weight"].T


def _mlp(x: torch.Tensor, t: dict, p: str) -> torch.Tensor:
    gate = F.silu(x @ t[p + "mlp.gate_proj.weight"].T)
    return (gate * (x @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T


def ref_eagle1(t: dict, emb: torch.Tensor, hid: torch.Tensor, layers: int) -> torch.Tensor:
    """emb, hid: [T, H] -> draft outputs [T, H] (the target's LM head gives the logits)."""
    x = torch.cat([emb, hid], -1) @ t["fc.weight"].T
    if "fc.bias" in t:
        x = x + t["fc.bias"]
    for i in range(layers):
        p = f"layers.{i}."
        norm = t.get(p + "input_layernorm.weight")  # absent for layer 0: no input norm
        x = x + _attention(x if norm is None else _rms(x, norm), t, p)
        x = x + _mlp(_rms(x, t[p + "post_attention_layernorm.weight"]), t, p)
    return x


def ref_eagle3(t: dict, emb: torch.Tensor, hid: torch.Tensor) -> torch.Tensor:
    """emb: [T, H]; hid: [T, H] (fc already applied to target rows) -> outputs [T, H]."""
    p = "midlayer."
    cat = torch.cat(
        [_rms(emb, t[p + "input_layernorm.weight"]), _rms(hid, t[p + "hidden_norm.weight"])], -1
    )  # [T, 2H]
    x = hid + _attention(cat, t, p)
    return x + _mlp(_rms(x, t[p + "post_attention_layernorm.weight"]), t, p)


class Reference:
    """Draft tokens a greedy EAGLE head proposes after a given context, computed from scratch:
    the target's features come from Hugging Face transformers, the head from ``ref_eagle*``."""

    def __init__(self, target: Path, ckpt: Path, version: int, aux_layers=(2, 3, 4)) -> None:
        from transformers import AutoModelForCausalLM

        self.hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float64).eval()
        self.version, self.aux = version, tuple(aux_layers)
        from speculant.drafting import iter_checkpoint

        self.t = {
            k: v.double() if v.is_floating_point() else v for _f, k, v in iter_checkpoint(ckpt)
        }
        self.layers = json.loads((ckpt / "config.json").read_text())["num_hidden_layers"]

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[tuple[int, float]]:
        """(draft token, margin between the best and second-best draft logit) for k steps."""
        hf, t = self.hf, self.t
        self.top_probs: list[float] = []  # the head's probability of each draft (softmax)
        ids = torch.tensor([tokens[:-1]])
        out = hf.model(ids, output_hidden_states=True)
        embed = hf.model.embed_tokens.weight  # [V, H]
        if self.version == 1:
            feats = out.last_hidden_state[0]  # [n - 1, H]: final-norm states, position p -> p + 1
        else:  # residual stream entering the chosen layers, concatenated, through fc
            feats = torch.cat([out.hidden_states[i][0] for i in self.aux], -1) @ t["fc.weight"].T
        seq, hid, res = list(tokens[1:]), feats, []
        for _ in range(k):
            emb = embed[torch.tensor(seq)]
            if self.version == 1:
                x = ref_eagle1(t, emb, hid, self.layers)
                logits = hf.lm_head(x[-1])
            else:
                x = ref_eagle3(t, emb, hid)
                small = _rms(x[-1], t["norm.weight"]) @ t["lm_head.weight"].T  # [draft_vocab]
                logits = torch.full((embed.shape[0],), -math.inf, dtype=torch.float64)
                logits[torch.arange(small.shape[0]) + t["d2t"]] = small
            top = logits.topk(2)
            tok = int(top.indices[0])
            res.append((tok, float(top.values[0] - top.values[1])))
            self.top_probs.append(float(torch.softmax(logits, -1)[tok]))
            seq.append(tok)
            hid = torch.cat([hid, x[-1:]])
        return res


# --------------------------------------------------------------------------------------------
# helpers and fixtures
# --------------------------------------------------------------------------------------------
def prompts_for(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 14, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (m,), generator=g).tolist() for m in lens]


MAX_TOKENS = [24, 13, 30, 9, 21, 26, 17, 15]  # different lengths: the batch shrinks over time


def greedy_params(n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS[:n]]


def generate_ids(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def small_target(tiny_factory) -> Path:
    return tiny_factory(
        "llama", vocab_size=SMALL_V, tokenizer=False, num_hidden_layers=TARGET_LAYERS
    )


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return prompts_for(SMALL_V, 8, seed=1)


@pytest.fixture(scope="module")
def reference(small_target, prompts) -> list[list[int]]:
    llm = LLM(model=str(small_target), skip_tokenizer_init=True, max_num_seqs=8)
    return generate_ids(llm, prompts, greedy_params(8))


@pytest.fixture(scope="module")
def ckpts(small_target, tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("eagle")
    return {
        "eagle-bin": make_eagle1(d / "e1bin", small_target, SMALL_V, "bin", seed=1),
        "eagle-safetensors": make_eagle1(
            d / "e1st",
            small_target,
            SMALL_V,
            "safetensors",
            layers=2,
            bias=False,
            seed=2,
            copy=True,
        ),
        "eagle3-safetensors": make_eagle3(
            d / "e3st", SMALL_V, 40, "safetensors", seed=3, target=small_target
        ),
        "eagle3-bin": make_eagle3(d / "e3bin", SMALL_V, SMALL_V, "bin", seed=4),
    }


COPY_HEADS = ("eagle-safetensors", "eagle3-safetensors")  # the others are plain random heads


def spy_proposals(llm: LLM) -> list[tuple[list[list[int]], list[list[int]]]]:
    """Record (token ids of each sequence, drafts of each sequence) of every speculative step."""
    spec, seen = llm.engine.spec, []
    real = spec._propose

    def spy(batch):
        prop = real(batch)
        if prop is not None:
            seen.append(([list(s.token_ids) for s in batch.seqs], prop.token_ids))
        return prop

    spec._propose = spy
    return seen


# --------------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bs", [1, 8])
@pytest.mark.parametrize(
    "which", ["eagle-bin", "eagle-safetensors", "eagle3-safetensors", "eagle3-bin"]
)
def test_greedy_matches_plain_decoding(small_target, ckpts, prompts, reference, which, bs):
    method = which.split("-")[0]
    llm = LLM(
        model=str(small_target),
        skip_tokenizer_init=True,
        max_num_seqs=8,
        speculative_config={"model": str(ckpts[which]), "num_speculative_tokens": 3},
    )
    assert llm.engine.spec.name == method  # inferred from the checkpoint alone
    got = generate_ids(llm, prompts[:bs], greedy_params(bs))
    assert got == reference[:bs]
    m = llm.get_metrics()
    assert m.num_spec_steps > 0 and m.num_draft_tokens > 0
    if which in COPY_HEADS and bs == 8:  # accepted and rejected drafts both happen
        assert 0.1 < m.acceptance_rate < 0.95, m.as_dict()


@pytest.mark.parametrize("which", ["eagle-bin", "eagle-safetensors", "eagle3-safetensors"])
def test_drafts_match_a_reference_implementation(small_target, ckpts, prompts, which):
    """Every draft of every step equals what the published EAGLE forward (re-implemented here
    in float64, fed with Hugging Face's target hidden states) proposes for that context: this
    checks the key mapping, the layer-0 norm, the [embedding, hidden] order, the EAGLE-3 feature
    layers and d2t, and the draft KV cache kept across steps (accepted and rejected drafts)."""
    version = 3 if which.startswith("eagle3") else 1
    k = 3
    llm = LLM(
        model=str(small_target),
        skip_tokenizer_init=True,
        max_num_seqs=8,
        speculative_config={"model": str(ckpts[which]), "num_speculative_tokens": k},
    )
    seen = spy_proposals(llm)
    generate_ids(llm, prompts[:4], greedy_params(4))
    ref = Reference(small_target, ckpts[which], version)
    checked = 0
    for token_lists, drafts in seen:
        for toks, got in zip(token_lists, drafts):
            want = ref.drafts(toks, len(got))
            for j, (g, (w, margin)) in enumerate(zip(got, want)):
                if margin < 1e-3:  # a near tie: float32 may break it either way; stop here
                    break
                assert g == w, (toks, got, want, j)
                checked += 1
    assert checked > 60, checked


@pytest.mark.slow  # a 49152-token vocabulary (~2.5 s busy)
def test_eagle3_big_vocab_with_tokenizer(tiny_factory, tmp_path):
    """The SmolLM2-size vocabulary (49152) with a 512-token draft vocabulary mapped through d2t,
    text prompts, default feature layers, batch 8 and 1; EAGLE-1 on the same target."""
    target = tiny_factory("llama", num_hidden_layers=TARGET_LAYERS)
    texts = [
        "Hello there",
        "The capital of France is",
        "def f(x):",
        "1, 2, 3, 4,",
        "Once upon a time",
        "import torch",
        "a b c d e f",
        "Speculative decoding",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = LLM(model=str(target), max_num_seqs=8)
    ref = [o.outputs[0].token_ids for o in plain.generate(texts, params, use_tqdm=False)]
    e3 = make_eagle3(tmp_path / "e3", 49152, 512, "safetensors", seed=5)
    e1 = make_eagle1(tmp_path / "e1", target, 49152, "bin", seed=6)
    for ckpt, name in ((e3, "eagle3"), (e1, "eagle")):
        llm = LLM(model=str(target), max_num_seqs=8, speculative_config={"model": str(ckpt)})
        assert llm.engine.spec.name == name and llm.engine.spec.k == 5  # the default k
        for bs in (8, 1):
            outs = llm.generate(texts[:bs], params, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == ref[:bs]
        assert llm.get_metrics().num_draft_tokens > 0


def test_explicit_aux_layers_and_aliases(small_target, ckpts, prompts, reference):
    """``aux_hidden_layers`` picks the EAGLE-3 feature layers (the reference agrees), and the
    method names / aliases resolve to the same strategies."""
    ckpt = ckpts["eagle3-safetensors"]
    llm = LLM(
        model=str(small_target),
        skip_tokenizer_init=True,
        max_num_seqs=8,
        speculative_config={
            "method": "eagle3",
            "model": str(ckpt),
            "num_speculative_tokens": 2,
            "aux_hidden_layers": [5, 0, 6],
        },
    )
    assert llm.engine.spec.aux_layers == (0, 5, 6)
    seen = spy_proposals(llm)
    assert generate_ids(llm, prompts[:2], greedy_params(2)) == reference[:2]
    ref = Reference(small_target, ckpt, 3, aux_layers=(0, 5, 6))
    toks, drafts = seen[0][0][0], seen[0][1][0]
    want = ref.drafts(toks, len(drafts))
    assert drafts == [w for w, _ in want] and min(m for _, m in want) > 1e-3
    assert get_strategy("eagle-1") is get_strategy("eagle1") is get_strategy("eagle")
    assert get_strategy("eagle-3") is get_strategy("eagle3")


def test_prompt_lookup_before_the_head(small_target, ckpts, prompts):
    """``prompt_lookup_min``: a sequence whose last n tokens (2 <= n <= 4) occurred earlier
    proposes the tokens that followed their most recent occurrence (what the ngram method
    would, ``find_draft``), the others the head's drafts; greedy output stays plain decoding's,
    with batch 1 and 4, and the head keeps drafting correctly after lookup steps."""
    from speculant.drafting import find_draft

    repeated = [p + p[:6] + p for p in prompts[:4]]  # copies to look up
    plain = LLM(model=str(small_target), skip_tokenizer_init=True, max_num_seqs=8)
    want = generate_ids(plain, repeated, greedy_params(4))
    for bs in (1, 4):
        llm = LLM(model=str(small_target), skip_tokenizer_init=True, max_num_seqs=8,
                  speculative_config={"model": str(ckpts["eagle-safetensors"]),
                                      "num_speculative_tokens": 3, "prompt_lookup_min": 2})
        seen = spy_proposals(llm)
        assert generate_ids(llm, repeated[:bs], greedy_params(bs)) == want[:bs]
        looked = headed = 0
        for token_lists, drafts in seen:
            for toks, got in zip(token_lists, drafts):
                found = find_draft(torch.tensor(toks), 2, 4, 3)
                if found and got:
                    assert got == found[: len(got)], (toks, got, found)
                    looked += 1
                elif got:
                    headed += 1
        assert looked >= 2 * bs and headed >= 2 * bs, (looked, headed)
        assert llm.get_metrics().num_accepted_tokens > 0


def test_prompt_lookup_options_and_one_hot_rows():
    """The options are checked (min <= max, with the fix in the message); a lookup chain in a
    batch with sampled head drafts gets one-hot rows of ``Proposal.probs``, widened when the
    chain is longer than the head's drafts; other rows are kept."""
    from pydantic import ValidationError

    from speculant.drafting import merge_lookups
    from speculant.spec_types import Proposal

    Config = get_strategy("eagle").Config
    assert Config(model="x", prompt_lookup_min=2).prompt_lookup_max == 4
    with pytest.raises(ValidationError, match="raise prompt_lookup_max"):
        Config(model="x", prompt_lookup_min=5)
    q = torch.rand(2, 2, 5)
    q /= q.sum(-1, keepdim=True)
    merged = merge_lookups(Proposal(token_ids=[[1, 2], []], probs=q.clone()), {1: [3, 4, 0]})
    assert merged.token_ids == [[1, 2], [3, 4, 0]]
    assert merged.probs.shape == (2, 3, 5)
    assert torch.equal(merged.probs[0, :2], q[0])
    assert torch.equal(merged.probs[1], torch.eye(5)[[3, 4, 0]])
    greedy = merge_lookups(Proposal(token_ids=[[], [7]]), {0: [5]})
    assert greedy.token_ids == [[5], [7]] and greedy.probs is None


# thresholds that cut these random heads' chains at different lengths (their drafts' top
# probabilities differ widely: a 64-token vocabulary, EAGLE-3's own sharper head)
@pytest.mark.parametrize("which, stop", [("eagle-safetensors", 0.05), ("eagle3-safetensors", 0.9)])
def test_confidence_stop(small_target, ckpts, prompts, reference, which, stop):
    """``confidence_stop``: each chain keeps the drafts whose running product of the head's top
    probabilities stays >= the threshold (checked against the float64 reference head, skipping
    products within 1e-3 of it and near ties), so chains of several lengths happen (none: a
    plain step); greedy output stays plain decoding's, alone and in a batch of 8."""
    version = 3 if which.startswith("eagle3") else 1
    k = 3
    spec = {"model": str(ckpts[which]), "num_speculative_tokens": k, "confidence_stop": stop}
    for bs in (1, 8):
        llm = LLM(model=str(small_target), skip_tokenizer_init=True, max_num_seqs=8,
                  speculative_config=spec)
        seen = spy_proposals(llm)
        assert generate_ids(llm, prompts[:bs], greedy_params(bs)) == reference[:bs]
    ref = Reference(small_target, ckpts[which], version)
    lengths, checked = set(), 0
    for token_lists, drafts in seen:
        for toks, got in zip(token_lists, drafts):
            want = ref.drafts(toks, k)
            run, kept, near = 1.0, 0, False
            for (_w, margin), p in zip(want, ref.top_probs):
                run *= p
                near |= abs(run - stop) < 1e-3 or margin < 1e-3
                if run < stop:
                    break
                kept += 1
            if near:
                continue
            assert got == [w for w, _ in want[:kept]], (toks, got, want, ref.top_probs)
            lengths.add(len(got))
            checked += 1
    assert checked > 30 and 0 in lengths and len(lengths) >= 2, (checked, lengths)
    m = llm.get_metrics()
    assert m.num_draft_tokens < k * m.num_spec_steps


def test_confidence_stop_sampled_and_options(small_target, ckpts, prompts):
    """Sampled rows stop by the same rule (their chains shorten and the run finishes, seeded
    output reproducible); the option must lie in (0, 1)."""
    from pydantic import ValidationError

    spec = {"model": str(ckpts["eagle-safetensors"]), "num_speculative_tokens": 3,
            "confidence_stop": 0.05}
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=n)
              for i, n in enumerate(MAX_TOKENS[:4])]
    outs = []
    for _ in range(2):
        llm = LLM(model=str(small_target), skip_tokenizer_init=True, max_num_seqs=8,
                  speculative_config=spec)
        seen = spy_proposals(llm)
        outs.append(generate_ids(llm, prompts[:4], params))
        lens = {len(d) for _, drafts in seen for d in drafts}
        assert len(lens) > 1 and max(lens) <= 3, lens
    assert outs[0] == outs[1]
    Config = get_strategy("eagle").Config
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValidationError, match="confidence_stop"):
            Config(model="x", confidence_stop=bad)


def test_method_inference_from_path(ckpts, tmp_path):
    assert infer_method(str(ckpts["eagle-bin"])) == "eagle"
    assert infer_method(str(ckpts["eagle-safetensors"])) == "eagle"
    assert infer_method(str(ckpts["eagle3-safetensors"])) == "eagle3"
    assert infer_method(str(ckpts["eagle3-bin"])) == "eagle3"


def test_wrong_hidden_size_is_explained(small_target, tmp_path):
    """An EAGLE head trained for a target with another hidden size: a StrategyError naming the
    config file, both sizes and the fix, not a shape error from torch."""
    cfg = llama_config(SMALL_V, 1, hidden=32)
    e1 = write_checkpoint(tmp_path / "e1", cfg, eagle1_tensors(small_target, hidden=32))
    with pytest.raises(StrategyError) as e:
        LLM(
            model=str(small_target), skip_tokenizer_init=True, speculative_config={"model": str(e1)}
        )
    msg = str(e.value)
    assert str(e1 / "config.json") in msg and "hidden_size=32" in msg and "64" in msg
    assert "EAGLE checkpoint trained for this target" in msg

    cfg3 = llama_config(
        SMALL_V, 1, hidden=32, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=SMALL_V
    )
    e3 = write_checkpoint(tmp_path / "e3", cfg3, eagle3_tensors(SMALL_V, SMALL_V, hidden=32))
    with pytest.raises(StrategyError) as e:
        LLM(
            model=str(small_target), skip_tokenizer_init=True, speculative_config={"model": str(e3)}
        )
    msg = str(e.value)
    assert str(e3 / "config.json") in msg and "hidden_size=32" in msg and "64" in msg
    assert "EAGLE-3 checkpoint trained for this target" in msg


def test_bad_checkpoints(small_target, ckpts, tmp_path):
    def build(ckpt, **extra):
        return LLM(
            model=str(small_target),
            skip_tokenizer_init=True,
            speculative_config={"model": str(ckpt), **extra},
        )

    # the wrong vocabulary
    cfg = llama_config(100, 1)
    bad = write_checkpoint(tmp_path / "v", cfg, eagle1_tensors(small_target))
    with pytest.raises(StrategyError, match=r"config\.json: vocab_size=100 .* 64 tokens"):
        build(bad)
    # EAGLE-1 checkpoint asked for as EAGLE-3 and the reverse
    with pytest.raises(StrategyError, match=r"EAGLE-1 checkpoint.*use method 'eagle'"):
        build(ckpts["eagle-bin"], method="eagle3")
    with pytest.raises(StrategyError, match=r"EAGLE-3 checkpoint.*use method 'eagle3'"):
        build(ckpts["eagle3-bin"], method="eagle")
    # a missing tensor, an unknown tensor, a wrong shape: each names the file
    t = eagle1_tensors(small_target)
    missing = dict(t)
    del missing["layers.0.mlp.up_proj.weight"]
    bad = write_checkpoint(tmp_path / "missing", llama_config(SMALL_V, 1), missing)
    with pytest.raises(StrategyError, match=r"pytorch_model\.bin.*missing.*up_proj"):
        build(bad)
    extra = dict(t, **{"layers.0.self_attn.extra.weight": torch.zeros(3)})
    bad = write_checkpoint(tmp_path / "extra", llama_config(SMALL_V, 1), extra)
    with pytest.raises(StrategyError, match=r"pytorch_model\.bin.*unexpected.*extra\.weight"):
        build(bad)
    t3 = eagle3_tensors(SMALL_V, 40)
    t3["d2t"] = t3["d2t"][:10]
    cfg3 = llama_config(SMALL_V, 1, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=40)
    bad = write_checkpoint(tmp_path / "d2t", cfg3, t3, "safetensors")
    with pytest.raises(StrategyError, match=r"model\.safetensors: d2t has shape \(10,\)"):
        build(bad)
    # EAGLE-3 on a target too shallow for the default feature layers
    with pytest.raises(StrategyError, match=r"aux_hidden_layers"):
        LLM(
            model=str(small_target),
            skip_tokenizer_init=True,
            speculative_config={"model": str(ckpts["eagle3-bin"]), "aux_hidden_layers": [1, 2, 9]},
        )
    with pytest.raises(StrategyError, match="unknown option"):
        build(ckpts["eagle-bin"], aux_hidden_layers=[1, 2, 3])


@pytest.mark.slow
def test_smollm_random_heads_are_lossless(smollm, tmp_path):
    """Random EAGLE-1 / EAGLE-3 heads shaped for the embedded SmolLM2-135M (hidden 576, 9 query /
    3 KV heads of 64, rope_theta 1e5, 30 layers: EAGLE-3 reads layers 2, 15, 27; tied target
    embedding / LM head): greedy output identical to plain decoding. Random heads are (almost)
    never accepted; this checks shapes and plumbing at a real model size, not acceptance."""
    e1, e3 = smollm_eagle_heads(tmp_path, smollm.engine.hf_config, smollm.engine.vocab_size)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in smollm.generate(prompts, params, use_tqdm=False)]
    for ckpt, name in ((e1, "eagle"), (e3, "eagle3")):
        llm = LLM(
            model=str(smollm.engine.model_path),
            max_num_seqs=4,
            speculative_config={"model": str(ckpt), "num_speculative_tokens": 3},
        )
        assert llm.engine.spec.name == name
        if name == "eagle3":
            assert llm.engine.spec.aux_layers == (2, 15, 27)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
        assert llm.get_metrics().num_draft_tokens > 0
