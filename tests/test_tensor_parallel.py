"""Tensor parallelism end to end on the CPU (gloo): ``LLM(tensor_parallel_size=N)`` starts its
workers, rank 0 mirrors each target call to them (engine/tp_runner.py), and the output is the
one-device output: greedy token for token, plain and with every built-in strategy (the drafters
run unsharded on rank 0), seeded sampling too (fp32 tiny models). Workers exit on close(), on a
start-up failure, and when their parent is killed; bad sizes are clear errors. docs/tensor_parallel.md.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from checkpoints import BIG_V, make_eagle1, make_eagle3, make_mlp

from speculant import LLM, SamplingParams
from speculant.config import EngineConfig
from speculant.engine.tp_runner import (
    FORWARD,
    MAX_CAPACITY,
    MIN_CAPACITY,
    SCORE,
    RemoteSeq,
    next_capacity,
    pack_call,
    unpack_call,
)
from speculant.spec_registry import SpeculativeConfig

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[1, 5, 9, 300, 17], [42, 43], [7] * 12, [100, 200, 300, 400, 500, 600, 700]]


def _ids(llm: LLM, params: SamplingParams, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _greedy(n: int = 16) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _worker_pids() -> list[int]:
    """This process's live tensor-parallel worker children."""
    me, out = os.getpid(), []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == me and b"speculant.distributed.worker" in cmd:
            out.append(int(d.name))
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def plain_ref(tiny_llama) -> list[list[int]]:
    return _ids(LLM(model=str(tiny_llama), max_num_seqs=8), _greedy())


# -------------------------------------------------------------------------------- options
@pytest.mark.parametrize("tp", [0, -2, True])
def test_sizes_below_one_are_refused(tp):
    with pytest.raises(ValueError, match=rf"tensor_parallel_size={tp!r}: .*>= 1"):
        LLM(tensor_parallel_size=tp, device="cpu")


def test_more_ranks_than_cuda_devices_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 needs 4 CUDA devices .* 2 are "
                       r"visible.*use tensor_parallel_size<=2"):
        EngineConfig(tensor_parallel_size=4, device="cuda")
    assert EngineConfig(tensor_parallel_size=2, device="cuda").tensor_parallel_size == 2
    with pytest.raises(ValueError, match=r"device='cuda:1' with tensor_parallel_size=2: rank r "
                       r"runs on cuda:r.*CUDA_VISIBLE_DEVICES"):
        EngineConfig(tensor_parallel_size=2, device="cuda:1")
    assert EngineConfig(tensor_parallel_size=4, device="cpu").tensor_parallel_size == 4


def test_draft_tensor_parallel_size_is_1():
    assert SpeculativeConfig(method="ngram", draft_tensor_parallel_size=1)
    assert SpeculativeConfig(method="ngram").draft_tensor_parallel_size is None
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=2: .*runs unsharded on "
                       "rank 0.*use draft_tensor_parallel_size=1"):
        SpeculativeConfig(method="ngram", draft_tensor_parallel_size=2)


def test_legacy_flat_draft_size_is_checked(tiny_llama):
    with pytest.warns(DeprecationWarning), pytest.raises(Exception, match="runs unsharded"):
        LLM(model=str(tiny_llama), speculative_model="[ngram]", num_speculative_tokens=2,
            speculative_draft_tensor_parallel_size=2)


def test_cli_spellings():
    from speculant.cli import build_parser

    p = build_parser()
    for flag in ("-tp", "--tensor-parallel-size", "--tensor_parallel_size"):
        assert p.parse_args(["serve", flag, "2"]).tensor_parallel_size == 2
        assert p.parse_args(["generate", "--prompt", "hi", flag, "3"]).tensor_parallel_size == 3
    args = p.parse_args(["serve", "--speculative-draft-tensor-parallel-size", "1"])
    assert args.speculative_draft_tensor_parallel_size == 1
    assert p.parse_args(["serve"]).tensor_parallel_size == 1


def test_plugins_reports_tensor_parallelism(capsys):
    from speculant.cli import main

    assert main(["plugins"]) == 0
    assert "tensor parallelism: tensor_parallel_size " in capsys.readouterr().out


# -------------------------------------------------------------------------------- messages
def test_call_message_round_trip():
    seqs = [RemoteSeq(5, [3, 1, 4]), RemoteSeq(0, [9]), RemoteSeq(17, list(range(200)))]
    toks = [[11], [1, 2, 3], list(range(40))]
    msg = pack_call(SCORE, 2 | 4, (1, 3), seqs, toks)
    assert msg[0] == len(msg)
    call = unpack_call(msg)
    assert (call.op, call.flags, call.aux_layers) == (SCORE, 6, (1, 3))
    assert call.new_tokens == toks and call.seqs == seqs and call.max_prefill is None
    # tokens still on the device: only their count travels
    call = unpack_call(pack_call(FORWARD, 1, (), seqs, toks))
    assert [len(t) for t in call.new_tokens] == [1, 3, 40] and call.seqs == seqs
    # a decode step of 32 sequences with tables of 8 blocks fits the smallest buffer
    small = pack_call(FORWARD, 0, (), [RemoteSeq(100, list(range(8)))] * 32, [[1]] * 32)
    assert len(small) <= MIN_CAPACITY
    # the next buffer: a power of two with room for a quarter more, within the bounds
    assert next_capacity(len(small)) == MIN_CAPACITY
    assert [next_capacity(n) for n in (600, 900, 1000)] == [1024, 2048, 2048]
    assert next_capacity(10**6) == MAX_CAPACITY


# -------------------------------------------------------------------------------- runtime
# slow (two TP 2 starts, ~17 s on a busy 2-core machine): the default run's TP 2 greedy equality
# is tests/test_tp_trees.py's test_tp2_tree_greedy_equals_tp1_plain[oracle-4]
@pytest.mark.slow
def test_tp2_greedy_equals_tp1_then_close(tiny_llama, plain_ref, caplog):
    # overlapped decode steps: their tokens still on the device travel on the device group
    with caplog.at_level(logging.INFO, logger="speculant"):
        llm = LLM(model=str(tiny_llama), max_num_seqs=8, tensor_parallel_size=2,
                  async_scheduling=True)
    assert "tensor_parallel_size 2" in caplog.text  # the engine's start-up line
    procs = llm.engine.tp_group.procs
    assert len(procs) == 1 and _worker_pids() == [procs[0].pid]
    assert llm.engine.async_decoder is not None
    # the control group never times out: a worker waits there while rank 0 idles (a server
    # without requests for hours), the default 30 minutes would end it
    from datetime import timedelta

    from speculant.distributed import tensor_parallel

    control = tensor_parallel().cpu_group._get_backend(torch.device("cpu"))
    assert control.options._timeout >= timedelta(days=30)
    assert _ids(llm, _greedy()) == plain_ref
    # a 600-token prefill outgrows the broadcast buffer: its rest follows in a second one; the
    # size-1 LLM of the reference, made beside the TP2 one, holds the whole model
    long = [list(range(3, 303)), list(range(400, 700))]
    ref = _ids(LLM(model=str(tiny_llama), max_num_seqs=8), _greedy(8), long)
    assert _ids(llm, _greedy(8), long) == ref
    llm.close()
    assert procs[0].poll() == 0 and _worker_pids() == []
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPTS, _greedy(), use_tqdm=False)
    # rank 0's KV cache budget is too small: raised after the workers loaded their shard,
    # which are told to leave
    with pytest.raises(ValueError, match="KV cache budget"):
        LLM(model=str(tiny_llama), tensor_parallel_size=2, kv_cache_memory=1 << 16,
            max_model_len=512)
    assert _worker_pids() == []


def _count_calls(monkeypatch, owner, name: str) -> list[int]:
    """Count the calls of ``owner.name`` (the list grows by one per call)."""
    seen, real = [], getattr(owner, name)

    def counted(*a, **k):
        seen.append(1)
        return real(*a, **k)

    monkeypatch.setattr(owner, name, counted)
    return seen


@pytest.mark.slow
def test_create_close_create_again_one_broadcast_per_step(tiny_llama, plain_ref, monkeypatch):
    import speculant.engine.tp_runner as tp_runner

    for _ in range(2):
        with LLM(model=str(tiny_llama), max_num_seqs=8, tensor_parallel_size=2) as llm:
            sent = _count_calls(monkeypatch, tp_runner.dist, "broadcast")
            calls = _count_calls(monkeypatch, llm.engine.runner.local, "forward")
            assert _ids(llm, _greedy()) == plain_ref
            assert len(calls) >= 16 and len(sent) == len(calls)  # one broadcast per step
            monkeypatch.undo()
        assert _worker_pids() == []


@pytest.mark.slow
def test_workers_exit_when_the_parent_is_killed(tiny_llama, tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        from speculant import LLM
        llm = LLM(model={str(tiny_llama)!r}, tensor_parallel_size=2, max_model_len=64)
        print(" ".join(str(p.pid) for p in llm.engine.tp_group.procs), flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "SPECULANT_DEVICE": "cpu"})
    try:
        line = proc.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 1, line
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and Path(f"/proc/{pids[0]}/cmdline").exists():
            time.sleep(0.2)
        status = Path(f"/proc/{pids[0]}/status")
        gone = not status.exists() or "zombie" in status.read_text()
        assert gone, "the worker outlived its parent"
    finally:
        proc.kill()


# -------------------------------------------------------------------------------- strategies
@pytest.fixture(scope="module")
def strategy_runs(tiny_llama, tiny_factory, tmp_path_factory, plain_ref) -> dict:
    """name -> (target, speculative_config, max_tokens per prompt)."""
    d = tmp_path_factory.mktemp("tp_heads")
    draft = tiny_factory("llama", seed=1, num_hidden_layers=1)
    deep = tiny_factory("llama", num_hidden_layers=4)  # EAGLE-3 reads 3 distinct layers
    refs = [{"prompt_token_ids": p, "output_token_ids": t} for p, t in zip(PROMPTS, plain_ref)]
    k = {"num_speculative_tokens": 3}
    return {
        "ngram": (tiny_llama, {"method": "ngram", "prompt_lookup_max": 3, **k}, 16),
        "draft_model": (tiny_llama, {"method": "draft_model", "model": str(draft), **k}, 16),
        "eagle": (tiny_llama, {"model": str(make_eagle1(d / "e1", tiny_llama, BIG_V,
                                                        "safetensors", copy=True)), **k}, 16),
        "eagle3": (deep, {"model": str(make_eagle3(d / "e3", BIG_V, 40, target=deep)),
                          "aux_hidden_layers": [0, 1, 3], **k}, 16),
        "mlp_speculator": (tiny_llama, {"model": str(make_mlp(d / "mlp")), **k}, 16),
        "oracle": (tiny_llama, {"method": "oracle", "alpha": 0.7, "references": refs, **k}, 16),
        # 4 sequences: off above 3; on once the two short ones finished
        "batch_size_disable": (tiny_llama, {"method": "ngram", "disable_by_batch_size": 3, **k},
                               [16, 16, 4, 4]),
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ngram", "draft_model", "eagle", "eagle3", "mlp_speculator",
                                  "oracle", "batch_size_disable"])
def test_every_strategy_at_tp2_equals_plain(strategy_runs, name):
    target, spec, lens = strategy_runs[name]
    lens = lens if isinstance(lens, list) else [lens] * len(PROMPTS)
    params = [_greedy(n) for n in lens]
    ref = _ids(LLM(model=str(target), max_num_seqs=8), params)
    with LLM(model=str(target), max_num_seqs=8, tensor_parallel_size=2,
             speculative_config=spec) as llm:
        assert llm.engine.spec.name == ("ngram" if name == "batch_size_disable" else name)
        assert _ids(llm, params) == ref
        m = llm.get_metrics()
        assert m.num_draft_tokens > 0, name  # it did speculate
        if name == "batch_size_disable":
            assert m.num_times_disabled >= 1 and m.num_plain_steps > 0
    assert _worker_pids() == []


@pytest.mark.slow
def test_seeded_sampling_is_reproducible_and_matches_tp1(tiny_llama):
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=s, max_tokens=16, ignore_eos=True)
              for s in range(len(PROMPTS))]
    spec = {"method": "ngram", "num_speculative_tokens": 3}

    def run(tp: int, **kw) -> list[list[int]]:
        with LLM(model=str(tiny_llama), max_num_seqs=8, tensor_parallel_size=tp, **kw) as llm:
            return [o.outputs[0].token_ids
                    for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    one = run(1)
    assert run(2) == one
    assert run(2) == one
    assert run(2, speculative_config=spec) == one


@pytest.mark.slow
def test_default_model_tp3_equals_tp1(default_model_path):
    """SmolLM2-135M: 9 query and 3 KV heads, so 3 ranks of 3 and 1."""
    prompts = [[1, 504, 3458, 282], [28, 1029, 25, 5, 9, 12]]
    ref = _ids(LLM(model=str(default_model_path), max_num_seqs=4), _greedy(12), prompts)
    with LLM(model=str(default_model_path), max_num_seqs=4, tensor_parallel_size=3) as llm:
        assert _ids(llm, _greedy(12), prompts) == ref


@pytest.mark.slow
def test_under_torchrun(tiny_llama, plain_ref, tmp_path):
    """torchrun starts both ranks; rank 1 serves rank 0 inside LLM(...) and exits there."""
    script = tmp_path / "tp.py"
    script.write_text(textwrap.dedent(f"""
        import json
        from speculant import LLM, SamplingParams
        llm = LLM(model={str(tiny_llama)!r}, max_num_seqs=8, tensor_parallel_size=2)
        outs = llm.generate({PROMPTS!r}, SamplingParams(temperature=0, max_tokens=16,
                            ignore_eos=True), use_tqdm=False)
        print("TOKENS", json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
        llm.close()
    """))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(_free_port()), str(script)],
        cwd=ROOT, env={**os.environ, "SPECULANT_DEVICE": "cpu"}, capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if "TOKENS" in ln]
    assert len(lines) == 1, proc.stdout  # rank 1 never got past LLM(...)
    import json

    assert json.loads(lines[0].split("TOKENS", 1)[1]) == plain_ref


@pytest.mark.slow
def test_a_worker_killed_mid_run_is_a_clear_error(tiny_llama):
    llm = LLM(model=str(tiny_llama), tensor_parallel_size=2, max_model_len=64)
    p = llm.engine.tp_group.procs[0]
    p.kill()
    p.wait()
    for _ in range(2):  # and again: the LLM stays failed, it does not hang
        with pytest.raises(RuntimeError, match=r"a worker cannot be reached \(rank 1: exited with "
                           r"code -9\).*close it and create a new one"):
            llm.generate([[1, 2, 3]], _greedy(4), use_tqdm=False)
    llm.close()
    assert _worker_pids() == []


def test_start_up_status_of_the_workers():
    """Rank 0's view of its workers while they start: an error they report is returned by rank,
    a worker that exits is raised naming its exit code, one that never reports times out."""
    from speculant.distributed.parallel import NO_TENSOR_PARALLEL
    from speculant.distributed.worker import TPGroup

    def group(code: str) -> TPGroup:
        r, w = os.pipe()
        p = subprocess.Popen([sys.executable, "-c", code, str(w)], pass_fds=(w,))
        os.close(w)
        return TPGroup(NO_TENSOR_PARALLEL, torch.device("cpu"), [p], [os.fdopen(r)])

    say = "import os, sys; os.write(int(sys.argv[1]), b'{}\\n'); "
    g = group(say.format('{"error": "OutOfMemoryError: boom"}'))
    assert g._read_status("loaded", 30) == {1: "OutOfMemoryError: boom"}
    g.close()
    g = group(say.format('{"state": "joining"}') + "sys.exit(3)")
    assert g._read_status("joining", 30) == {}
    with pytest.raises(RuntimeError, match="rank 1 exited with code 3 while starting"):
        g._read_status("loaded", 30)
    g.close()
    g = group("import time; time.sleep(30)")
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] did not start in 1 s \(rank 1: "
                       "running\\)"):
        g._read_status("joining", 1)
    g.procs[0].kill()
    g.close()


def _children(pid: int, name: bytes) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat, cmd = (d / "stat").read_text(), (d / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and name in cmd:
                out.append(int(d.name))
    return out


@pytest.mark.slow
def test_serve_with_tensor_parallel_size_2(tiny_llama, tmp_path):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    pytest.importorskip("prometheus_client")
    port = _free_port()
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "speculant.cli", "serve", "--model", str(tiny_llama),
           "--host", "127.0.0.1", "--port", str(port), "--tensor-parallel-size", "2",
           "--max-model-len", "128"]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "SPECULANT_DEVICE": "cpu"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        workers = _children(proc.pid, b"speculant.distributed.worker")
        assert len(workers) == 1
        got = httpx.post(base + "/v1/completions", timeout=120, json={
            "model": str(tiny_llama), "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}).json()
        ref = _ids(LLM(model=str(tiny_llama), max_model_len=128), _greedy(8), PROMPTS[:1])[0]
        text = LLM(model=str(tiny_llama), max_model_len=128).get_tokenizer().decode(ref)
        assert got["choices"][0]["text"] == text
        metrics = httpx.get(base + "/metrics", timeout=10).text
        assert any(ln.startswith("speculant_tensor_parallel_size{") and ln.endswith(" 2.0")
                   for ln in metrics.splitlines()), metrics
        assert "tensor_parallel_size=2" in log.read_text()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    time.sleep(1)
    assert all(not Path(f"/proc/{w}/cmdline").exists() or
               not Path(f"/proc/{w}/cmdline").read_bytes() for w in workers)
