"""Overlapped plain decode steps (engine/async_decode.py), forced on for the CPU: the same outputs
as synchronous steps under every stop rule, sampling, batch changes, preemption, aborts and
speculative plain steps, and the overlapped path is really the one taken."""

from __future__ import annotations

import pytest

from speculant import LLM, SamplingParams
from speculant.engine.async_decode import host_free

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [[1, 5, 6, 7], [1] + list(range(200, 230)), [1, 77], [1, 9, 9, 9, 9, 9]]


@pytest.fixture(scope="module")
def pair(tiny_llama):
    """(synchronous, overlapped) engines on the same checkpoint."""
    return (LLM(model=str(tiny_llama), max_num_seqs=8, async_scheduling=False),
            LLM(model=str(tiny_llama), max_num_seqs=8, async_scheduling=True))


def run(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason,
             round(o.outputs[0].cumulative_logprob, 3)) for o in outs]


def chained_steps(llm, monkeypatch) -> list[int]:
    """Count forwards fed device-side tokens (the overlapped steps)."""
    calls = [0]
    runner = llm.engine.runner
    real = runner.forward

    def spy(seqs, new_tokens, aux_layers=(), token_ids=None):
        if token_ids is not None:
            calls[0] += 1
        return real(seqs, new_tokens, aux_layers, token_ids)

    monkeypatch.setattr(runner, "forward", spy)
    return calls


def test_default_is_off_on_cpu(tiny_llama):
    assert LLM(model=str(tiny_llama)).engine.async_decoder is None


def test_same_outputs_mixed_lengths_and_stops(pair, monkeypatch):
    sync, asy = pair
    calls = chained_steps(asy, monkeypatch)
    ref = run(sync, PROMPTS, GREEDY)
    assert run(asy, PROMPTS, GREEDY) == ref
    assert calls[0] >= 20  # the steady state ran overlapped
    # sequences leave the batch at different steps; a stop token and a stop string end others
    toks = [r[0] for r in ref]
    text = sync.engine.tokenizer.decode(toks[2][6:9])
    params = [GREEDY.clone(max_tokens=3 + 5 * i) for i in range(len(PROMPTS))]
    params[1] = GREEDY.clone(stop_token_ids=[toks[1][7]])
    params[2] = GREEDY.clone(stop=[text])
    params[3] = SamplingParams(temperature=0.0, max_tokens=24)  # eos may end it
    got = run(asy, PROMPTS, params)
    assert got == run(sync, PROMPTS, params)
    assert got[1][1:3] == ("stop", toks[1][7]) and got[2][1:3] == ("stop", text)
    assert [len(g[0]) for g in got][0] == 3


def test_seeded_sampling_and_ineligible_requests(pair):
    sync, asy = pair
    sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True)
    with_lp = GREEDY.clone(logprobs=2)  # top-N logprobs: host work each step, no overlap
    penal = GREEDY.clone(repetition_penalty=1.3)
    assert host_free(sampled) and not host_free(with_lp) and not host_free(penal)
    for params in (sampled, [sampled, with_lp, GREEDY, penal]):
        assert run(asy, PROMPTS, params) == run(sync, PROMPTS, params)
    a = asy.generate([{"prompt_token_ids": PROMPTS[0]}], with_lp, use_tqdm=False)[0].outputs[0]
    b = sync.generate([{"prompt_token_ids": PROMPTS[0]}], with_lp, use_tqdm=False)[0].outputs[0]
    assert [sorted(d) for d in a.logprobs] == [sorted(d) for d in b.logprobs]


def test_requests_joining_and_aborted_mid_run(pair):
    sync, asy = pair
    ref = {i: r[0] for i, r in enumerate(run(sync, PROMPTS, GREEDY))}
    eng = asy.engine
    eng.add_request("a0", None, PROMPTS[0], GREEDY)
    eng.add_request("a1", None, PROMPTS[1], GREEDY)
    done, steps = {}, 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            done[o.request_id] = o
        steps += 1
        if steps == 6:  # joins while a step is in flight
            eng.add_request("a2", None, PROMPTS[2], GREEDY)
            eng.add_request("a3", None, PROMPTS[3], GREEDY)
        if steps == 9:
            eng.abort_request("a1")
    assert [done[f"a{i}"].outputs[0].token_ids for i in (0, 2, 3)] == [ref[0], ref[2], ref[3]]
    cut = done["a1"].outputs[0]
    assert cut.finish_reason == "abort" and cut.token_ids == ref[1][: len(cut.token_ids)]
    assert eng.async_decoder.pending is None or all(s.is_finished for s in eng.async_decoder.pending.seqs)


def test_preemption(tiny_llama, pair):
    sync, _ = pair
    ref = run(sync, PROMPTS, GREEDY.clone(max_tokens=40))
    small = LLM(model=str(tiny_llama), max_num_seqs=8, num_gpu_blocks_override=9,
                async_scheduling=True)
    assert run(small, PROMPTS, GREEDY.clone(max_tokens=40)) == ref
    assert small.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 2},
    {"method": "ngram", "num_speculative_tokens": 3, "auto_disable": True},
])
def test_speculative_plain_steps_overlap(tiny_llama, pair, monkeypatch, spec):
    """Plain steps of a speculative engine (speculation disabled by batch size or backed off)
    overlap too; outputs and token counts match the synchronous engine's."""
    sync, _ = pair
    ref = run(sync, PROMPTS, GREEDY)
    llms = [LLM(model=str(tiny_llama), max_num_seqs=8, speculative_config=spec,
                async_scheduling=a) for a in (False, True)]
    calls = chained_steps(llms[1], monkeypatch)
    outs = [run(llm, PROMPTS, GREEDY) for llm in llms]
    assert outs[0] == ref and outs[1] == ref
    assert calls[0] > 0
    m = [llm.engine.spec_metrics() for llm in llms]
    assert m[1].num_emitted_tokens == m[0].num_emitted_tokens == sum(len(r[0]) - 1 for r in ref)
    if "disable_by_batch_size" in spec:  # 4 sequences: every step plain
        assert m[1].num_plain_steps == m[0].num_plain_steps
    eng = llms[1].engine
    assert not eng.spec.seq_by_id and not eng.spec.pending  # every sequence released
