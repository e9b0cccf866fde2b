"""Bounded loopback load test of ``speculant serve``.

For each mode (with the speculative config, and without speculation) it starts the real server
(``python -m speculant.cli serve``) on a free 127.0.0.1 port, runs ``--clients`` concurrent
streaming clients (the official ``openai`` async client; half /v1/completions, half
/v1/chat/completions, greedy, each its own prompt) and checks that:

* every stream is complete (a finish_reason, usage, ``[DONE]``) and carries one response id only,
* every output equals the offline greedy result of ``LLM.generate`` / ``LLM.chat`` for its prompt
  (so nothing got mixed up between concurrent requests),
* no KV cache block is left allocated and nothing is in flight at the end (``/health``).

It reports requests/s, output tokens/s and p50/p99 time per output token (TPOT) and time to
first token, plus the server's speculation counters, and writes JSON into bench/results/.

    python bench/load_test.py                      # 64 clients, 64 tokens, ngram k=5 vs plain
    python bench/load_test.py --clients 8 --max-tokens 16 --out /tmp/x.json   # a quick run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parent.parent
TOPICS = ["the ocean", "a small robot", "the moon", "coffee", "a lighthouse", "prime numbers",
          "the city of Paris", "honey bees", "a rainy day", "volcanoes", "the internet",
          "a chess game", "winter", "trains", "photosynthesis", "a library", "the desert",
          "music", "a bicycle", "mountains", "clocks", "the color blue", "a garden", "rivers",
          "friendship", "an old map", "stars", "bread", "a violin", "snow", "the wind", "lions"]


def prompts(n: int) -> list[dict]:
    """n distinct requests: alternately a completion prompt and a chat conversation."""
    out = []
    for i in range(n):
        topic = TOPICS[i // 2 % len(TOPICS)] + ("" if i < 2 * len(TOPICS) else f" (part {i})")
        if i % 2 == 0:
            kind = i // 2 % 3
            text = [f"Here is a list of facts about {topic}:\n1.",
                    f"Q: What do you know about {topic}?\nA:",
                    f"Count from {i} to {i + 20}: {i}, {i + 1}, {i + 2},"][kind]
            out.append({"kind": "completion", "prompt": text})
        else:
            out.append({"kind": "chat", "messages": [
                {"role": "user", "content": f"Write two sentences about {topic}."}]})
    return out


def offline_reference(reqs: list[dict], spec: dict | None, max_tokens: int) -> list[dict]:
    import torch

    from speculant import LLM, SamplingParams

    llm = LLM(speculative_config=spec, max_num_seqs=len(reqs))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    comp = [r for r in reqs if r["kind"] == "completion"]
    chat = [r for r in reqs if r["kind"] == "chat"]
    outs = {}
    for r, o in zip(comp, llm.generate([r["prompt"] for r in comp], params, use_tqdm=False)):
        outs[id(r)] = o
    for r, o in zip(chat, llm.chat([r["messages"] for r in chat], params, use_tqdm=False)):
        outs[id(r)] = o
    del llm
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return [{"text": outs[id(r)].outputs[0].text, "tokens": len(outs[id(r)].outputs[0].token_ids),
             "finish_reason": outs[id(r)].outputs[0].finish_reason} for r in reqs]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, spec: dict | None, max_num_seqs: int, threads: int, log: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "speculant.cli", "serve", "--host", "127.0.0.1",
               "--port", str(self.port), "--max-num-seqs", str(max_num_seqs),
               "--served-model-name", "default"]
        if spec is not None:
            cmd += ["--speculative-config", json.dumps(spec)]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false")
        self.log = log
        with open(log, "w") as fh:
            self.proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not ready after {timeout}s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


async def one_client(client: openai.AsyncOpenAI, req: dict, max_tokens: int) -> dict:
    kw = dict(model="default", max_tokens=max_tokens, temperature=0, stream=True,
              stream_options={"include_usage": True})
    t0 = time.perf_counter()
    times, parts, ids, finish, usage = [], [], set(), None, None
    if req["kind"] == "completion":
        stream = await client.completions.create(prompt=req["prompt"], **kw)
    else:
        stream = await client.chat.completions.create(messages=req["messages"], **kw)
    async for chunk in stream:
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            piece = ch.text if req["kind"] == "completion" else (ch.delta.content or "")
            if piece:
                parts.append(piece)
                times.append(time.perf_counter())
            if ch.finish_reason is not None:
                finish = ch.finish_reason
    t_end = time.perf_counter()
    n_tok = usage.completion_tokens if usage is not None else 0
    return {"text": "".join(parts), "ids": sorted(ids), "finish_reason": finish, "tokens": n_tok,
            "start": t0, "first": times[0] if times else None, "end": t_end,
            "last": times[-1] if times else None, "chunks": len(times)}


def spec_counters(base: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base + "/metrics", timeout=10).text
    want = {"speculant_spec_decode_num_drafts_total", "speculant_spec_decode_num_draft_tokens_total",
            "speculant_spec_decode_num_accepted_tokens_total",
            "speculant_spec_decode_num_emitted_tokens_total",
            "speculant_spec_decode_num_spec_steps_total",
            "speculant_spec_decode_num_plain_steps_total", "speculant_engine_steps"}
    out: dict = {"accepted_per_position": {}}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in want:
                out[s.name.removeprefix("speculant_").removesuffix("_total")] = int(s.value)
            elif s.name == "speculant_spec_decode_num_accepted_tokens_per_pos_total":
                out["accepted_per_position"][int(s.labels["position"])] = int(s.value)
    out["accepted_per_position"] = [out["accepted_per_position"][k]
                                    for k in sorted(out["accepted_per_position"])]
    return out


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def run_clients(base: str, reqs: list[dict], max_tokens: int, timeout: float) -> tuple:
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0,
                                timeout=timeout,
                                http_client=httpx.AsyncClient(
                                    limits=httpx.Limits(max_connections=len(reqs) + 8),
                                    timeout=timeout))
    t0 = time.perf_counter()
    try:
        results = await asyncio.wait_for(
            asyncio.gather(*(one_client(client, r, max_tokens) for r in reqs)), timeout)
    finally:
        await client.close()
    return results, time.perf_counter() - t0


def run_mode(name: str, spec: dict | None, reqs: list[dict], ref: list[dict], args) -> dict:
    log = Path(tempfile.gettempdir()) / f"speculant_load_test_server_{name}_{os.getpid()}.log"
    server = Server(spec, args.max_num_seqs, args.threads, log)
    try:
        server.wait_ready(args.startup_timeout)
        # one warm-up request so that the timed run does not pay first-call costs
        httpx.post(server.base + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4},
                   timeout=120).raise_for_status()
        before = spec_counters(server.base)
        results, wall = asyncio.run(run_clients(server.base, reqs, args.max_tokens, args.timeout))
        after = spec_counters(server.base)
        health = httpx.get(server.base + "/health", timeout=10).json()
    finally:
        server.stop()
    mismatches, incomplete, mixed = [], [], []
    for i, (r, ref_i) in enumerate(zip(results, ref)):
        if r["finish_reason"] is None or r["tokens"] != ref_i["tokens"]:
            incomplete.append(i)
        if len(r["ids"]) != 1:
            mixed.append(i)
        if r["text"] != ref_i["text"]:
            mismatches.append({"client": i, "kind": reqs[i]["kind"], "got": r["text"],
                               "want": ref_i["text"]})
    tpot = [(r["last"] - r["first"]) / (r["tokens"] - 1) for r in results
            if r["tokens"] > 1 and r["first"] is not None]
    ttft = [r["first"] - r["start"] for r in results if r["first"] is not None]
    total_tokens = sum(r["tokens"] for r in results)
    delta = {k: after[k] - before.get(k, 0) for k in after if k != "accepted_per_position"}
    acc_pos = [a - (before["accepted_per_position"][j] if j < len(before["accepted_per_position"])
                    else 0) for j, a in enumerate(after["accepted_per_position"])]
    drafts = delta.get("spec_decode_num_draft_tokens", 0)
    summary = {
        "mode": name, "speculative_config": spec, "clients": len(reqs),
        "max_tokens": args.max_tokens, "wall_s": round(wall, 3),
        "requests_per_s": round(len(reqs) / wall, 4),
        "output_tokens_per_s": round(total_tokens / wall, 2), "output_tokens": total_tokens,
        "tpot_ms_p50": round(1000 * pct(tpot, 50), 2) if tpot else None,
        "tpot_ms_p99": round(1000 * pct(tpot, 99), 2) if tpot else None,
        "tpot_ms_mean": round(1000 * statistics.fmean(tpot), 2) if tpot else None,
        "ttft_ms_p50": round(1000 * pct(ttft, 50), 1) if ttft else None,
        "ttft_ms_p99": round(1000 * pct(ttft, 99), 1) if ttft else None,
        "all_equal_offline": not mismatches, "mismatches": mismatches,
        "all_complete": not incomplete, "incomplete": incomplete,
        "nothing_mixed": not mixed, "mixed": mixed,
        "kv_blocks_used_at_end": health["kv_blocks_used"],
        "inflight_seqs_at_end": health["inflight_seqs"],
        "engine_steps": delta.get("engine_steps"),
        "spec": {**delta, "accepted_per_position": acc_pos,
                 "acceptance_rate": round(delta.get("spec_decode_num_accepted_tokens", 0) / drafts, 4)
                 if drafts else None},
    }
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 5}')
    ap.add_argument("--threads", type=int, default=1, help="OMP threads of the server (CPU)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds for all clients of a mode")
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--modes", default="spec,plain")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" /
                                         time.strftime("server_load_%Y%m%d-%H%M%S.json",
                                                       time.gmtime())))
    args = ap.parse_args(argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    spec = json.loads(args.speculative_config)
    reqs = prompts(args.clients)

    import torch

    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the engine keeps a set count
    report = {"host": {"platform": platform.platform(), "python": platform.python_version(),
                       "cpu_count": os.cpu_count(), "torch": torch.__version__,
                       "device": "cuda" if torch.cuda.is_available() else "cpu",
                       "threads": args.threads},
              "model": "embedded default (SmolLM2-135M-Instruct)", "modes": {}}
    ok = True
    for name in args.modes.split(","):
        mode_spec = spec if name == "spec" else None
        t = time.perf_counter()
        ref = offline_reference(reqs, mode_spec, args.max_tokens)
        print(f"[{name}] offline reference: {time.perf_counter() - t:.1f}s", flush=True)
        res = run_mode(name, mode_spec, reqs, ref, args)
        report["modes"][name] = res
        ok &= (res["all_equal_offline"] and res["all_complete"] and res["nothing_mixed"]
               and res["kv_blocks_used_at_end"] == 0 and res["inflight_seqs_at_end"] == 0)
        print(f"[{name}] {res['requests_per_s']} req/s, {res['output_tokens_per_s']} tok/s, "
              f"TPOT p50 {res['tpot_ms_p50']} ms p99 {res['tpot_ms_p99']} ms, "
              f"equal offline: {res['all_equal_offline']}, complete: {res['all_complete']}, "
              f"kv blocks left: {res['kv_blocks_used_at_end']}", flush=True)
    if "spec" in report["modes"] and "plain" in report["modes"]:
        s, p = report["modes"]["spec"], report["modes"]["plain"]
        report["speedup_requests_per_s"] = round(s["requests_per_s"] / p["requests_per_s"], 3)
        if s["tpot_ms_p50"] and p["tpot_ms_p50"]:
            report["tpot_p50_ratio_spec_over_plain"] = round(s["tpot_ms_p50"] / p["tpot_ms_p50"], 3)
    report["passed"] = bool(ok)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}; passed: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
