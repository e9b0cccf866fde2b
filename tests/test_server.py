"""`speculant serve` end to end: the real CLI starts the real server on a free loopback port with
the embedded default model and n-gram speculation; the official `openai` client and raw HTTP
(httpx) talk to it, and greedy answers are compared with offline `LLM.generate` / `LLM.chat`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

SPEC = {"method": "ngram", "num_speculative_tokens": 5}
NAME = "smol"
KEY = "sk-test-key"
MAX = 12
PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "Name three colors."}]
MAX_NUM_SEQS, MAX_WAITING = 8, 4
STARTUP_S = 240


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "speculant.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--speculative_config", json.dumps(SPEC), "--served-model-name", NAME,
           "--api-key", KEY, "--max_num_seqs", str(MAX_NUM_SEQS),
           "--max-waiting-seqs", str(MAX_WAITING)]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_S
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not up after {STARTUP_S}s:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture(scope="module")
def offline(server):
    """Offline reference outputs on the same model and strategy (one thread, like the server)."""
    import torch

    from speculant import LLM, SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(speculative_config=SPEC, max_num_seqs=MAX_NUM_SEQS)
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX)
        gen = llm.generate(PROMPTS, greedy, use_tqdm=False)
        with_lp = llm.generate(PROMPTS[0], greedy.clone(logprobs=3), use_tqdm=False)[0]
        chat = llm.chat(CHAT, greedy, use_tqdm=False)[0]
    finally:
        torch.set_num_threads(threads)
    return {"gen": {p: o for p, o in zip(PROMPTS, gen)}, "logprobs": with_lp, "chat": chat}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _auth():
    return {"Authorization": f"Bearer {KEY}"}


def _health(server) -> dict:
    return httpx.get(server + "/health", timeout=10).json()


# ----------------------------------------------------------------- incremental detokenizer
@pytest.mark.parametrize("step", [1, 3])
def test_incremental_detokenizer_matches_full_decode(default_model_path, step):
    from transformers import AutoTokenizer

    from speculant.server.async_engine import IncrementalDetokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_path))
    text = "Héllo wörld — 你好，世界 🌍🚀 done.<|im_end|> again\n\tend"
    ids = tok(text).input_ids
    for skip in (True, False):
        full = tok.decode(ids, skip_special_tokens=skip)
        d = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        for end in range(step, len(ids) + step, step):
            got = d.update(ids[:end])
            assert full.startswith(got), (got, full)
            assert "\ufffd" not in got
        assert got == full


# ----------------------------------------------------------------- models, auth
def test_models_and_api_key(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    r = httpx.get(server + "/v1/models", timeout=10)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(server + "/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=10)
    assert r.status_code == 401
    bad = openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=NAME, prompt="hi", max_tokens=2)
    assert httpx.get(server + "/health", timeout=10).status_code == 200  # no key needed


# ----------------------------------------------------------------- greedy == offline
def test_completions_greedy_equal_offline(client, offline):
    r = client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=MAX, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c, p in zip(r.choices, PROMPTS):
        ref = offline["gen"][p].outputs[0]
        assert c.text == ref.text
        assert c.finish_reason == ref.finish_reason
    ref_prompt = sum(len(offline["gen"][p].prompt_token_ids) for p in PROMPTS)
    ref_completion = sum(len(offline["gen"][p].outputs[0].token_ids) for p in PROMPTS)
    assert r.usage.prompt_tokens == ref_prompt
    assert r.usage.completion_tokens == ref_completion
    assert r.usage.total_tokens == ref_prompt + ref_completion


def test_chat_greedy_equal_offline(client, offline):
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=MAX, temperature=0)
    ref = offline["chat"]
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_echo_returns_prompt_then_completion(client, offline):
    p = PROMPTS[0]
    r = client.completions.create(model=NAME, prompt=p, max_tokens=MAX, temperature=0, echo=True)
    assert r.choices[0].text == p + offline["gen"][p].outputs[0].text


# ----------------------------------------------------------------- streaming
def test_streaming_completion_equals_offline(client, offline):
    p = PROMPTS[1]
    chunks = list(client.completions.create(model=NAME, prompt=p, max_tokens=MAX, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) >= 2  # really incremental
    assert "".join(c.choices[0].text for c in text_chunks) == offline["gen"][p].outputs[0].text
    assert text_chunks[-1].choices[0].finish_reason == offline["gen"][p].outputs[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].usage.completion_tokens == len(offline["gen"][p].outputs[0].token_ids)


def test_streaming_chat_equals_offline_and_ends_with_done(server, offline):
    body = {"model": NAME, "messages": CHAT, "max_tokens": MAX, "temperature": 0, "stream": True}
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, headers=_auth(),
                      timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert text == offline["chat"].outputs[0].text
    assert events[-1]["choices"][0]["finish_reason"] == offline["chat"].outputs[0].finish_reason
    assert {e["object"] for e in events} == {"chat.completion.chunk"}


def test_streaming_many_prompts_n2_echo_logprobs(server, offline):
    body = {"model": NAME, "prompt": PROMPTS[:2], "max_tokens": MAX, "temperature": 0, "n": 2,
            "echo": True, "logprobs": 1, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, headers=_auth(),
                      timeout=120) as r:
        assert r.status_code == 200
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln and ln != "data: [DONE]"]
    texts: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    finish: dict[int, str] = {}
    for e in events:
        (c,) = e["choices"]
        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        tokens.setdefault(c["index"], []).extend(c["logprobs"]["tokens"])
        if c["finish_reason"]:
            finish[c["index"]] = c["finish_reason"]
    assert sorted(texts) == [0, 1, 2, 3]  # index = prompt * n + sample
    for idx, text in texts.items():
        p = PROMPTS[idx // 2]
        ref = offline["gen"][p]
        assert text == p + ref.outputs[0].text
        assert "".join(tokens[idx]) == text
        assert len(tokens[idx]) == len(ref.prompt_token_ids) + len(ref.outputs[0].token_ids)
        assert finish[idx] == ref.outputs[0].finish_reason
        first = next(e["choices"][0] for e in events if e["choices"][0]["index"] == idx)
        assert first["text"] == p  # the echoed prompt comes first, with its logprobs
        assert first["logprobs"]["token_logprobs"][0] is None
        assert all(x is not None for x in first["logprobs"]["token_logprobs"][1:])


def test_concurrent_streams_are_batched_and_not_mixed(server, client, offline):
    """Streams running at the same time (in one batch) each get exactly their own output."""
    from concurrent.futures import ThreadPoolExecutor

    steps0 = _health(server)["engine_steps"]

    def one(p: str) -> tuple[set[str], str]:
        chunks = list(client.completions.create(model=NAME, prompt=p, max_tokens=MAX,
                                                temperature=0, stream=True))
        return {c.id for c in chunks}, "".join(c.choices[0].text for c in chunks if c.choices)

    with ThreadPoolExecutor(len(PROMPTS) * 2) as pool:
        results = list(pool.map(one, PROMPTS * 2))
    for p, (ids, text) in zip(PROMPTS * 2, results):
        assert len(ids) == 1
        assert text == offline["gen"][p].outputs[0].text
    assert len({next(iter(ids)) for ids, _ in results}) == len(results)
    concurrent_steps = _health(server)["engine_steps"] - steps0
    steps0 = _health(server)["engine_steps"]
    for p in PROMPTS * 2:
        one(p)
    sequential_steps = _health(server)["engine_steps"] - steps0
    # batched: far fewer engine steps than running the requests one after another
    assert concurrent_steps <= sequential_steps / 2, (concurrent_steps, sequential_steps)


# ----------------------------------------------------------------- n, seed, stop
def test_n_greedy_and_seeded_sampling(client, offline):
    p = PROMPTS[0]
    r = client.completions.create(model=NAME, prompt=p, max_tokens=MAX, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert {c.text for c in r.choices} == {offline["gen"][p].outputs[0].text}
    kw = dict(model=NAME, messages=CHAT, max_tokens=8, temperature=1.0, top_p=0.9, n=3, seed=1234,
              logprobs=True, extra_body={"top_k": 50})
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.usage.completion_tokens == sum(len(c.logprobs.content) for c in a.choices)
    assert all(1 <= len(c.logprobs.content) <= 8 for c in a.choices)


def _stop_case(offline):
    text = offline["gen"][PROMPTS[1]].outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), text
    return text, stop, text[: text.find(stop)]


def test_stop_string(client, offline):
    text, stop, expected = _stop_case(offline)
    r = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=MAX, temperature=0,
                                  stop=[stop])
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"
    assert len(expected) < len(text)


def test_stop_string_streaming_never_leaks_the_stop(client, offline):
    _, stop, expected = _stop_case(offline)
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=MAX,
                                            temperature=0, stop=stop, stream=True))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


# ----------------------------------------------------------------- logprobs
def test_completion_logprobs_match_offline(client, offline):
    ref = offline["logprobs"]
    p = PROMPTS[0]
    r = client.completions.create(model=NAME, prompt=p, max_tokens=MAX, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    out = ref.outputs[0]
    assert len(lp.tokens) == len(out.token_ids) == len(lp.token_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text == out.text
    for t, got, top, d in zip(out.token_ids, lp.token_logprobs, lp.top_logprobs, out.logprobs):
        assert got == pytest.approx(d[t].logprob, abs=1e-3)
        assert 3 <= len(top) <= 4
        assert got == pytest.approx(max(top.values()), abs=1e-5)  # greedy picks the top token
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_echo_logprobs_cover_prompt_and_completion(client, offline):
    p = PROMPTS[0]
    n_prompt = len(offline["gen"][p].prompt_token_ids)
    r = client.completions.create(model=NAME, prompt=p, max_tokens=4, temperature=0, logprobs=1,
                                  echo=True)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == n_prompt + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == r.choices[0].text


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2
        assert c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-5)
        assert c.bytes == list(c.token.encode())


# ----------------------------------------------------------------- errors
@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "no_such_field": 1}, "no_such_field"),
    ({"max_tokens": 2}, "prompt"),
    ({"prompt": [10**9], "max_tokens": 2}, "prompt"),
    ({"prompt": [1] * 5000, "max_tokens": 2}, "prompt"),
    ({"prompt": "hi", "logprobs": 99}, "logprobs"),
    ({"prompt": "hi", "n": MAX_NUM_SEQS + MAX_WAITING + 1}, "n"),
    ({"prompt": "hi", "stop": ""}, "stop"),
])
def test_bad_completion_request_is_400_naming_the_field(server, body, param):
    r = httpx.post(server + "/v1/completions", json={"model": NAME, **body}, headers=_auth(),
                   timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert err["message"]


def test_other_errors(server, client):
    r = httpx.post(server + "/v1/chat/completions", json={"model": NAME, "messages": []},
                   headers=_auth(), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    for headers in (_auth(), {**_auth(), "Content-Type": "application/json"}):
        r = httpx.post(server + "/v1/completions", content=b"{not json", headers=headers,
                       timeout=60)
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(server + "/v1/completions", json={"model": "nope", "prompt": "hi"},
                   headers=_auth(), timeout=60)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=2, temperature=-3)
    assert e.value.body["param"] == "temperature"


# ----------------------------------------------------------------- overload, disconnect
def _wait(server, pred, what: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = _health(server)
        if pred(h):
            return h
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}: {h}")
        time.sleep(0.1)


def test_overload_503_and_disconnect_frees_kv_blocks(server, client):
    assert _wait(server, lambda h: h["inflight_seqs"] == 0, "an idle server")["kv_blocks_used"] == 0
    aborted0 = _sum(_metrics(server), "speculant_request_aborted_total")
    # long enough that nothing can finish during the test: every request must be aborted
    body = {"model": NAME, "prompt": PROMPTS[2], "max_tokens": 3000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    seats = MAX_NUM_SEQS + MAX_WAITING
    with httpx.Client(base_url=server, headers=_auth(), timeout=120,
                      limits=httpx.Limits(max_connections=seats + 4)) as http:
        streams = []
        try:
            for _ in range(seats):
                resp = http.send(http.build_request("POST", "/v1/completions", json=body),
                                 stream=True)
                assert resp.status_code == 200
                streams.append(resp)
            r = http.post("/v1/completions", json={**body, "stream": False})
            assert r.status_code == 503
            assert r.json()["error"]["type"] == "service_unavailable_error"
            with pytest.raises(openai.InternalServerError):
                client.completions.create(model=NAME, prompt="hi", max_tokens=2)
            h = _wait(server, lambda h: h["kv_blocks_used"] > 0 and h["num_running"] > 0,
                      "running sequences")
            assert h["inflight_seqs"] == seats
            first = next(streams[0].iter_lines())  # tokens really flow
            assert first.startswith("data: ")
        finally:
            for resp in streams:
                resp.close()  # the client goes away mid-stream
    h = _wait(server, lambda h: h["inflight_seqs"] == 0 and h["kv_blocks_used"] == 0,
              "the aborted streams to free their blocks", timeout=5)
    assert h["num_running"] == 0 and h["num_waiting"] == 0
    assert _sum(_metrics(server), "speculant_request_aborted_total") - aborted0 == seats

    # a non-streaming client that gives up is noticed too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", json={**body, "stream": False}, headers=_auth(),
                   timeout=httpx.Timeout(60, read=1.5))
    _wait(server, lambda h: h["inflight_seqs"] == 0 and h["kv_blocks_used"] == 0,
          "the abandoned request to free its blocks", timeout=5)
    assert _sum(_metrics(server), "speculant_request_aborted_total") - aborted0 == seats + 1
    r = client.completions.create(model=NAME, prompt="hi", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2  # still serving


# ----------------------------------------------------------------- metrics
def _metrics(server) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + json.dumps(dict(sorted(s.labels.items())), separators=(",", ":"))
            out[key] = out.get(key, 0.0) + s.value
    return out


def _sum(m: dict[str, float], name: str, **labels) -> float:
    total = 0.0
    for k, v in m.items():
        n, _, lab = k.partition("{")
        if n != name:
            continue
        d = json.loads("{" + lab)
        if all(d.get(a) == b for a, b in labels.items()):
            total += v
    return total


def test_prometheus_metrics(server, client):
    httpx.post(server + "/v1/completions", json={"model": NAME, "prompt": "hi", "n": -1},
               headers=_auth(), timeout=60)
    before = _metrics(server)
    r = client.completions.create(model=NAME, prompt="1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,",
                                  max_tokens=MAX, temperature=0)
    after = _metrics(server)
    d = lambda name, **kw: _sum(after, name, **kw) - _sum(before, name, **kw)  # noqa: E731
    assert d("speculant_http_requests_total", endpoint="/v1/completions", status="200") == 1
    assert d("speculant_generation_tokens_total") == r.usage.completion_tokens
    assert d("speculant_prompt_tokens_total") == r.usage.prompt_tokens
    assert d("speculant_e2e_request_latency_seconds_count") == 1
    assert d("speculant_time_per_output_token_seconds_count") == 1
    drafts = d("speculant_spec_decode_num_draft_tokens_total")
    accepted = d("speculant_spec_decode_num_accepted_tokens_total")
    assert d("speculant_spec_decode_num_drafts_total") >= 1
    assert 0 < accepted <= drafts  # a repetitive prompt: n-gram drafts get accepted
    assert d("speculant_spec_decode_num_accepted_tokens_per_pos_total") == accepted
    assert d("speculant_spec_decode_num_draft_tokens_per_pos_total") == drafts
    assert _sum(after, "speculant_http_requests_total", endpoint="/v1/completions",
                status="400") >= 1
    assert _sum(after, "speculant_kv_cache_blocks_used") == 0


# ----------------------------------------------------------------- the engine loop itself
def test_engine_loop_survives_a_failing_step(tiny_llama):
    """A step that raises fails the requests in flight (500), frees their blocks, and the loop
    goes on serving."""
    import asyncio

    from speculant import LLM, SamplingParams
    from speculant.server.async_engine import Accepted, AsyncEngine, Failed, Finished, PromptInput

    llm = LLM(model=str(tiny_llama), max_num_seqs=4, speculative_config=SPEC)
    eng = llm.engine
    real_step, calls = eng.step, []

    def flaky_step():
        calls.append(1)
        if len(calls) == 2:  # the first decode step after the prefill
            raise RuntimeError("boom")
        return real_step()

    eng.step = flaky_step
    loop_engine = AsyncEngine(eng, max_waiting_seqs=4)
    loop_engine.start()
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)

    async def run():
        h = loop_engine.submit([PromptInput(token_ids=[5, 6, 7, 8])], params, stream=True)
        assert isinstance(await asyncio.wait_for(h.queue.get(), 60), Accepted)
        ev = await asyncio.wait_for(h.queue.get(), 60)
        while not isinstance(ev, Failed):  # deltas of the prefill's token may come first
            ev = await asyncio.wait_for(h.queue.get(), 60)
        assert ev.status == 500 and "boom" in ev.message
        loop_engine.close(h)
        h2 = loop_engine.submit([PromptInput(token_ids=[5, 6, 7, 8])], params, stream=False)
        assert isinstance(await asyncio.wait_for(h2.queue.get(), 60), Accepted)
        done = await asyncio.wait_for(h2.queue.get(), 60)
        assert isinstance(done, Finished)
        h2.finished = True
        loop_engine.close(h2)
        return done.output

    try:
        out = asyncio.run(run())
    finally:
        loop_engine.shutdown()
    ref = LLM(model=str(tiny_llama), speculative_config=SPEC).generate(
        {"prompt_token_ids": [5, 6, 7, 8]}, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    assert loop_engine.inflight_seqs == 0
