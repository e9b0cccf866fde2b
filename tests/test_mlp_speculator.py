"""MLPSpeculator strategy: tiny random checkpoints in the published IBM layout (config.json +
``speculator.``-prefixed safetensors, or pytorch_model.bin without prefix, tied or not) against
tiny random Llama targets.

Also holds helpers the EAGLE tests reuse: the exact target distribution of the first tokens and
the total-variation bound of the sampling checks."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from checkpoints import BIG_V, H, make_mlp, mlp_config, random_mlp_tensors, write_mlp

from speculant import LLM, SamplingParams
from speculant.spec_registry import StrategyError, infer_method


# --------------------------------------------------------------------------------------------
# shared helpers
# --------------------------------------------------------------------------------------------
def prompts_for(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(4, 13, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (m,), generator=g).tolist() for m in lens]


def generate_ids(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def exact_first_tokens(target: Path, prompt: list[int], temperature: float, top_p: float):
    """Exact target sampling distributions: p1 [V] of token 1 and p12 [V, V] of tokens (1, 2),
    computed with transformers in float64 (no sampling involved)."""
    from transformers import AutoModelForCausalLM

    from speculant.kernels.sampling import sampling_probs_ref

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float64).eval()
    V = model.config.vocab_size

    def dist(logits: torch.Tensor) -> torch.Tensor:
        r = logits.shape[0]
        return sampling_probs_ref(
            logits.float(), torch.full((r,), temperature), torch.zeros(r, dtype=torch.int32),
            torch.full((r,), top_p), torch.zeros(r),
        ).double()

    with torch.no_grad():
        p1 = dist(model(torch.tensor([prompt])).logits[:, -1])[0]
        ids = torch.tensor([prompt + [a] for a in range(V)])
        p2 = dist(model(ids).logits[:, -1])  # [V, V]: row a = p(token 2 | token 1 = a)
    return p1, p1[:, None] * p2


def tv_threshold(p: torch.Tensor, n: int, delta: float = 1e-6) -> float:
    """A bound that the empirical distribution of n samples of p exceeds in total variation with
    probability < delta: E[TV] <= 1/2 sum_i sqrt(p_i (1 - p_i) / n) (Jensen, per cell), and TV
    changes by at most 1/n when one sample changes, so McDiarmid adds sqrt(ln(1/delta) / (2n))."""
    p = p.flatten().double()
    mean_bound = 0.5 * torch.sqrt(p * (1 - p) / n).sum().item()
    return mean_bound + math.sqrt(math.log(1 / delta) / (2 * n))


def sample_first_tokens(llm: LLM, prompt: list[int], n: int, temperature: float, top_p: float,
                        vocab: int) -> torch.Tensor:
    """Empirical joint distribution [V, V] of the first two generated tokens over n requests."""
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=2, ignore_eos=True)
    outs = generate_ids(llm, [prompt] * n, params)
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    for o in outs:
        counts[o[0], o[1]] += 1
    return counts / n


def check_distribution(emp12: torch.Tensor, p12: torch.Tensor, n: int) -> None:
    tv_joint = 0.5 * (emp12 - p12).abs().sum().item()
    tv_second = 0.5 * (emp12.sum(0) - p12.sum(0)).abs().sum().item()
    assert tv_joint < tv_threshold(p12, n), (tv_joint, tv_threshold(p12, n))
    assert tv_second < tv_threshold(p12.sum(0), n), (tv_second, tv_threshold(p12.sum(0), n))


def greedy_reference(target: Path, prompt: list[int], max_tokens: int) -> list[int]:
    llm = LLM(model=str(target), skip_tokenizer_init=True, max_num_seqs=4)
    return generate_ids(llm, [prompt], greedy(max_tokens))[0]


def simulate_acceptance(out: list[int], draft_fn, k: int, max_tokens: int) -> int:
    """Accepted drafts of greedy speculation with a deterministic drafter, given the target's
    greedy output ``out`` (at least max_tokens + k tokens long). draft_fn(last, k) -> k tokens."""
    n_out, total = 1, 0
    while n_out < max_tokens:
        i = n_out - 1
        acc = 0
        for d, t in zip(draft_fn(out[i], k), out[i + 1 : i + 1 + k]):
            if d != t:
                break
            acc += 1
        total += acc
        n_out += acc + 1
    return total


def successor_table(out: list[int], vocab: int) -> list[int]:
    """succ[t]: the token that followed the first occurrence of t in ``out`` (0 if none)."""
    succ = [-1] * vocab
    for a, b in zip(out, out[1:]):
        if succ[a] < 0:
            succ[a] = b
    return [s if s >= 0 else 0 for s in succ]


# --------------------------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target(tiny_factory) -> Path:
    return tiny_factory("llama")


@pytest.fixture(scope="module")
def small_target(tiny_factory) -> Path:
    return tiny_factory("llama", vocab_size=16, tokenizer=False)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return prompts_for(BIG_V, 8, seed=1)


@pytest.fixture(scope="module")
def reference(target, prompts) -> list[list[int]]:
    llm = LLM(model=str(target), max_num_seqs=8)
    return generate_ids(llm, prompts, greedy(20))


# --------------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bs", [1, 8])
def test_greedy_matches_plain_decoding(tmp_path, target, prompts, reference, bs):
    ckpt = make_mlp(tmp_path / "mlp", seed=3)  # safetensors, "speculator." prefix
    llm = LLM(model=str(target), max_num_seqs=8, speculative_config={"model": str(ckpt)})
    assert llm.engine.spec.name == "mlp_speculator"  # inferred from config.json alone
    assert llm.engine.spec.k == 3  # defaults to n_predict
    got = generate_ids(llm, prompts[:bs], greedy(20))
    assert got == reference[:bs]
    m = llm.get_metrics()
    assert m.num_draft_tokens > 0 and m.num_spec_steps > 0


def test_tied_bin_no_prefix_scaled_k_multiple(tmp_path, target, prompts, reference):
    """Tied weights stored as index 0 + proj.1 only, pytorch_model.bin without prefix,
    scale_input, and k = 2 * n_predict (the shared stage keeps running)."""
    ckpt = make_mlp(tmp_path / "tied", n_predict=2, inner_dim=H, tie=True, scale_input=True,
                    prefix="", fmt="bin", seed=5)
    llm = LLM(model=str(target), max_num_seqs=8,
              speculative_config={"model": str(ckpt), "num_speculative_tokens": 4})
    assert llm.engine.spec.k == 4
    assert generate_ids(llm, prompts, greedy(20)) == reference
    assert len(llm.get_metrics().proposed_per_position) == 4


def test_untied_cyclic_heads(tmp_path, target, prompts, reference):
    """k = 2 * n_predict without tied weights cycles the heads (needs inner_dim == emb_dim)."""
    ckpt = make_mlp(tmp_path / "cyc", n_predict=2, inner_dim=0, seed=7)
    llm = LLM(model=str(target), max_num_seqs=8,
              speculative_config={"method": "mlp_speculator", "model": str(ckpt),
                                  "num_speculative_tokens": 4})
    assert generate_ids(llm, prompts[:3], greedy(20)) == reference[:3]


def test_tied_copies_of_every_index_are_accepted(tmp_path, target, prompts, reference):
    """A tied checkpoint that stores every stage index (identical copies) loads too."""
    n = 3
    t = random_mlp_tensors(H, BIG_V, n, 32, True, seed=9)
    for i in range(1, n):
        for kind in ("emb", "head"):
            t[f"{kind}.{i}.weight"] = t[f"{kind}.0.weight"].clone()
        t[f"ln.{i}.weight"], t[f"ln.{i}.bias"] = t["ln.0.weight"].clone(), t["ln.0.bias"].clone()
    t["proj.2.weight"] = t["proj.1.weight"].clone()
    ckpt = write_mlp(tmp_path / "tiedall", t, mlp_config(H, BIG_V, n, 32, True, False))
    llm = LLM(model=str(target), max_num_seqs=8, speculative_config={"model": str(ckpt)})
    assert generate_ids(llm, prompts[:2], greedy(12)) == [r[:12] for r in reference[:2]]
    t["emb.2.weight"] = t["emb.2.weight"] + 1  # no longer a tied copy
    bad = write_mlp(tmp_path / "tiedbad", t, mlp_config(H, BIG_V, n, 32, True, False))
    with pytest.raises(StrategyError, match=r"model.safetensors.*emb\.2\.weight.*differs"):
        LLM(model=str(target), speculative_config={"model": str(bad)})


def _successor_mlp(path: Path, succ: list[int], n_predict: int, vocab: int) -> Path:
    """Every stage ignores the state (proj = 0) and maps token t to succ[t]: emb row t is the
    basis vector e_t, the norm turns it into sqrt(inner) e_t, gelu keeps it positive, and head
    column t is the basis vector of succ[t]; every other logit is exactly 0."""
    inner = 32
    assert vocab <= inner
    t = {}
    for i in range(n_predict):
        emb = torch.zeros(vocab, inner)
        emb[torch.arange(vocab), torch.arange(vocab)] = 1.0
        head = torch.zeros(vocab, inner)
        head[torch.tensor(succ), torch.arange(vocab)] = 1.0
        t[f"emb.{i}.weight"], t[f"head.{i}.weight"] = emb, head
        t[f"ln.{i}.weight"], t[f"ln.{i}.bias"] = torch.ones(inner), torch.zeros(inner)
        t[f"proj.{i}.weight"] = torch.zeros(inner, H if i == 0 else inner)
    return write_mlp(path, t, mlp_config(H, vocab, n_predict, inner, False, False))


def test_acceptance_of_a_hand_built_speculator(tmp_path, small_target):
    """A speculator built to predict 'the token that followed t the first time' is accepted
    exactly as often as a simulation of greedy verification says (>= 1 by construction: the
    first draft of the first step is the target's second token)."""
    prompt, M, k = [5, 9, 3, 11, 7], 40, 3
    out = greedy_reference(small_target, prompt, M + k + 1)
    succ = successor_table(out, 16)
    ckpt = _successor_mlp(tmp_path / "succ", succ, k, 16)

    def chain(last, n):
        d = []
        for _ in range(n):
            last = succ[last]
            d.append(last)
        return d

    expected = simulate_acceptance(out, chain, k, M)
    assert expected >= 1
    llm = LLM(model=str(small_target), skip_tokenizer_init=True, max_num_seqs=4,
              speculative_config={"model": str(ckpt)})
    assert generate_ids(llm, [prompt], greedy(M)) == [out[:M]]
    assert llm.get_metrics().num_accepted_tokens == expected


@pytest.mark.slow  # the default run: test_distribution.py's [mlp_speculator] (and its negative control)
def test_sampling_follows_the_target_distribution(tmp_path, small_target):
    """temperature 0.8 / top_p 0.95 over a 16-token vocabulary: the first two tokens of 6000
    speculative samples match the exact target distribution (TV bound, failure prob < 1e-6 per
    check), while drafts are both accepted and rejected."""
    ckpt = make_mlp(tmp_path / "mlp16", vocab=16, n_predict=3, inner_dim=32, seed=11)
    prompt, n = [4, 9, 1, 13], 6000
    _p1, p12 = exact_first_tokens(small_target, prompt, 0.8, 0.95)
    llm = LLM(model=str(small_target), skip_tokenizer_init=True, max_num_seqs=256, seed=1,
              speculative_config={"model": str(ckpt)})
    emp = sample_first_tokens(llm, prompt, n, 0.8, 0.95, 16)
    check_distribution(emp, p12, n)
    m = llm.get_metrics()
    assert 0 < m.num_accepted_tokens < m.num_draft_tokens


def test_method_inference_from_path(tmp_path):
    ckpt = make_mlp(tmp_path / "m", vocab=16, n_predict=2)
    assert infer_method(str(ckpt)) == "mlp_speculator"


@pytest.mark.slow  # five engines (~5 s busy)
def test_bad_inputs(tmp_path, target, small_target):
    def build(ckpt, **extra):
        return LLM(model=str(target), speculative_config={"model": str(ckpt), **extra})

    wrong_vocab = make_mlp(tmp_path / "v", vocab=1000)
    with pytest.raises(StrategyError, match=r"config\.json: vocab_size=1000 .* 49152"):
        build(wrong_vocab)
    wrong_dim = make_mlp(tmp_path / "d", emb_dim=32)
    with pytest.raises(StrategyError, match=r"config\.json: emb_dim=32 .* hidden size is 64"):
        build(wrong_dim)
    ok = make_mlp(tmp_path / "ok", n_predict=3)
    with pytest.raises(StrategyError, match="num_speculative_tokens=4 .* n_predict=3 .* not a multiple"):
        build(ok, num_speculative_tokens=4)
    with pytest.raises(StrategyError, match="inner_dim=32 != emb_dim=64"):
        build(ok, num_speculative_tokens=6)
    with pytest.raises(StrategyError, match="unknown option"):
        build(ok, aux_hidden_layers=[1, 2, 3])

    t = random_mlp_tensors(H, BIG_V, 3, 32, False, seed=0)
    missing = dict(t)
    del missing["ln.1.bias"]
    ckpt = write_mlp(tmp_path / "missing", missing, mlp_config(H, BIG_V, 3, 32, False, False))
    with pytest.raises(StrategyError, match=r"missing .*ln\.1\.bias"):
        build(ckpt)
    extra = dict(t, **{"medusa.0.weight": torch.zeros(2)})
    ckpt = write_mlp(tmp_path / "extra", extra, mlp_config(H, BIG_V, 3, 32, False, False), fmt="bin")
    with pytest.raises(StrategyError, match=r"unexpected .*speculator\.medusa\.0\.weight \(pytorch_model\.bin\)"):
        build(ckpt)
    shape = dict(t, **{"proj.1.weight": torch.zeros(32, 16)})
    ckpt = write_mlp(tmp_path / "shape", shape, mlp_config(H, BIG_V, 3, 32, False, False))
    with pytest.raises(StrategyError, match=r"model\.safetensors: tensor 'speculator\.proj\.1\.weight' has shape \(32, 16\)"):
        build(ckpt)
    not_mlp = tmp_path / "notmlp"
    write_mlp(not_mlp, t, {"architectures": ["LlamaForCausalLM"], "n_predict": 3})
    with pytest.raises(StrategyError, match="not an MLPSpeculator checkpoint"):
        build(not_mlp, method="mlp_speculator")
