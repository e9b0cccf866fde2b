"""Lossless sampling for every seed strategy: with the seeds' temperature 0.8 / top-p 0.95, the
first three tokens generated through ngram, draft_model, mlp_speculator, eagle and eagle3 follow
the target's exact distribution.

The target is a tiny random Llama with a 32-token vocabulary whose LM head is scaled by 3 (a
peaky distribution, about 15 tokens inside top-p: tight bounds, and a drafter's bias shows). Its exact joint distribution of
the first three sampled tokens is computed from Hugging Face's implementation in float64 with the
vLLM temperature / top-p rule written out here (no sampling involved). Each strategy draws N
samples; the empirical distributions of t1, t2, t3, (t1, t2) and (t2, t3) must be within a
total-variation bound that holds with probability > 1 - 1e-4 per strategy (Jensen for the
expectation, McDiarmid for the deviation, a union bound over the five checks). A negative control
shows the same check rejects a verifier that accepts drafts without the min(1, p/q) test."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from test_eagle import make_eagle1, make_eagle3

from speculant import LLM, SamplingParams

V = 32
TEMPERATURE, TOP_P = 0.8, 0.95
N = 2000
K = 3
PROMPT = [5, 9, 14, 5, 9, 21, 5]  # repeated n-grams: the ngram proposer finds some
DELTA = 1e-4
LAYERS = 3  # target depth; EAGLE-3 reads the residual stream entering each of the three layers


def processed_probs(logits: torch.Tensor) -> torch.Tensor:
    """[rows, V] logits -> [rows, V] float64 sampling distribution: softmax(logits / T), then the
    smallest set of most likely tokens whose mass reaches top_p (vLLM's rule), renormalized."""
    p = torch.softmax(logits.double() / TEMPERATURE, -1)
    sorted_p, order = p.sort(-1, descending=True)
    mass_before = sorted_p.cumsum(-1) - sorted_p  # mass of the strictly more likely tokens
    keep_sorted = mass_before < TOP_P
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    p = torch.where(keep, p, torch.zeros_like(p))
    return p / p.sum(-1, keepdim=True)


def exact_joint(target: Path) -> torch.Tensor:
    """P(t1, t2, t3) [V, V, V] of the first three sampled tokens after PROMPT."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float64).eval()
    with torch.no_grad():
        p1 = processed_probs(hf(torch.tensor([PROMPT])).logits[:, -1])[0]  # [V]
        two = torch.tensor([PROMPT + [a] for a in range(V)])
        p2 = processed_probs(hf(two).logits[:, -1])  # [V(t1), V(t2)]
        three = torch.tensor([PROMPT + [a, b] for a in range(V) for b in range(V)])
        p3 = processed_probs(hf(three).logits[:, -1]).view(V, V, V)  # [t1, t2, t3]
    return p1[:, None, None] * p2[:, :, None] * p3


def tv_bound(p: torch.Tensor, n: int, delta: float) -> float:
    """With probability >= 1 - delta the empirical distribution of n draws from p is within
    this total variation of p: E[TV] <= 1/2 sum sqrt(p (1 - p) / n) (Jensen, per cell) and one
    draw moves TV by at most 1/n (McDiarmid)."""
    p = p.flatten()
    return float(0.5 * (p * (1 - p) / n).sqrt().sum() + math.sqrt(math.log(1 / delta) / (2 * n)))


def checks(toks: torch.Tensor, joint: torch.Tensor) -> list[tuple[str, float, float]]:
    """(name, TV, bound) for t1, t2, t3, (t1, t2), (t2, t3); toks: [n, 3]."""
    n = toks.shape[0]
    items = [
        ("t1", toks[:, 0], joint.sum((1, 2))),
        ("t2", toks[:, 1], joint.sum((0, 2))),
        ("t3", toks[:, 2], joint.sum((0, 1))),
        ("t1,t2", toks[:, 0] * V + toks[:, 1], joint.sum(2)),
        ("t2,t3", toks[:, 1] * V + toks[:, 2], joint.sum(0)),
    ]
    out = []
    for name, samples, p in items:
        emp = torch.bincount(samples, minlength=p.numel()).double() / n
        tv = float(0.5 * (emp - p.flatten()).abs().sum())
        out.append((name, tv, tv_bound(p, n, DELTA / len(items))))
    return out


# --------------------------------------------------------------------------------------------
# checkpoints
# --------------------------------------------------------------------------------------------
def make_mlp_speculator(path: Path, hidden: int, n_predict: int, seed: int) -> Path:
    """A random MLPSpeculator in the ibm-ai-platform layout (``speculator.``-prefixed)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    inner = 32
    cfg = {
        "architectures": ["MLPSpeculatorPreTrainedModel"],
        "model_type": "mlp_speculator",
        "emb_dim": hidden,
        "inner_dim": inner,
        "n_predict": n_predict,
        "vocab_size": V,
        "tie_weights": False,
        "scale_input": False,
        "top_k_tokens_per_head": [1] * n_predict,
    }
    t = {}
    for i in range(n_predict):
        t[f"speculator.emb.{i}.weight"] = torch.randn(V, inner, generator=g) * 0.5
        t[f"speculator.proj.{i}.weight"] = torch.randn(
            inner, hidden if i == 0 else inner, generator=g
        ) / math.sqrt(inner)
        t[f"speculator.head.{i}.weight"] = torch.randn(V, inner, generator=g) * 0.3
        t[f"speculator.ln.{i}.weight"] = 1 + 0.1 * torch.randn(inner, generator=g)
        t[f"speculator.ln.{i}.bias"] = 0.1 * torch.randn(inner, generator=g)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(t, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def target(tiny_factory, tmp_path_factory) -> Path:
    from safetensors.torch import load_file, save_file

    base = tiny_factory("llama", vocab_size=V, tokenizer=False, num_hidden_layers=LAYERS)
    path = tmp_path_factory.mktemp("peaky")
    for f in base.iterdir():
        if f.is_file():
            shutil.copy(f, path / f.name)
    weights = load_file(str(base / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"] * 3  # [V, H]
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def joint(target) -> torch.Tensor:
    return exact_joint(target)


@pytest.fixture(scope="module")
def configs(target, tiny_factory, tmp_path_factory) -> dict[str, dict]:
    d = tmp_path_factory.mktemp("dist")
    draft = tiny_factory("llama", vocab_size=V, tokenizer=False, seed=1, num_hidden_layers=1)
    e1 = str(make_eagle1(d / "e1", target, V, seed=3, copy=True))
    return {
        "ngram": {"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1},
        "draft_model": {"model": str(draft)},
        "mlp_speculator": {"model": str(make_mlp_speculator(d / "mlp", 64, K, seed=2))},
        # fc passes the target's state through (a plain random head drafts tokens outside the
        # target's top-p set, so nothing would be accepted)
        "eagle": {"model": e1},
        # prompt lookup before the head: lookup chains (point masses, one-hot rows of probs)
        # and sampled head drafts in the same batches
        "eagle_lookup": {"model": e1, "prompt_lookup_min": 1},
        # a 24-token draft vocabulary: 8 target tokens can only come from the residual
        "eagle3": {
            "model": str(make_eagle3(d / "e3", V, 24, seed=4)),
            "aux_hidden_layers": [0, 1, 2],
        },
    }


def sample(target: Path, spec: dict, seed: int = 0) -> tuple[torch.Tensor, LLM]:
    llm = LLM(
        model=str(target),
        skip_tokenizer_init=True,
        max_num_seqs=N,
        seed=seed,
        max_num_batched_tokens=N * len(PROMPT),
        speculative_config={**spec, "num_speculative_tokens": K},
    )
    params = SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, max_tokens=3, ignore_eos=True)
    outs = llm.generate([PROMPT] * N, params, use_tqdm=False)  # N independent requests
    toks = torch.tensor([o.outputs[0].token_ids for o in outs])  # [N, 3]
    assert toks.shape == (N, 3)
    return toks, llm


# --------------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------------
# the default run: a draft model (~3-4 s on a busy 2-core machine); the other four are slow
# (EAGLE's sampling runs in the default run's negative control below, n-gram's in
# test_spec_decode.py's test_sampling_follows_target_distribution)
@pytest.mark.parametrize("method", [pytest.param("ngram", marks=pytest.mark.slow), "draft_model",
                                    pytest.param("mlp_speculator", marks=pytest.mark.slow),
                                    pytest.param("eagle", marks=pytest.mark.slow),
                                    pytest.param("eagle_lookup", marks=pytest.mark.slow),
                                    pytest.param("eagle3", marks=pytest.mark.slow)])
def test_sampling_follows_the_target_distribution(target, joint, configs, method):
    toks, llm = sample(target, configs[method])
    assert llm.engine.spec.name == method.removesuffix("_lookup")
    m = llm.get_metrics()
    # drafts were made, and both accepted and rejected: the rejection path was exercised
    assert m.num_draft_tokens > N and 50 < m.num_accepted_tokens < m.num_draft_tokens, m.as_dict()
    assert m.num_faults == 0, m.as_dict()  # every proposal valid: none was dropped
    results = checks(toks, joint)
    for name, tv, bound in results:
        assert tv < bound, f"{method} {name}: TV {tv:.4f} >= bound {bound:.4f} ({results})"


# the default run: the negative control with a draft model and EAGLE; the other three are slow
@pytest.mark.parametrize("method", [pytest.param("ngram", marks=pytest.mark.slow), "draft_model",
                                    pytest.param("mlp_speculator", marks=pytest.mark.slow), "eagle",
                                    pytest.param("eagle3", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_the_check_rejects_blind_acceptance(target, joint, configs, method, monkeypatch):
    """Negative control: forcing every acceptance uniform to 0 accepts each draft the target
    does not rule out (p > 0), whatever min(1, p/q) says; the output then follows the drafter,
    and the same check must fail."""
    import speculant.plugins.rejection_sampler as rs

    real = rs.rejection_sample

    def accept_all(draft_ids, num_draft, draft_probs, target_probs, greedy, u_acc, u_smp, **kw):
        return real(
            draft_ids,
            num_draft,
            draft_probs,
            target_probs,
            greedy,
            torch.zeros_like(u_acc),
            u_smp,
            **kw,
        )

    monkeypatch.setattr(rs, "rejection_sample", accept_all)
    toks, _ = sample(target, configs[method])
    failed = [name for name, tv, bound in checks(toks, joint) if tv >= bound]
    assert {"t2", "t2,t3"} & set(failed), checks(toks, joint)
    assert "t1" not in failed  # the first token never comes from a draft


def test_seed_strategy_names_resolve_and_paths_infer_the_method(target, configs):
    """The seeds' names all resolve, and a ``model`` path alone (no ``method``) picks the
    strategy from the checkpoint: EAGLE-1 / EAGLE-3 / MLPSpeculator by their config.json and
    tensor names, anything else that is a causal LM as a draft model."""
    from speculant.spec_registry import SpeculativeConfig, get_strategy, infer_method

    for name in ("ngram", "draft_model", "mlp_speculator", "eagle", "eagle3"):
        assert get_strategy(name).name == name
    assert SpeculativeConfig(model="[ngram]").method == "ngram"
    for name in ("draft_model", "mlp_speculator", "eagle", "eagle3"):
        path = configs[name]["model"]
        assert infer_method(path) == name
        assert SpeculativeConfig(model=path).method == name
        llm = LLM(
            model=str(target),
            skip_tokenizer_init=True,
            speculative_config={
                "model": path,
                "num_speculative_tokens": K,
                **({"aux_hidden_layers": [0, 1, 2]} if name == "eagle3" else {}),
            },
        )
        assert llm.engine.spec.name == name
