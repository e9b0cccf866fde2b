"""A bad logits processor is contained to its own request (issue 34; docs/architecture.md "Fault
isolation"): a processor that raises, returns the wrong shape or leaves a row with nothing to
sample (all -inf, NaN) aborts its request alone, with an error naming the request and the
processor in ``RequestOutput.error`` (finish_reason "abort"), after exactly the tokens a plain
run generates before the failure. Every other request of the same steps gets exactly its output
without the bad one (greedy and seeded sampled), plain, with n-gram speculation, with a strategy
whose rejected drafts make the processor fail on rows that decide nothing, and with overlapped
(async) plain steps; no KV block leaks; the engine loop behind the server fails only that
request."""

from __future__ import annotations

import asyncio

import pytest
import torch

from speculant import LLM, Proposal, SamplingParams, hookimpl
from speculant.hookspecs import Strategy
from speculant.plugin_manager import register, unregister

HEALTHY = [[5, 6, 5, 6, 5, 6, 5, 6], [9, 10, 11, 9, 10, 11, 9], [3, 4, 3, 4, 3, 4]]
BAD_PROMPT = [12, 13, 12, 13, 12, 13]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=12, ignore_eos=True)
PARAMS = [GREEDY, GREEDY, SEEDED]
FAIL_AT = 3  # the bad processors fail once the request has this many output tokens


def wrong_shape(output_ids, logits):
    return logits[:-1] if len(output_ids) >= FAIL_AT else logits


def all_banned(output_ids, logits):
    return torch.full_like(logits, float("-inf")) if len(output_ids) >= FAIL_AT else logits


def nan_row(output_ids, logits):
    if len(output_ids) >= FAIL_AT:
        logits[0] = float("nan")
    return logits


def raises(output_ids, logits):
    if len(output_ids) >= FAIL_AT:
        raise KeyError("boom")
    return logits


BAD = {  # processor -> what the error says
    wrong_shape: "expected a tensor of shape",
    all_banned: "no finite value",
    nan_row: "NaN",
    raises: "raised KeyError: 'boom'",
}


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _no_leak(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()
    if llm.engine.spec is not None:
        assert not llm.engine.spec.seq_by_id and not llm.engine.spec.pending


def _check_bad(out, fn, plain_bad: list[int]) -> None:
    """The bad request: aborted with an error naming it and the processor, after the tokens a
    plain run generates before its processor fails."""
    comp = out.outputs[0]
    assert out.finished and comp.finish_reason == "abort"
    assert out.error is not None and BAD[fn] in out.error, out.error
    assert f"request {out.request_id}:" in out.error and fn.__name__ in out.error
    assert comp.token_ids == plain_bad[:FAIL_AT]


SPECS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
}


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Per engine kind: the healthy prompts' outputs without the bad request; and the bad
    prompt's plain greedy output (no processor)."""
    ref = {}
    for name, spec in SPECS.items():
        llm = LLM(model=str(tiny_llama), speculative_config=spec)
        ref[name] = _tokens(llm.generate(HEALTHY, PARAMS, use_tqdm=False))
    bad = _tokens(LLM(model=str(tiny_llama)).generate([BAD_PROMPT], GREEDY, use_tqdm=False))[0]
    assert len(set(bad)) > 1
    return ref, bad


# the default run: every processor with plain steps, wrong_shape with n-gram ones; the other three
# with n-gram steps (~1.2 s each on a busy 2-core machine) are slow
@pytest.mark.parametrize("kind,fn", [
    pytest.param(kind, fn, id=f"{kind}-{fn.__name__}",
                 marks=pytest.mark.slow if kind == "ngram" and fn is not wrong_shape else ())
    for fn in BAD for kind in SPECS])
@pytest.mark.slow
def test_a_bad_processor_aborts_its_request_alone(tiny_llama, reference, kind, fn):
    ref, plain_bad = reference
    llm = LLM(model=str(tiny_llama), speculative_config=SPECS[kind])
    bad = GREEDY.clone(logits_processors=[fn])
    out = llm.generate(HEALTHY + [BAD_PROMPT], PARAMS + [bad], use_tqdm=False)
    assert _tokens(out[:3]) == ref[kind], "a healthy request's output changed"
    assert all(o.error is None and o.outputs[0].finish_reason == "length" for o in out[:3])
    _check_bad(out[3], fn, plain_bad)
    if kind == "ngram":
        assert llm.get_metrics().num_draft_tokens > 0 and llm.get_metrics().num_faults == 0
    _no_leak(llm)
    # the engine keeps serving
    assert _tokens(llm.generate(HEALTHY, PARAMS, use_tqdm=False)) == ref[kind]
    _no_leak(llm)


@pytest.mark.parametrize("fn", [wrong_shape, raises], ids=lambda f: f.__name__)
def test_a_processor_failing_inside_an_accepted_window(tiny_llama, reference, fn):
    """The oracle drafts the bad request's own continuation, so every draft is accepted and its
    processor fails on a row in the middle of a window: the accepted drafts before that row are
    appended (the tokens a plain run has when its processor fails), the rest dropped."""
    ref, plain_bad = reference
    oracle = {"method": "oracle", "num_speculative_tokens": 4, "alpha": 1.0, "references": [
        {"prompt_token_ids": BAD_PROMPT, "output_token_ids": plain_bad}]}
    llm = LLM(model=str(tiny_llama), speculative_config=oracle)
    cuts = []
    real_cut = llm.engine.spec._cut_at

    def cut_at(seqs, faults):
        found = real_cut(seqs, faults)
        cuts.extend(row for row, _ in found.values())
        return found

    llm.engine.spec._cut_at = cut_at
    bad = GREEDY.clone(logits_processors=[fn])
    out = llm.generate(HEALTHY + [BAD_PROMPT], PARAMS + [bad], use_tqdm=False)
    assert cuts == [FAIL_AT - 1], cuts  # the prefill's token, then rows 0, 1 fine, row 2 fails
    assert _tokens(out[:3]) == ref["plain"]  # no references for them: plain steps
    _check_bad(out[3], fn, plain_bad)
    assert out[3].metrics.num_accepted_tokens == FAIL_AT - 1
    _no_leak(llm)


def test_a_processor_failing_from_the_prefill_gets_no_token(tiny_llama, reference):
    ref, _ = reference
    llm = LLM(model=str(tiny_llama))
    bad = GREEDY.clone(logits_processors=[lambda o, lg: None if o else lg[:2]])
    out = llm.generate([BAD_PROMPT] + HEALTHY, [bad] + PARAMS, use_tqdm=False)
    assert out[0].outputs[0].token_ids == [] and "expected a tensor of shape" in out[0].error
    assert _tokens(out[1:]) == ref["plain"]
    _no_leak(llm)


# ----------------------------------------------------------------- drafts the processor rejects
class _RepeatLast(Strategy):
    """Drafts the last token repeated: often rejected, so the later rows of a window extend
    prefixes the output never takes."""

    name = "repeat_last_for_processors"
    num_speculative_tokens = 3

    @hookimpl
    def propose(self, batch):
        return Proposal(token_ids=[[s.token_ids[-1]] * s.max_draft for s in batch.seqs])


class _Plugin:
    @hookimpl
    def register_strategies(self, register):
        register(_RepeatLast)


@pytest.fixture(scope="module")
def repeat_plugin():
    name = register(_Plugin(), name="test-repeat-last")
    yield name
    unregister(name)


def test_a_processor_failing_only_after_a_rejected_draft_costs_nothing(tiny_llama, reference,
                                                                        repeat_plugin):
    """A verification row after a rejected draft decides no token: the processor failing there
    is no error, and the request's output is its plain one."""
    _, plain_bad = reference
    real = BAD_PROMPT + plain_bad  # every prefix the request really takes
    real_pairs = set(zip(real, real[1:]))
    failed = []

    def fails_off_path(prompt_ids, output_ids, logits):
        ids = prompt_ids + output_ids
        if (ids[-2], ids[-1]) not in real_pairs:  # a prefix only a rejected draft builds
            failed.append(len(output_ids))
            return logits[:1]
        return logits

    llm = LLM(model=str(tiny_llama), speculative_config={
        "method": "repeat_last_for_processors", "num_speculative_tokens": 3})
    bad = GREEDY.clone(logits_processors=[fails_off_path])
    out = llm.generate([BAD_PROMPT] + HEALTHY[:2], [bad] + PARAMS[:2], use_tqdm=False)
    assert failed, "the processor never saw a rejected draft's row"
    assert out[0].error is None and out[0].outputs[0].token_ids == plain_bad
    plain = LLM(model=str(tiny_llama)).generate(HEALTHY[:2], PARAMS[:2], use_tqdm=False)
    assert _tokens(out[1:]) == _tokens(plain)
    _no_leak(llm)


def test_async_plain_steps_around_a_failed_request(tiny_llama):
    """Overlapped plain steps (async_scheduling, on the CPU here): the healthy requests' outputs
    are those of the run without the bad one (which takes the batch off the overlapped path
    until it is aborted)."""
    llm = LLM(model=str(tiny_llama), async_scheduling=True)
    assert llm.engine.async_decoder is not None
    healthy = [GREEDY, GREEDY, SEEDED.clone(max_tokens=20)]
    ref = _tokens(llm.generate(HEALTHY, healthy, use_tqdm=False))
    bad = GREEDY.clone(logits_processors=[all_banned])
    out = llm.generate(HEALTHY + [BAD_PROMPT], healthy + [bad], use_tqdm=False)
    assert _tokens(out[:3]) == ref
    assert out[3].outputs[0].finish_reason == "abort" and "no finite value" in out[3].error
    assert len(out[3].outputs[0].token_ids) == FAIL_AT
    _no_leak(llm)


def test_n_samples_of_a_failed_request_all_end(tiny_llama, reference):
    ref, _ = reference
    llm = LLM(model=str(tiny_llama))
    bad = SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=12, ignore_eos=True,
                         logits_processors=[raises])
    out = llm.generate(HEALTHY + [BAD_PROMPT], PARAMS + [bad], use_tqdm=False)
    assert _tokens(out[:3]) == ref["plain"]
    assert [c.finish_reason for c in out[3].outputs] == ["abort", "abort"]
    assert all(len(c.token_ids) == FAIL_AT for c in out[3].outputs)
    _no_leak(llm)


# ----------------------------------------------------------------- the server's engine loop
def test_engine_loop_fails_only_the_request_whose_processor_failed(tiny_llama, reference):
    """All four requests are queued before the loop starts, so they share their steps; the bad
    one is failed with its error, the others finish with their outputs."""
    from speculant.server.async_engine import Accepted, AsyncEngine, Failed, Finished, PromptInput

    ref, _ = reference
    llm = LLM(model=str(tiny_llama), speculative_config=SPECS["ngram"])
    loop_engine = AsyncEngine(llm.engine, max_waiting_seqs=8)
    bad = GREEDY.clone(logits_processors=[wrong_shape])

    async def run():
        hs = [loop_engine.submit([PromptInput(token_ids=p)], sp, stream=False)
              for p, sp in zip(HEALTHY + [BAD_PROMPT], PARAMS + [bad])]
        loop_engine.start()
        got = []
        for h in hs:
            assert isinstance(await asyncio.wait_for(h.queue.get(), 60), Accepted)
            got.append(await asyncio.wait_for(h.queue.get(), 60))
            loop_engine.close(h)
        return got

    try:
        got = asyncio.run(run())
    finally:
        loop_engine.shutdown()
    assert all(isinstance(ev, Finished) for ev in got[:3]), got
    assert [ev.output.outputs[0].token_ids for ev in got[:3]] == ref["ngram"]
    assert isinstance(got[3], Failed) and got[3].status == 500
    assert "wrong_shape returned" in got[3].message and "request req-" in got[3].message
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
