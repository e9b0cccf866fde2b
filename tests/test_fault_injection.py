"""Fault injection (issue 34, docs/hooks.md "Faults"): a strategy that misbehaves in one way per
mode runs beside healthy requests, offline (``LLM.generate`` with several prompts) and behind the
real HTTP server. Whatever it does, the healthy requests' outputs equal their outputs without the
faulty request (greedy and seeded sampled), the faulty request gets a correct plain continuation
(or, where a plugin's ``verify`` raised, a clear error naming the plugin), no KV block leaks, and
the engine and server keep serving.

The strategy drafts the last token repeated (point masses, or one-hot ``probs`` with
``probs=True``): always valid, often rejected; the faulty request is the one whose prompt starts
with MARK."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import torch
from pydantic import BaseModel, ConfigDict

from speculant import LLM, Proposal, SamplingParams, hookimpl
from speculant.engine.spec_decode import StrategyFault
from speculant.hookspecs import Strategy
from speculant.plugin_manager import register, unregister

MARK = 7  # the faulty request's prompt starts with this token
HEALTHY = [[5, 6, 5, 6, 5, 6], [9, 10, 11, 9, 10, 11], [3, 4, 3, 4]]
FAULTY = [MARK, 12, 13, 12, 13]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=12, ignore_eos=True)
# healthy: greedy, greedy, seeded sampled; the faulty one greedy
PARAMS = [GREEDY, GREEDY, SEEDED, GREEDY]


class FaultyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    num_speculative_tokens: int = 3
    mode: str = "none"
    probs: bool = False  # also propose q (one-hot rows)
    nth: int = 3  # "raise_nth": the call that raises


class Faulty(Strategy):
    name = "faulty"
    Config = FaultyConfig
    num_speculative_tokens = 3

    def __init__(self, config: FaultyConfig, ctx) -> None:
        super().__init__(config, ctx)
        self.cfg, self.V, self.calls = config, ctx.vocab_size, 0

    @hookimpl
    def propose(self, batch):
        self.calls += 1
        mode = self.cfg.mode
        marked = [s.token_ids[0] == MARK for s in batch.seqs]
        if mode == "sleep":
            time.sleep(0.01)
        if mode == "raise_nth" and self.calls == self.cfg.nth:
            raise RuntimeError("injected failure in propose")
        ids = [[s.token_ids[-1]] * s.max_draft for s in batch.seqs]
        if mode == "int_types":  # numpy ints, 0-d tensors, Python ints: all valid
            ids = [[np.int64(t), torch.tensor(t), t][: len(d)] for d, t in
                   zip(ids, (s.token_ids[-1] for s in batch.seqs))]
        for i, m in enumerate(marked):
            if m and mode == "oov":
                ids[i] = [self.V + 5] * batch.seqs[i].max_draft
            elif m and mode == "float_ids":
                ids[i] = [1.0] * batch.seqs[i].max_draft
            elif m and mode == "too_long":
                ids[i] = [1] * (batch.seqs[i].max_draft + 2)
        if mode == "rows" and any(marked):
            ids.append([1])
        probs = None
        if self.cfg.probs or mode in ("nan", "negative", "zero_at_draft"):
            L = max((len(d) for d in ids), default=0)
            probs = torch.zeros(len(ids), max(L, 1), self.V)
            for i, d in enumerate(ids):
                for j, t in enumerate(d):
                    probs[i, j, int(t)] = 1.0
                if marked[i] and d:
                    if mode == "nan":
                        probs[i, 0, 0] = float("nan")
                    elif mode == "negative":  # sums to 1, one entry below 0
                        probs[i, :, 0] -= 0.5
                        probs[i, :, 1] += 0.5
                    elif mode == "zero_at_draft":  # a distribution that never drafts d[0]
                        probs[i, 0, d[0]], probs[i, 0, (d[0] + 1) % self.V] = 0.0, 1.0
        return Proposal(token_ids=ids, probs=probs)

    @hookimpl
    def score(self, batch, proposal):
        if self.cfg.mode == "score_raises" and any(s.token_ids[0] == MARK for s in batch.seqs):
            raise RuntimeError("injected failure in score")
        return None  # the engine's target scorer

    @hookimpl
    def verify(self, batch, proposal, scores):
        if self.cfg.mode == "verify_raises" and any(s.token_ids[0] == MARK for s in batch.seqs):
            seq = next(s for s in batch.seqs if s.token_ids[0] == MARK)
            raise RuntimeError(f"injected failure in verify, secret {seq.token_ids}")
        return None  # the built-in verifier


class _Plugin:
    @hookimpl
    def register_strategies(self, register):
        register(Faulty)


@pytest.fixture(scope="module")
def faulty_plugin():
    name = register(_Plugin(), name="test-faults")
    yield name
    unregister(name)


def _spec(mode: str, **kw) -> dict:
    return {"method": "faulty", "num_speculative_tokens": 3, "mode": mode, **kw}


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_llama, faulty_plugin):
    """Outputs without the faulty request (the strategy with no fault, points masses and
    one-hot q) and plain decoding of every prompt."""
    prompts = HEALTHY + [FAULTY]
    plain = _tokens(LLM(model=str(tiny_llama)).generate(prompts, PARAMS, use_tqdm=False))
    ref = {}
    for probs in (False, True):
        llm = LLM(model=str(tiny_llama), speculative_config=_spec("none", probs=probs))
        ref[probs] = _tokens(llm.generate(HEALTHY, PARAMS[:3], use_tqdm=False))
        assert llm.get_metrics().num_draft_tokens > 0
    return plain, ref


def _no_leak(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()


# mode -> (probs, faults expected): every contained fault counts once, and once only (the
# strategy drafts no more for the requests concerned)
CONTAINED = {
    "rows": (False, 1),  # wrong row count: the step's proposal dropped
    "oov": (False, 1),  # out-of-vocabulary ids for one request: its drafts dropped
    "float_ids": (False, 1),
    "too_long": (False, 1),  # more drafts than max_draft
    "int_types": (False, 0),  # numpy / 0-d tensor / int ids: accepted
    "nan": (True, 1),  # NaN in q: point masses verified instead
    "negative": (True, 1),  # a negative q entry (rows still sum to 1)
    "zero_at_draft": (True, 1),  # q = 0 at the drafted token
    "raise_nth": (False, 1),  # propose raises on its 3rd call
    "score_raises": (False, 1),  # score raises: the step runs plain
    "sleep": (False, 0),  # slow, not faulty
}


# the default run: one of each kind (pinned on a sequence, on the step, in q); the rest are slow
FAST = {"oov", "nan", "raise_nth"}


@pytest.mark.parametrize("mode", [m if m in FAST else pytest.param(m, marks=pytest.mark.slow)
                                  for m in CONTAINED])
@pytest.mark.slow
def test_a_contained_fault_costs_no_one_their_output(tiny_llama, reference, mode, caplog):
    plain, ref = reference
    probs, faults = CONTAINED[mode]
    llm = LLM(model=str(tiny_llama), speculative_config=_spec(mode, probs=probs))
    with caplog.at_level(logging.WARNING, logger="speculant"):
        out = llm.generate(HEALTHY + [FAULTY], PARAMS, use_tqdm=False)
    got = _tokens(out)
    assert got[:3] == ref[probs], "a healthy request's output changed"
    assert got[3] == plain[3], "the faulty request's continuation is not the plain one"
    m = llm.get_metrics()
    assert m.num_faults == faults
    logged = [r.getMessage() for r in caplog.records if "fault 1 of" in r.getMessage()]
    assert len(logged) == min(faults, 1)
    if faults:  # it names the strategy and its plugin
        assert "strategy 'faulty' (plugin 'test-faults'" in logged[0], logged
        if mode not in ("rows", "raise_nth", "score_raises"):  # pinned on the faulty request
            assert out[3].metrics.num_faults == 1
            assert all(o.metrics.num_faults == 0 for o in out[:3])
    _no_leak(llm)
    # it keeps serving: the healthy prompts again, same outputs
    assert _tokens(llm.generate(HEALTHY, PARAMS[:3], use_tqdm=False)) == ref[probs]
    _no_leak(llm)


def test_verify_raising_aborts_only_its_step_with_an_error_naming_the_plugin(tiny_llama,
                                                                              reference):
    plain, ref = reference
    llm = LLM(model=str(tiny_llama), speculative_config=_spec("verify_raises"))
    # the healthy request runs (and finishes) before the faulty one joins
    params = [SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), GREEDY]
    with pytest.raises(StrategyFault) as e:
        llm.generate([HEALTHY[0], FAULTY], params, use_tqdm=False)
    err = e.value
    assert "strategy 'faulty' (plugin 'test-faults'" in str(err) and "verify()" in str(err)
    assert "secret" not in err.public_message and "faulty" in err.public_message
    outs = err.outputs
    assert outs[0].outputs[0].token_ids == plain[0][:1]  # finished before the fault
    assert outs[1].outputs[0].finish_reason == "abort"
    assert outs[0].error is None and outs[1].error == err.public_message
    _no_leak(llm)
    assert _tokens(llm.generate(HEALTHY, PARAMS[:3], use_tqdm=False)) == ref[False]
    _no_leak(llm)


def test_repeated_faults_turn_speculation_off_for_the_engine(tiny_llama, reference, caplog):
    plain, ref = reference
    llm = LLM(model=str(tiny_llama),
              speculative_config=_spec("raise_nth", nth=1, max_plugin_faults=1))
    with caplog.at_level(logging.WARNING, logger="speculant"):
        out = llm.generate(HEALTHY + [FAULTY], PARAMS, use_tqdm=False)
    assert _tokens(out) == ref[False] + [plain[3]]
    assert any("off for the rest of this engine's life" in r.getMessage() for r in caplog.records)
    calls = llm.engine.spec.strategy.calls
    assert calls == 1 and llm.engine.spec.max_lookahead() == 0
    assert _tokens(llm.generate(HEALTHY, PARAMS[:3], use_tqdm=False)) == ref[False]
    assert llm.engine.spec.strategy.calls == calls  # never asked again
    m = llm.get_metrics()
    assert m.num_faults == 1 and m.num_times_disabled == 1
    _no_leak(llm)


def test_bad_max_plugin_faults_names_the_field(tiny_llama, faulty_plugin):
    with pytest.raises(Exception, match="max_plugin_faults"):
        LLM(model=str(tiny_llama), speculative_config=_spec("none", max_plugin_faults=0))


# ----------------------------------------------------------------- the real server
def _serve(llm):
    """The real app (build_server) on uvicorn in a thread, on a free loopback port."""
    import socket
    import threading

    import uvicorn

    from speculant.server import build_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = build_server(llm, ["tiny"])
    server.a.start()
    uv = uvicorn.Server(uvicorn.Config(server.app, host="127.0.0.1", port=port,
                                       log_level="warning"))
    t = threading.Thread(target=uv.run, daemon=True)
    t.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    import httpx

    while True:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server not up"
        time.sleep(0.1)

    def stop():
        uv.should_exit = True
        t.join(10)
        server.a.shutdown()

    return base, stop


def _complete_all(base: str, prompts, params, stream: bool) -> list[dict]:
    """The prompts as concurrent completion requests; each answer's tokens or its error."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    def one(args):
        prompt, p = args
        body = {"model": "tiny", "prompt": prompt, "max_tokens": p.max_tokens,
                "temperature": p.temperature, "ignore_eos": True, "stream": stream}
        if p.seed is not None:
            body.update(seed=p.seed, top_p=p.top_p)
        if not stream:
            r = httpx.post(base + "/v1/completions", json=body, timeout=60)
            return {"status": r.status_code, "body": r.json()}
        events = []
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    import json

                    events.append(json.loads(line[6:]))
        return {"status": r.status_code, "events": events}

    with ThreadPoolExecutor(len(prompts)) as ex:
        return list(ex.map(one, zip(prompts, params)))


def _server_text(answer: dict) -> str | None:
    if "body" in answer:
        ch = answer["body"].get("choices")
        return ch[0]["text"] if ch else None
    return "".join(ch.get("text") or "" for ev in answer["events"] for ch in ev.get("choices") or [])


def _texts(llm, token_lists) -> list[str]:
    return [llm.tokenizer.decode(t, skip_special_tokens=True) for t in token_lists]


def _metric(base: str, name: str) -> float:
    import httpx

    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_server_oov_fault_in_one_stream_leaves_the_others_whole(tiny_llama, reference):
    pytest.importorskip("uvicorn")
    plain, ref = reference
    llm = LLM(model=str(tiny_llama), speculative_config=_spec("oov"))
    base, stop = _serve(llm)
    try:
        answers = _complete_all(base, HEALTHY + [FAULTY], PARAMS, stream=False)
        assert [a["status"] for a in answers] == [200] * 4, answers
        assert [_server_text(a) for a in answers] == _texts(llm, ref[False] + [plain[3]])
        assert _metric(base, "speculant_spec_decode_num_faults_total") == 1
        assert _metric(base, "speculant_kv_cache_blocks_used") == 0
        streams = _complete_all(base, HEALTHY + [FAULTY], PARAMS, stream=True)  # streams too
        for a in streams:
            assert a["status"] == 200 and not any("error" in ev for ev in a["events"]), a
        assert _metric(base, "speculant_spec_decode_num_faults_total") == 2
        assert _metric(base, "speculant_kv_cache_blocks_used") == 0
    finally:
        stop()


def test_server_verify_raising_fails_only_its_step_and_leaks_no_text(tiny_llama, reference):
    pytest.importorskip("uvicorn")
    plain, ref = reference
    llm = LLM(model=str(tiny_llama), speculative_config=_spec("verify_raises"))
    base, stop = _serve(llm)
    try:
        answers = _complete_all(base, [FAULTY], [GREEDY], stream=True)
        text = str(answers)
        assert "secret" not in text  # the plugin's exception text stays in the server log
        assert "strategy 'faulty' (plugin 'test-faults'" in text and "verify" in text
        assert _metric(base, "speculant_kv_cache_blocks_used") == 0
        again = _complete_all(base, HEALTHY, PARAMS[:3], stream=False)  # still serving
        assert [_server_text(a) for a in again] == _texts(llm, ref[False])
    finally:
        stop()


def test_a_fault_names_the_distribution_of_an_installed_plugin(tiny_llama):
    llm = LLM(model=str(tiny_llama), speculative_config={"method": "bigram",
                                                          "num_speculative_tokens": 2})
    said = llm.engine.spec._describe("strategy:bigram")
    assert said.startswith("strategy 'bigram' (plugin 'bigram', distribution speculant-bigram")


def test_server_step_error_text_reaches_a_client_only_when_it_was_alone(tiny_llama):
    """A step that raises fails every request in flight; its text (it may quote any of them)
    goes to a client only when that client's request was the only one."""
    import asyncio

    from speculant.server.async_engine import Accepted, AsyncEngine, Failed, PromptInput

    llm = LLM(model=str(tiny_llama), max_num_seqs=4)
    eng = llm.engine
    real_step = eng.step

    def flaky_step():
        if len(eng.scheduler.running) == 2:
            raise RuntimeError("boom: secret of request A")
        return real_step()

    eng.step = flaky_step
    loop_engine = AsyncEngine(eng, max_waiting_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)

    async def run():
        hs = [loop_engine.submit([PromptInput(token_ids=p)], params, stream=True)
              for p in HEALTHY[:2]]
        loop_engine.start()
        msgs = []
        for h in hs:
            assert isinstance(await asyncio.wait_for(h.queue.get(), 60), Accepted)
            ev = await asyncio.wait_for(h.queue.get(), 60)
            while not isinstance(ev, Failed):
                ev = await asyncio.wait_for(h.queue.get(), 60)
            msgs.append(ev.message)
            loop_engine.close(h)
        return msgs

    try:
        msgs = asyncio.run(run())
    finally:
        loop_engine.shutdown()
    assert all("RuntimeError" in m and "secret" not in m for m in msgs), msgs
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_a_real_draft_distribution_is_no_fault(tiny_llama):
    """The q of a draft model sampling with temperature, top-p and top-k passes the check."""
    llm = LLM(model=str(tiny_llama), speculative_config={
        "method": "draft_model", "model": str(tiny_llama), "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=3, max_tokens=16,
                            ignore_eos=True)
    llm.generate(HEALTHY, params, use_tqdm=False)
    m = llm.get_metrics()
    assert m.num_draft_tokens > 0 and m.num_accepted_tokens > 0 and m.num_faults == 0


@pytest.mark.parametrize("method", ["eagle", pytest.param("draft_model", marks=pytest.mark.slow)])
def test_a_request_disabled_mid_run_decodes_plain_beside_drafting_ones(tiny_factory,
                                                                       tmp_path_factory, method):
    """A fault pinned on one request mid-run: the strategy (one reading the target's hidden
    states, or a draft model) drafts on for the others; every output stays the plain one."""
    from test_eagle import SMALL_V, TARGET_LAYERS, make_eagle1

    target = tiny_factory("llama", vocab_size=SMALL_V, tokenizer=False,
                          num_hidden_layers=TARGET_LAYERS)
    model = (str(make_eagle1(tmp_path_factory.mktemp("e1"), target, SMALL_V, copy=True, seed=2))
             if method == "eagle" else str(target))
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 9, 10], [3, 4, 3, 4, 3, 4]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = LLM(model=str(target), skip_tokenizer_init=True).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm = LLM(model=str(target), skip_tokenizer_init=True,
              speculative_config={"method": method, "model": model, "num_speculative_tokens": 3})
    eng, done = llm.engine, {}
    for i, p in enumerate(prompts):
        eng.add_request(str(i), None, p, params)
    steps = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            done[out.request_id] = out
        steps += 1
        if steps == 3:  # the prefill and two decode steps in
            seq = eng.requests["1"].seqs[0]
            eng.spec._fault("injected", [seq])
    assert [done[str(i)].outputs[0].token_ids for i in range(3)] == _tokens(plain)
    assert done["1"].metrics.num_faults == 1 and done["0"].metrics.num_draft_tokens > 0
    assert not eng.spec.disabled and not eng.spec.pending  # forgotten once finished
    _no_leak(llm)


# ----------------------------------------------------------------- /metrics: lossless
@pytest.fixture
def lossy_plugin():
    from test_lossy_verifier import Top2Verifier

    class _Lossy:
        @hookimpl
        def register_strategies(self, register):
            register(Top2Verifier)

    name = register(_Lossy(), name="test-faults-lossy")
    yield name
    unregister(name)


@pytest.mark.parametrize("verifier", ["rejection_sampler", "top2"])
def test_metrics_export_whether_the_output_is_lossless(tiny_llama, lossy_plugin, verifier):
    """``speculant_spec_decode_lossless``: 1 with the built-in verifier (and without a strategy),
    0 with a verifier that declares itself lossy (SpecMetrics.lossless)."""
    pytest.importorskip("fastapi")
    from starlette.testclient import TestClient

    from speculant.server import build_server

    spec = {"method": "ngram", "num_speculative_tokens": 2, "acceptance_method": verifier}
    for llm, want in ((LLM(model=str(tiny_llama)), 1.0),
                      (LLM(model=str(tiny_llama), speculative_config=spec),
                       1.0 if verifier == "rejection_sampler" else 0.0)):
        assert llm.get_metrics().lossless is (want == 1.0)
        srv = build_server(llm, ["tiny"])
        srv.a.start()
        try:
            with TestClient(srv.app) as client:
                texts = [client.get("/metrics").text]  # before any step, and after one
                r = client.post("/v1/completions", json={"model": "tiny", "prompt": HEALTHY[0],
                                                         "max_tokens": 4, "temperature": 0})
                assert r.status_code == 200
                texts.append(client.get("/metrics").text)
        finally:
            srv.a.shutdown()
        for text in texts:
            lines = [ln for ln in text.splitlines()
                     if ln.startswith("speculant_spec_decode_lossless")]
            assert lines == [f'speculant_spec_decode_lossless{{model_name="tiny"}} {want}'], lines


# ----------------------------------------------------------------- seeded requests that fault
# the faulty request itself seeded and sampled (docs/architecture.md, Seeded requests)
FAULTY_SEEDED = SamplingParams(temperature=0.9, top_k=40, seed=23, max_tokens=12, ignore_eos=True)
POINT_MASS_FAULTS = ["oov", "float_ids", "too_long", "rows", "raise_nth", "score_raises"]


@pytest.fixture(scope="module")
def plain_seeded(tiny_llama):
    """The faulty prompt's plain seeded output (no strategy)."""
    return _tokens(LLM(model=str(tiny_llama)).generate([FAULTY], FAULTY_SEEDED, use_tqdm=False))[0]


@pytest.mark.parametrize("mode", [m if m == "oov" else pytest.param(m, marks=pytest.mark.slow)
                                  for m in POINT_MASS_FAULTS])
def test_a_seeded_request_whose_point_mass_strategy_faults_is_its_plain_seeded_run(
        tiny_llama, faulty_plugin, plain_seeded, mode):
    """Point-mass drafts: every step of the request, speculative, dropped or plain, samples each
    position with that position's keyed number, so the fault changes nothing: token for token
    the plain seeded output."""
    llm = LLM(model=str(tiny_llama), speculative_config=_spec(mode))
    out = llm.generate(HEALTHY + [FAULTY], PARAMS[:3] + [FAULTY_SEEDED], use_tqdm=False)
    assert llm.get_metrics().num_faults == 1
    assert out[3].outputs[0].token_ids == plain_seeded
    _no_leak(llm)


@pytest.mark.parametrize("mode", ["nan", pytest.param("negative", marks=pytest.mark.slow),
                                  pytest.param("zero_at_draft", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_a_seeded_request_whose_sampled_drafts_fault_depends_only_on_its_seed(
        tiny_llama, faulty_plugin, plain_seeded, mode):
    """Sampled drafts (``probs``): a step that verifies them keys its accept test and recovery
    apart from the plain sample, so the output is not the plain seeded one; a fault pinned on
    the request (its q, from its first step) keeps it a function of its seed and prompt alone:
    the same alone or beside other requests, and the plain seeded run once it drafts no more."""
    spec = _spec(mode, probs=True)
    alone = _tokens(LLM(model=str(tiny_llama), speculative_config=spec).generate(
        [FAULTY], FAULTY_SEEDED, use_tqdm=False))[0]
    llm = LLM(model=str(tiny_llama), speculative_config=spec)
    out = llm.generate(HEALTHY + [FAULTY], PARAMS[:3] + [FAULTY_SEEDED], use_tqdm=False)
    assert out[3].metrics.num_faults == 1 and out[3].metrics.num_drafts == 1
    assert out[3].outputs[0].token_ids == alone
    _no_leak(llm)


def test_a_seeded_request_whose_sampled_drafts_never_verified_is_its_plain_run(
        tiny_llama, faulty_plugin, plain_seeded):
    """Sampled drafts dropped before any was verified (out-of-vocabulary ids on its first
    step): its steps are all plain, so its output is the plain seeded one."""
    llm = LLM(model=str(tiny_llama), speculative_config=_spec("oov", probs=True))
    out = llm.generate(HEALTHY + [FAULTY], PARAMS[:3] + [FAULTY_SEEDED], use_tqdm=False)
    assert out[3].metrics.num_faults == 1 and out[3].metrics.num_draft_tokens == 0
    assert out[3].outputs[0].token_ids == plain_seeded
    _no_leak(llm)
