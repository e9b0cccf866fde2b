"""SamplingParams validation and the sampler against small hand-computed cases (vocab 8), then the
same features end to end through the engine on a tiny random Llama (CPU fp32)."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from speculant import SamplingParams
from speculant.engine.sampler import Row, process_logits, sample, target_probs, token_logprobs
from speculant.engine.sequence import Sequence
from speculant.outputs import RequestMetrics

X = [2.0, 1.0, 0.5, 0.0, -1.0, 3.0, -2.0, 0.2]  # vocab 8; order by value: 5, 0, 1, 2, 7, 3, 4, 6


def softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


def renorm(p: list[float], keep: set[int]) -> list[float]:
    z = sum(p[i] for i in keep)
    return [p[i] / z if i in keep else 0.0 for i in range(len(p))]


def seq(params: SamplingParams, prompt=(1, 2, 3), out=(), gen=None) -> Sequence:
    s = Sequence("r", 0, list(prompt), params, RequestMetrics(arrival_time=0.0), gen)
    s.token_ids.extend(out)
    return s


def probs(params: SamplingParams) -> list[float]:
    rows = [Row(seq(params), [])]
    return target_probs(process_logits(torch.tensor([X]), rows, None), rows)[0].tolist()


def close(a: list[float], b: list[float], tol=1e-5) -> bool:
    return all(abs(x - y) < tol for x, y in zip(a, b, strict=True))


# ----------------------------------------------------------------- sampling transforms
def test_temperature_only_is_softmax_of_scaled_logits():
    assert close(probs(SamplingParams(temperature=1.0)), softmax(X))
    assert close(probs(SamplingParams(temperature=0.5)), softmax([x / 0.5 for x in X]))


def test_top_k_keeps_k_largest():
    assert close(probs(SamplingParams(top_k=3)), renorm(softmax(X), {5, 0, 1}))
    assert close(probs(SamplingParams(top_k=-1)), softmax(X))  # -1 disables, as in vLLM


def test_top_p_keeps_smallest_prefix_reaching_mass():
    p = softmax(X)  # sorted: p5=.52, p0=.19, p1=.07, ...
    order = sorted(range(8), key=lambda i: -X[i])
    for top_p in (0.5, 0.6, 0.75, 0.9):
        keep, mass = set(), 0.0
        for i in order:  # vLLM: keep a token iff the mass strictly before it is < top_p
            if mass < top_p:
                keep.add(i)
            mass += p[i]
        got = probs(SamplingParams(top_p=top_p))
        assert close(got, renorm(p, keep)), (top_p, keep, got)
    assert sum(v > 0 for v in probs(SamplingParams(top_p=0.5))) == 1  # p5 alone is >= 0.5


def test_min_p_relative_to_max_prob():
    p = softmax(X)
    keep = {i for i in range(8) if p[i] >= 0.2 * max(p)}
    assert keep == {5, 0}  # x >= 3 + ln 0.2 = 1.39
    assert close(probs(SamplingParams(min_p=0.2)), renorm(p, keep))


def test_greedy_ignores_transforms():
    rows = [Row(seq(SamplingParams(temperature=0.0, top_k=2, top_p=0.1)), [])]
    assert sample(torch.tensor([X]), rows, torch.Generator(), None) == [5]


# ----------------------------------------------------------------- penalties (vLLM semantics)
def test_repetition_penalty_divides_positive_multiplies_negative_on_prompt_and_output():
    p = SamplingParams(repetition_penalty=2.0)
    rows = [Row(seq(p, prompt=[0, 4], out=[5]), [])]
    got = process_logits(torch.tensor([X]), rows, None)[0].tolist()
    want = list(X)
    want[0] = 2.0 / 2  # prompt token, positive
    want[4] = -1.0 * 2  # prompt token, negative
    want[5] = 3.0 / 2  # output token
    assert close(got, want)


def test_frequency_and_presence_penalties_count_output_tokens_only():
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    rows = [Row(seq(p, prompt=[1, 1, 1], out=[5, 5, 0]), [7])]  # extra: a draft before this row
    got = process_logits(torch.tensor([X]), rows, None)[0].tolist()
    want = list(X)
    want[5] -= 2 * 0.5 + 0.25
    want[0] -= 1 * 0.5 + 0.25
    want[7] -= 1 * 0.5 + 0.25
    assert close(got, want)  # token 1 is only in the prompt: untouched


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    p = SamplingParams(min_tokens=3, stop_token_ids=[0])
    eos = 5
    short = process_logits(torch.tensor([X]), [Row(seq(p, out=[1, 2]), [])], eos)[0]
    assert short[5] == -math.inf and short[0] == -math.inf and short[1] == X[1]
    done = process_logits(torch.tensor([X]), [Row(seq(p, out=[1, 2, 3]), [])], eos)[0]
    assert close(done.tolist(), X)
    ign = SamplingParams(min_tokens=3, ignore_eos=True)
    out = process_logits(torch.tensor([X]), [Row(seq(ign, out=[1]), [])], eos)[0]
    assert out[5] == X[5]  # ignore_eos: eos is an ordinary token, nothing to mask


def test_logits_processors_two_and_three_argument_forms():
    def ban_top(output_ids, logits):
        logits[5] = -math.inf
        return logits

    def boost_prompt(prompt_ids, output_ids, logits):
        logits[prompt_ids[0]] += 10.0
        return logits

    p = SamplingParams(temperature=0.0, logits_processors=[ban_top])
    assert sample(torch.tensor([X]), [Row(seq(p), [])], torch.Generator(), None) == [0]
    p = SamplingParams(temperature=0.0, logits_processors=[boost_prompt])
    assert sample(torch.tensor([X]), [Row(seq(p, prompt=[6]), [])], torch.Generator(), None) == [6]


def test_token_logprobs_are_raw_log_softmax_with_ranks():
    p = SamplingParams(logprobs=2)
    rows = [Row(seq(p), [])]
    chosen, dicts = token_logprobs(torch.tensor([X]), [1], rows, None)
    lp = [math.log(v) for v in softmax(X)]
    assert abs(chosen[0] - lp[1]) < 1e-5
    d = dicts[0]
    assert set(d) == {5, 0, 1}  # top-2 plus the chosen token
    assert (d[5].rank, d[0].rank, d[1].rank) == (1, 2, 3)
    assert abs(d[0].logprob - lp[0]) < 1e-5


def test_seeded_sampling_follows_the_cdf():
    p = SamplingParams(temperature=1.0, seed=7)
    counts = [0] * 8
    gen = torch.Generator().manual_seed(0)
    rows = [Row(seq(p, gen=gen), [])] * 4000
    for t in sample(torch.tensor([X] * 4000), rows, torch.Generator(), None):
        counts[t] += 1
    for c, q in zip(counts, softmax(X)):
        assert abs(c / 4000 - q) < 0.03


# ----------------------------------------------------------------- validation
@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("min_p", 1.5), ("presence_penalty", 3.0), ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0), ("max_tokens", 0), ("min_tokens", -1), ("logprobs", -1),
    ("prompt_logprobs", -3), ("stop", [""]), ("no_such_field", 1),
    ("seed", 2**63), ("seed", -(2**63) - 1), ("top_k", 2**31), ("temperature", float("inf")),
    ("temperature", float("nan")), ("temperature", 1e39), ("top_p", float("nan")),
    ("repetition_penalty", float("inf")), ("presence_penalty", float("nan")),
    ("stop_token_ids", [3, -1]), ("best_of", 0),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValidationError) as e:
        SamplingParams(**{field: value})
    assert field in str(e.value)


def test_range_ends_are_valid_and_field_range_names_them():
    from speculant.sampling_params import field_range

    for kw in ({"seed": 2**63 - 1}, {"seed": -(2**63)}, {"top_k": 2**31 - 1}, {"top_k": -1},
               {"temperature": 3.4e38}, {"top_p": 1.0}, {"min_p": 1.0}, {"stop_token_ids": [0]}):
        SamplingParams(**kw)
    assert field_range("seed") == "[-2**63, 2**63)" and field_range("top_p") == "(0, 1]"
    assert field_range("top_k") == "[-1, 2**31-1]" and field_range("n") == "[1, inf)"
    assert field_range("stop") is None


def test_check_vocab_names_the_field():
    assert SamplingParams(logprobs=100, prompt_logprobs=100, stop_token_ids=[99]).vocab_errors(100) == []
    errs = dict(SamplingParams(logprobs=101, prompt_logprobs=7, stop_token_ids=[5, 100])
                .vocab_errors(100))
    assert set(errs) == {"logprobs", "stop_token_ids"} and "[0, 100]" in errs["logprobs"]
    with pytest.raises(ValueError, match=r"prompt_logprobs must be in \[0, 10\]"):
        SamplingParams(prompt_logprobs=11).check_vocab(10)


def test_invalid_assignment_is_validated_too():
    sp = SamplingParams()
    with pytest.raises(ValidationError, match="temperature"):
        sp.temperature = -1.0


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValidationError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)


def test_unsupported_features_refused_clearly():
    with pytest.raises(ValidationError, match="beam search is not supported"):
        SamplingParams(use_beam_search=True)
    with pytest.raises(ValidationError, match=r"best_of \(1\) must be >= n \(2\)"):
        SamplingParams(n=2, best_of=1)
    assert SamplingParams(n=2, best_of=4).num_samples == 4
    assert SamplingParams(n=2, best_of=4, temperature=0).num_samples == 2


def test_defaults_match_vllm():
    sp = SamplingParams()
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.max_tokens) == (1, 1.0, 1.0, 0, 0.0, 16)
    assert (sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty) == (1.0, 0.0, 0.0)
    assert sp.skip_special_tokens and sp.spaces_between_special_tokens and not sp.ignore_eos
    assert SamplingParams(stop="x").stop == ["x"]


# ----------------------------------------------------------------- end to end (tiny Llama)
@pytest.fixture(scope="module")
def llm(tiny_llama):
    from speculant import LLM

    return LLM(model=str(tiny_llama), max_num_seqs=8)


PROMPTS = [[1, 50, 60, 70], [1, 900, 901, 5, 5, 5], [1, 3000]]


def _toks(llm, params, prompts=PROMPTS):
    return [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def test_seeded_sampling_reproducible_and_batch_independent(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_tokens=24, ignore_eos=True)
    a = _toks(llm, p)
    assert a == _toks(llm, p)
    alone = _toks(llm, p, PROMPTS[1:2])  # its own generator: batch-mates do not change it
    assert alone[0] == a[1]
    other = _toks(llm, p.clone(seed=124))
    assert other != a
    greedy = _toks(llm, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert greedy != a


def test_stop_token_ids_min_tokens_and_ignore_eos(llm):
    base = _toks(llm, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), PROMPTS[:1])[0]
    stop_tok = base[4]
    first = base.index(stop_tok)
    out = llm.generate({"prompt_token_ids": PROMPTS[0]},
                       SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_tok]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base[: first + 1]  # the stop token is returned, nothing after it
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_tok)
    # min_tokens bans the stop token for the first min_tokens positions
    out = llm.generate({"prompt_token_ids": PROMPTS[0]},
                       SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_tok],
                                      min_tokens=first + 2), use_tqdm=False)[0].outputs[0]
    assert stop_tok not in out.token_ids[: first + 2]
    assert len(out.token_ids) > first + 2 or out.finish_reason == "length"
    # eos: make the greedy continuation's first token the eos by passing it as a prompt of a model
    # whose eos is token 2: ignore_eos runs to max_tokens even through eos tokens
    eos = llm.engine.eos_token_id
    ban_all_but_eos = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                                     logits_processors=[lambda o, lg: lg.index_fill(
                                         0, torch.tensor([eos]), 1e4)])
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, ban_all_but_eos, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [eos] * 5 and out.finish_reason == "length"
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, ban_all_but_eos.clone(ignore_eos=False),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop" and out.stop_reason is None


def test_stop_strings_cut_the_text(llm):
    full = llm.generate({"prompt_token_ids": PROMPTS[0]},
                        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    text = full.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    cut = text.index(stop)
    out = llm.generate({"prompt_token_ids": PROMPTS[0]},
                       SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:cut]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    assert len(out.token_ids) < len(full.token_ids)
    inc = llm.generate({"prompt_token_ids": PROMPTS[0]},
                       SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=stop,
                                      include_stop_str_in_output=True),
                       use_tqdm=False)[0].outputs[0]
    assert inc.text == text[: cut + len(stop)]


def test_logprobs_and_prompt_logprobs_match_hf(llm, tiny_llama):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    out = llm.generate({"prompt_token_ids": PROMPTS[1]},
                       SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3,
                                      prompt_logprobs=2), use_tqdm=False)[0]
    c = out.outputs[0]
    ids = torch.tensor([PROMPTS[1] + c.token_ids])
    with torch.no_grad():
        lp = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)
    P = len(PROMPTS[1])
    want = [float(lp[P - 1 + j, t]) for j, t in enumerate(c.token_ids)]
    assert len(c.logprobs) == len(c.token_ids)
    for j, (t, d) in enumerate(zip(c.token_ids, c.logprobs)):
        assert abs(d[t].logprob - want[j]) < 1e-4
        assert d[t].rank == 1  # greedy
        assert len(d) == 3
        top3 = lp[P - 1 + j].topk(3).indices.tolist()
        assert set(d) == set(top3)
    assert abs(c.cumulative_logprob - sum(want)) < 1e-3
    pl = out.prompt_logprobs
    assert pl[0] is None and len(pl) == P
    for i in range(1, P):
        t = PROMPTS[1][i]
        assert abs(pl[i][t].logprob - float(lp[i - 1, t])) < 1e-4
        # rank among 49152 near-flat logits: equal up to float noise between implementations
        assert abs(pl[i][t].rank - (int((lp[i - 1] > lp[i - 1, t]).sum()) + 1)) <= 8
        assert len(pl[i]) in (2, 3)


def test_penalties_change_output_deterministically(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    base = _toks(llm, plain, PROMPTS[1:2])[0]
    rep = _toks(llm, plain.clone(repetition_penalty=1.5), PROMPTS[1:2])[0]
    assert rep == _toks(llm, plain.clone(repetition_penalty=1.5), PROMPTS[1:2])[0]
    assert rep != base
    pen = plain.clone(presence_penalty=2.0, frequency_penalty=2.0)
    freq = _toks(llm, pen, PROMPTS[1:2])[0]
    assert freq == _toks(llm, pen, PROMPTS[1:2])[0]
    assert freq != base
    # penalised runs repeat tokens less than the plain greedy run
    assert len(freq) - len(set(freq)) <= len(base) - len(set(base))


# ---------------------------------------------------------------------------- bad processors
def wrong_shape(output_ids, logits):
    return logits[:-1]


def all_banned(output_ids, logits):
    return torch.full_like(logits, -math.inf)


def nan_row(output_ids, logits):
    logits[3] = math.nan
    return logits


def test_logits_processor_wrong_shape_names_processor_and_shape():
    from speculant.engine.sampler import LogitsProcessorError

    p = SamplingParams(temperature=0.0, logits_processors=[wrong_shape])
    with pytest.raises(LogitsProcessorError, match=r"wrong_shape returned \(7,\), expected a "
                       r"tensor of shape \(8,\)") as e:
        process_logits(torch.tensor([X]), [Row(seq(p), [])], None)
    assert isinstance(e.value, ValueError) and e.value.request_id == "r"
    p = SamplingParams(temperature=0.0, logits_processors=[lambda o, lg: lg.tolist()])
    with pytest.raises(ValueError, match="returned list, expected a tensor of shape"):
        process_logits(torch.tensor([X]), [Row(seq(p), [])], None)


@pytest.mark.parametrize("fn", [all_banned, nan_row])
def test_logits_processor_leaving_nothing_to_sample_is_an_error(fn):
    ok = SamplingParams(temperature=0.8, logits_processors=[lambda o, lg: lg])
    bad = SamplingParams(temperature=0.8, logits_processors=[fn])
    rows = [Row(seq(ok), []), Row(Sequence("bad-req", 0, [1], bad, RequestMetrics(0.0), None), [])]
    with pytest.raises(ValueError, match=rf"request bad-req: after its logits processors "
                       rf"\(.*{fn.__name__}\) the logits row has NaN or no finite value"):
        process_logits(torch.tensor([X, X]), rows, None)


def test_bad_logits_processor_through_the_engine(llm):
    for fn, what in ((wrong_shape, "expected a tensor of shape"), (all_banned, "no finite value")):
        p = SamplingParams(temperature=0.8, max_tokens=4, logits_processors=[fn])
        # contained to the request (tests/test_logits_processor_isolation.py): aborted, its error
        out = llm.generate({"prompt_token_ids": PROMPTS[0]}, p, use_tqdm=False)[0]
        assert out.outputs[0].finish_reason == "abort" and what in out.error
    # the engine still serves afterwards
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0.0,
                       max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 3
