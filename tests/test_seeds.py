"""Every example of the documents our users start from (shared/seeds/, copied verbatim into
tests/seed_examples/) runs on speculant: offline, from the command line and against the server.

The hub ids the examples name (facebook/opt-6.7b, yuhuili/EAGLE-LLaMA3-Instruct-8B, ...) are
served from a local Hugging Face cache made here (HF_HUB_CACHE, HF_HUB_OFFLINE=1) holding tiny
random checkpoints of the right kind in their published layouts, so those names stay as written.
What the test changes: the `vllm` import (and `python -m vllm.` module) to speculant, local
model paths (/mnt/data/..., /path/to/...) to tiny checkpoints, and the server's port (a free one
on loopback). Examples with tensor_parallel_size=4 run as written (4 ranks on the CPU).
Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from checkpoints import H, make_eagle1, make_mlp, make_tiny_checkpoint

from speculant import LLM, SamplingParams

EXAMPLES = Path(__file__).parent / "seed_examples"
LLAMA_TARGETS = (
    "meta-llama/Llama-2-13b-chat-hf",
    "meta-llama/Meta-Llama-3.1-70B-Instruct",
    "meta-llama/Meta-Llama-3-8B-Instruct",
)
MLP_HEADS = (
    "ibm-fms/llama-13b-accelerator",
    "ibm-ai-platform/llama3-70b-accelerator",
    "ibm-fms/llama3-70b-accelerator",
)


def _cache_entry(cache: Path, repo_id: str, folder: Path) -> None:
    """``repo_id`` in the layout huggingface_hub reads offline (refs/main -> a snapshot)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    commit = "0" * 40
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots").mkdir(exist_ok=True)
    (repo / "snapshots" / commit).symlink_to(folder.resolve(), target_is_directory=True)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("seeds")
    llama = make_tiny_checkpoint(root / "llama", "llama", seed=0)
    llama_draft = make_tiny_checkpoint(root / "llama_draft", "llama", seed=1)
    opt = make_tiny_checkpoint(root / "opt", "opt", seed=0)
    opt_draft = make_tiny_checkpoint(root / "opt_draft", "opt", seed=1)
    mlp = make_mlp(root / "mlp", emb_dim=H, n_predict=3)
    eagle = make_eagle1(root / "eagle", llama, vocab=49152)
    cache = root / "hub"
    for repo in LLAMA_TARGETS:
        _cache_entry(cache, repo, llama)
    for repo in MLP_HEADS:
        _cache_entry(cache, repo, mlp)
    _cache_entry(cache, "facebook/opt-6.7b", opt)
    _cache_entry(cache, "facebook/opt-125m", opt_draft)
    _cache_entry(cache, "yuhuili/EAGLE-LLaMA3-Instruct-8B", eagle)
    env = dict(
        os.environ,
        HF_HUB_CACHE=str(cache),
        HF_HUB_OFFLINE="1",
        SPECULANT_DEVICE="cpu",
        PYTHONWARNINGS="default",
        OMP_NUM_THREADS="1",
    )
    paths = {
        "/mnt/data/NewLLM/THUDM/chatglm3-6b-32k": str(llama),
        "/path/to/base_model": str(llama),
        "/path/to/spec_model": str(llama_draft),
    }
    return {"env": env, "paths": paths, "root": root}


def _adapt(text: str, world, port: int | None = None) -> str:
    """The only edits: the vllm import / module, local model paths, the server's address."""
    text = re.sub(r"^from vllm import", "from speculant import", text, flags=re.M | re.I)
    text = text.replace("python -m vllm.entrypoints", f"{sys.executable} -m speculant.entrypoints")
    for old, new in world["paths"].items():
        text = text.replace(old, new)
    if port is not None:
        text = re.sub(r"(localhost|0\.0\.0\.0):(8000|9999)", f"127.0.0.1:{port}", text)
        text = re.sub(r"--port[ =](8000|9999)", f"--port {port}", text)
        text = text.replace("--host 0.0.0.0", "--host 127.0.0.1")
    return text


def _run_python(code: str, world, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        env=world["env"],
        cwd=world["root"],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    return proc.stdout


# ------------------------------------------------------------------ offline examples
# one process per example: the default run keeps one offline example (legacy_ngram.py); what the
# slow ones exercise runs in-process in the default run too: the walkthrough's fields
# (test_walkthrough_field_works, test_best_of_...: the walkthrough script alone took 100-150 s on
# a busy 2-core machine), draft models (test_draft_model.py), tensor parallelism
# (test_tp_trees.py's TP 2 run), the OpenAI server (test_server.py, started from the command line)
SLOW = pytest.mark.slow
OFFLINE = [
    pytest.param("spec_decode_draft_model.py", marks=SLOW),
    pytest.param("spec_decode_ngram.py", marks=SLOW),
    pytest.param("legacy_draft_model.py", marks=SLOW),
    "legacy_ngram.py",
    pytest.param("mlpspeculator_timing.py", marks=SLOW),
    pytest.param("sampling_walkthrough.py", marks=SLOW),
]


@pytest.mark.parametrize("name", OFFLINE)
def test_offline_example_runs_as_written(world, name):
    out = _ok(_run_python(_adapt((EXAMPLES / name).read_text(), world), world))
    if name == "mlpspeculator_timing.py":
        assert "Without speculation" in out and "With speculation" in out
        assert out.count("text: ") == 2
    elif name == "sampling_walkthrough.py":
        assert out.count("Generated text: ") == 3
    else:
        assert re.search(r"(Prompt|提示): '.*', (Generated text|生成的文本): '", out), out


TP4 = [  # 4 worker processes each: all slow (the default run: test_tp_trees.py's TP 2 run)
    pytest.param("spec_decode_mlp_speculator.py", marks=SLOW),
    pytest.param("spec_decode_eagle.py", marks=SLOW),
    pytest.param("legacy_mlp_speculator.py", marks=SLOW),
]


@pytest.mark.parametrize("name", TP4)
def test_tp4_examples_run_as_written(world, name):
    """4 ranks (processes over gloo on the CPU; the drafter unsharded on rank 0)."""
    code = _adapt((EXAMPLES / name).read_text(), world)
    assert "tensor_parallel_size=4" in code
    out = _ok(_run_python(code, world))
    assert re.search(r"(Prompt|提示): '.*', (Generated text|生成的文本): '", out), out


# slow (a subprocess, ~13 s busy): the default run infers methods from checkpoint paths
# (test_distribution.py) and checks an uncached hub id offline (test_bad_input.py)
@pytest.mark.slow
def test_hub_ids_infer_their_method_from_the_local_cache(world):
    """A bare hub id in speculative_config: the method comes from the cached checkpoint."""
    code = (
        "from speculant.spec_registry import SpeculativeConfig\n"
        "for m in ['yuhuili/EAGLE-LLaMA3-Instruct-8B', 'ibm-ai-platform/llama3-70b-accelerator',"
        " 'facebook/opt-125m']:\n"
        "    print(m, SpeculativeConfig(model=m).method)\n"
        "try:\n"
        "    SpeculativeConfig(model='yuhuili/EAGLE-Vicuna-7B-v1.3')\n"
        "except Exception as e:\n"
        "    print('ERROR', e)\n"
    )
    out = _ok(_run_python(code, world))
    assert "yuhuili/EAGLE-LLaMA3-Instruct-8B eagle\n" in out
    assert "ibm-ai-platform/llama3-70b-accelerator mlp_speculator\n" in out
    assert "facebook/opt-125m draft_model\n" in out
    err = out.split("ERROR", 1)[1]
    assert "cannot infer the speculative method of 'yuhuili/EAGLE-Vicuna-7B-v1.3'" in err
    assert "not in the local Hugging Face cache" in err and "Set `method` explicitly" in err


# ------------------------------------------------------------------ server examples
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc: subprocess.Popen, port: int, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}: {proc.stderr.read()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError("server did not become healthy")


class _Server:
    def __init__(self, script: str, world) -> None:
        self.port = _free_port()
        cmd = _adapt(script, world, self.port)
        cmd = re.sub(r"\\ +#[^\n]*", "\\\\", cmd)  # the Ascend page's comments after backslashes
        self.proc = subprocess.Popen(
            ["bash", "-c", cmd],
            env=world["env"],
            cwd=world["root"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        _wait_healthy(self.proc, self.port)

    def stop(self) -> str:
        os.killpg(self.proc.pid, 15)
        try:
            _, err = self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            _, err = self.proc.communicate()
        return err


def _client(name: str, world, port: int) -> str:
    return _ok(_run_python(_adapt((EXAMPLES / name).read_text(), world, port), world, 120))


@pytest.mark.slow  # ~15 s busy per launcher (see SLOW above)
@pytest.mark.parametrize("launcher", ["python -m", "speculant serve"])
def test_server_example_and_its_client(world, launcher):
    script = (EXAMPLES / "spec_decode_server.sh").read_text()
    if launcher == "speculant serve":
        script = script.replace(
            "python -m vllm.entrypoints.openai.api_server",
            f"{Path(sys.executable).parent / 'speculant'} serve",
        )
    server = _Server(script, world)
    try:
        out = _client("spec_decode_client.py", world, server.port)
        assert out.startswith("补全结果:") and "Completion(" in out and "text=" in out
    finally:
        server.stop()


@SLOW
def test_legacy_server_flags_and_client(world):
    server = _Server((EXAMPLES / "legacy_server.sh").read_text(), world)
    try:
        out = _client("legacy_client.py", world, server.port)
        assert out.startswith("Completion results:") and "Completion(" in out
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert re.search(r"spec_decode_num_draft_tokens_total\S* [1-9]", metrics), metrics[:2000]
    finally:
        server.stop()


@SLOW
def test_ascend_server_and_curl(world):
    server = _Server((EXAMPLES / "ascend_server.sh").read_text(), world)
    try:
        curl = _adapt((EXAMPLES / "ascend_curl.sh").read_text(), world, server.port)
        curl = re.sub(r"\\ {2,}", "\\\n", curl)  # the page lost these line breaks
        proc = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        body = json.loads(proc.stdout)
        assert body["model"] == "test_server_demo"
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert body["usage"]["completion_tokens"] > 0
    finally:
        err = server.stop()
    assert "trust_remote_code=True has no effect" in err


# ------------------------------------------------------------------ SamplingParams walkthrough
@pytest.fixture(scope="module")
def llm(world):
    return LLM(model=world["paths"]["/path/to/base_model"], device="cpu")


# (field, value): each field the walkthrough lists either works (checked) or gets a clear error
WORKS = {
    "n": 3,
    "best_of": 4,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "repetition_penalty": 1.2,
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 3,
    "min_p": 0.1,
    "stop": ["e"],
    "stop_token_ids": [2],
    "ignore_eos": True,
    "max_tokens": 7,
    "logprobs": 2,
    "prompt_logprobs": 1,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "logits_processors": [lambda ids, logits: logits],
}
REFUSED = {"use_beam_search": True, "length_penalty": 0.8, "early_stopping": True}


@pytest.mark.parametrize("field", sorted(WORKS))
def test_walkthrough_field_works(llm, field):
    value = WORKS[field]
    kw = {"max_tokens": 6, "seed": 1, field: value}
    if field in ("best_of", "top_k", "min_p", "top_p", "n"):
        kw.setdefault("temperature", 0.8)
    out = llm.generate(["hello there"], SamplingParams(**kw), use_tqdm=False)[0]
    comp = out.outputs
    assert len(comp) == (value if field == "n" else 1)
    if field == "max_tokens":
        assert len(comp[0].token_ids) == 7
    if field == "logprobs":
        assert all(2 <= len(d) <= 3 for d in comp[0].logprobs)
    if field == "prompt_logprobs":
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(
            out.prompt_token_ids
        )


def test_best_of_returns_the_most_likely_samples(llm):
    p = SamplingParams(n=2, best_of=5, temperature=1.0, seed=3, max_tokens=5)
    best = llm.generate(["hello"], p, use_tqdm=False)[0].outputs
    every = llm.generate(["hello"], p.clone(n=5, best_of=None), use_tqdm=False)[0].outputs
    ranked = sorted(every, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked]
    assert [c.index for c in best] == [0, 1]
    with pytest.raises(ValueError, match=r"best_of \(1\) must be >= n \(2\)"):
        SamplingParams(n=2, best_of=1)


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_walkthrough_beam_search_fields_are_refused_clearly(field):
    with pytest.raises(ValueError, match=f"{field}: beam search is not supported"):
        SamplingParams(**{field: REFUSED[field]})
    SamplingParams(use_beam_search=False, length_penalty=1.0, early_stopping=False)
