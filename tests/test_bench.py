"""`speculant bench` smoke test on CPU (tiny model): JSON + PNG written, figures consistent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from speculant.bench import parse_strategies, step_stats, theoretical_speedup
from speculant.cli import main


def test_theoretical_speedup_formula():
    assert theoretical_speedup(0.8, 5, 0.0) == pytest.approx((1 - 0.8**6) / 0.2)
    assert theoretical_speedup(0.0, 4, 0.1) == pytest.approx(1 / 1.4)
    assert theoretical_speedup(1.0, 3, 0.05) == pytest.approx(4 / 1.15)


def test_step_stats_counts_stalls():
    st = step_stats([0.01, 0.011, 0.009, 0.3, 0.01, 0.05, 0.012])
    assert st["median_step_s"] == 0.011 and st["max_step_s"] == 0.3
    assert st["slow_steps"] == 1 and st["slow_steps_s"] == 0.3  # 0.05 < 5 x 0.011 = 0.055
    # trimmed: steps over 1.5 x the median (0.0165) left out: 0.3 and 0.05
    assert st["trimmed_steps"] == 2
    assert st["step_s_trimmed"] == pytest.approx((0.01 + 0.011 + 0.009 + 0.01 + 0.012) / 5)
    assert step_stats([])["slow_steps"] == 0 and step_stats([])["step_s_trimmed"] is None


def test_parse_strategies():
    assert parse_strategies("oracle:0.8:5,ngram:3") == [
        {"method": "oracle", "alpha": 0.8, "num_speculative_tokens": 5},
        {"method": "ngram", "num_speculative_tokens": 3}]
    assert parse_strategies('[{"method": "ngram", "num_speculative_tokens": 2}]')[0]["method"] == "ngram"


@pytest.mark.slow  # ~3 s: the default run keeps the bench tests around it
def test_bench_cli_writes_json_and_png(tiny_factory, tmp_path, capsys):
    model = tiny_factory("llama", tokenizer=False)
    rc = main(["bench", "--model", str(model), "--batch-sizes", "1,2", "--max-tokens", "20",
               "--prompt-len", "6", "--strategies", "oracle:1.0:3,oracle:0.0:2",
               "--out", str(tmp_path), "--stem", "smoke"])
    assert rc == 0
    assert "tokens_per_s" in capsys.readouterr().out
    result = json.loads((tmp_path / "smoke.json").read_text())
    assert (tmp_path / "smoke.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = {(r["name"], r["batch_size"]): r for r in result["runs"]}
    assert len(runs) == 6
    for r in runs.values():
        assert r["same_tokens_as_plain"], r["name"]
        assert r["tokens_per_s"] > 0 and r["s_per_token"] > 0 and r["decode_tokens"] == 19 * r["batch_size"]
    assert runs[("plain", 1)]["speedup"] == 1.0
    for r in runs.values():  # stall accounting of the timed window
        assert 0 < r["median_step_s"] <= r["max_step_s"] and r["slow_steps"] >= 0
        assert r["max_step_s"] <= r["decode_s"]
    sure = runs[("oracle a=1.0 k=3", 1)]
    assert sure["max_propose_s"] >= sure["propose_s_per_step"] > 0
    assert sure["acceptance"] == 1.0
    assert sure["draws"] == "stratified" and "draws" not in runs[("plain", 1)]
    # every target step emits k + 1 tokens except possibly the last (19 tokens after prefill)
    assert sure["steps"] == 5 and sure["tokens_per_step"] == pytest.approx(19 / 5)
    assert sure["mean_accepted_length"] == 4.0  # vLLM: the 3 drafts max_tokens cut count too
    assert 0 <= sure["c"] < 1 and 0 <= sure["c_all"] < 1 and sure["first_propose_s"] > 0
    # one first call out of 5: the mean over all calls weighs it 1/5
    assert sure["propose_s_per_step_all"] == pytest.approx(
        (sure["first_propose_s"] + 4 * sure["propose_s_per_step"]) / 5)
    assert sure["theoretical_speedup"] == pytest.approx(theoretical_speedup(1.0, 3, sure["c"]))
    never = runs[("oracle a=0.0 k=2", 2)]
    assert never["acceptance"] == 0.0 and never["mean_accepted_length"] == 1.0
    assert never["theoretical_speedup"] < 1.0
    for r in runs.values():  # one timed run per cell by default
        assert r["step_s_runs"] == [pytest.approx(r["step_s"])]
        assert r["tokens_per_s_trimmed"] == pytest.approx(
            r["decode_tokens"] / (r["steps"] * r["step_s_trimmed"]))
    assert sure["speedup_vs_theoretical_trimmed"] == pytest.approx(
        sure["speedup_trimmed"] / sure["theoretical_speedup"])
    assert runs[("plain", 2)]["speedup_trimmed"] == 1.0


@pytest.mark.slow
def test_bench_repeats_report_the_median_run(tiny_factory, tmp_path, monkeypatch):
    """--repeats 3: three timed runs (and three cost passes) per cell; the row is the run of
    median step time, with every run's step time listed and its own acceptance."""
    import speculant.bench as bench

    model = tiny_factory("llama", tokenizer=False)
    runs_seen = []
    real = bench._decode_run

    def counting(engine, prompts, max_tokens):
        r = real(engine, prompts, max_tokens)
        runs_seen.append(max_tokens)
        return r

    monkeypatch.setattr(bench, "_decode_run", counting)
    rc = main(["bench", "--model", str(model), "--batch-sizes", "1", "--max-tokens", "12",
               "--prompt-len", "5", "--strategies", "oracle:1.0:2", "--repeats", "3",
               "--out", str(tmp_path), "--stem", "rep"])
    assert rc == 0
    rows = json.loads((tmp_path / "rep.json").read_text())["runs"]
    assert [r["name"] for r in rows] == ["plain", "oracle a=1.0 k=2"]
    for r in rows:
        assert len(r["step_s_runs"]) == 3 and r["same_tokens_as_plain"]
        assert r["step_s"] == pytest.approx(sorted(r["step_s_runs"])[1])
    assert rows[1]["acceptance"] == 1.0 and rows[1]["steps"] == 4  # 11 tokens, 3 per step
    # the recording (12 + k tokens), per cell a warm-up (8) and 3 timed runs (12), and the
    # oracle 3 cost passes (12)
    assert runs_seen.count(12) == 9 and runs_seen.count(8) == 2 and runs_seen.count(14) == 1
    assert len(runs_seen) == 12
    with pytest.raises(SystemExit, match="--repeats must be >= 1"):
        main(["bench", "--model", str(model), "--repeats", "0", "--out", str(tmp_path)])


@pytest.mark.slow
def test_bench_builds_a_strategy_once_across_batch_sizes(tiny_factory, monkeypatch):
    """A non-oracle strategy is built once and reset between batch sizes (the oracle, whose
    references differ per batch size, once per batch size); rows come back ordered by batch
    size, then plain and the strategies as given, each with its set-up and cell wall time."""
    import speculant.bench as bench
    from speculant import LLM
    from speculant.engine.spec_decode import SpecDecoder

    llm = LLM(model=str(tiny_factory("llama", tokenizer=False)), skip_tokenizer_init=True,
              max_num_seqs=4)
    built, resets, seen = [], [], []
    real_set, real_reset = bench._set_strategy, SpecDecoder.reset

    def counting_set(engine, cfg):
        if cfg is not None:
            built.append(cfg["method"])
        return real_set(engine, cfg)

    def counting_reset(self):
        resets.append(self.name)
        real_reset(self)

    monkeypatch.setattr(bench, "_set_strategy", counting_set)
    monkeypatch.setattr(SpecDecoder, "reset", counting_reset)
    prompts = bench.random_prompts(2, 6, llm.engine.vocab_size)
    strategies = [{"method": "ngram", "num_speculative_tokens": 2, "auto_disable": True},
                  {"method": "oracle", "alpha": 1.0, "num_speculative_tokens": 2}]
    result = bench.run_bench(llm.engine, prompts, strategies, 10, [1, 2], warmup_tokens=4,
                             progress=lambda row: seen.append((row["name"], row["batch_size"])))
    assert built == ["ngram", "oracle", "oracle"] and resets == ["ngram"]
    names = [(r["name"], r["batch_size"]) for r in result["runs"]]
    assert names == [("plain", 1), ("ngram k=2", 1), ("oracle a=1.0 k=2", 1),
                     ("plain", 2), ("ngram k=2", 2), ("oracle a=1.0 k=2", 2)]
    assert sorted(seen) == sorted(names)
    for r in result["runs"]:
        assert r["same_tokens_as_plain"] and r["cell_s"] >= r["setup_s"] >= 0.0
        assert r["speedup"] == (1.0 if r["name"] == "plain" else pytest.approx(
            r["tokens_per_s"] / result["runs"][0 if r["batch_size"] == 1 else 3]["tokens_per_s"]))
    assert result["runs"][0]["setup_s"] == 0.0
    oracle2 = result["runs"][5]
    assert oracle2["acceptance"] == 1.0  # its references are those recorded at batch size 2


def test_spec_decoder_reset(tiny_factory):
    """reset() forgets metrics, the auto-disable statistics and the batch-size vote; with a
    request in flight it refuses."""
    from speculant import LLM, SamplingParams

    llm = LLM(model=str(tiny_factory("llama", tokenizer=False)), skip_tokenizer_init=True,
              max_num_seqs=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                  "auto_disable": True})
    llm.generate([[1, 5, 5, 5, 5]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    dec = llm.engine.spec
    assert dec.total.num_emitted_tokens > 0 and dec.last_batch_size == 1
    control = dec.control
    dec.enabled = False
    dec.reset()
    assert dec.total.num_emitted_tokens == 0 and dec.last_batch_size == 0 and dec.enabled
    assert dec.control is not None and dec.control is not control
    llm.engine.add_request("r", None, [1, 5, 5, 5], SamplingParams(max_tokens=4))
    llm.engine.step()  # prefill: the decoder now tracks it
    llm.engine.step()
    with pytest.raises(RuntimeError, match="requests in flight"):
        dec.reset()


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="a Triton-interpreter run for CPU machines; on a GPU run "
    "bench/bench_kernels.py itself"
)
@pytest.mark.slow  # a benchmark script's smoke run: a minute and more on the interpreter
def test_bench_kernels_steady_sweep_smoke(tmp_path):
    """bench/bench_kernels.py's steady-state sweep on the Triton interpreter (tiny shapes): each
    override set gives the default launch's attention, with sequential block tables."""
    script = Path(__file__).resolve().parents[1] / "bench" / "bench_kernels.py"
    out = tmp_path / "k.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, str(script), "--smoke", "--steady-sweep", "splits",
           "--graph-copies", "1", "--block-order", "sequential", "--out", str(out)]
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    assert result["block_order"] == "sequential"
    rows = result["attention_steady_sweep"]
    assert len(rows) == 6 and not any("error" in r for r in rows)  # 3 override sets x 2 cases
    assert {r.get("num_splits") for r in rows} == {None, 16, 24}
    assert all(r["ms_graphN"] > 0 and r["rel_diff_vs_first"] < 1e-2 for r in rows)


@pytest.mark.slow  # a benchmark script's checks: three interpreters
def test_run_variance_checks_gc_modes_and_exits_without_cuda(tmp_path):
    """bench/run_variance.py: a bad --gc-modes or --head-modes is refused before anything
    loads; without CUDA it says so and exits 0."""
    script = Path(__file__).resolve().parents[1] / "bench" / "run_variance.py"
    bad = subprocess.run([sys.executable, str(script), "--gc-modes", "default,sometimes",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--gc-modes" in bad.stderr and "sometimes" in bad.stderr
    bad = subprocess.run([sys.executable, str(script), "--head-modes", "on,maybe",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--head-modes" in bad.stderr and "maybe" in bad.stderr
    if not torch.cuda.is_available():
        r = subprocess.run([sys.executable, str(script), "--gc-modes", "default,freeze,off",
                            "--head-modes", "on,off", "--out", str(tmp_path)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and "no CUDA device" in r.stdout


def test_step_timer_keeps_first_proposes_apart():
    """A call carrying a sequence's first propose (a draft's prompt prefill) is counted apart from
    the steady-state calls; a new sequence joining a running batch makes its call a first one."""
    from types import SimpleNamespace

    from speculant.bench import _StepTimer

    timer = _StepTimer(torch.device("cpu"))

    def call(ids, secs):
        gen = timer.propose(SimpleNamespace(seqs=[SimpleNamespace(seq_id=i) for i in ids]))
        next(gen)
        time.sleep(secs)
        with pytest.raises(StopIteration):
            gen.send("proposal")

    call([1, 2], 0.05)  # first
    call([1, 2], 0.0)
    call([2, 3], 0.05)  # 3 is new
    call([2, 3], 0.0)
    call([3], 0.0)
    assert timer.propose_calls == 5 and timer.first_calls == 2
    assert timer.first_s >= 0.1 and timer.propose_s - timer.first_s < 0.05


_DECODE_LIMITS_CHECK = r"""
import math, sys, torch
sys.path.insert(0, sys.argv[1])
from decode_limits import _balanced_read, _flat_read, _paged_read
torch.manual_seed(0)
b, ctx, hkv, d, bs = 2, 200, 2, 16, 16
per = math.ceil(ctx / bs)
kc = torch.randn(b * per + 3, bs, hkv, d) + 0.5  # never zero; 3 blocks no sequence owns
vc = torch.randn_like(kc) + 0.5
bt = torch.randperm(b * per + 3)[: b * per].to(torch.int32).view(b, per)
idx = bt.long()
want = (kc[idx].reshape(b, -1, hkv, d)[:, :ctx] + vc[idx].reshape(b, -1, hkv, d)[:, :ctx])
want = want.sum(dim=(1, 3))  # [b, hkv]: exactly the sequences' K and V elements
strides = (kc.stride(0), kc.stride(1), kc.stride(2), bt.stride(0))
for bn, cpp in ((16, 1), (32, 2), (64, 3)):
    parts = math.ceil(math.ceil(ctx / bn) / cpp)
    o = torch.empty(b, hkv, parts)
    _paged_read[(b, hkv, parts)](kc, vc, bt, o, ctx, cpp, *strides, BLOCK_N=bn, HEAD_DIM=d,
                                 BLOCK_SIZE=bs)
    assert torch.allclose(o.sum(-1), want, rtol=1e-5, atol=1e-3), (bn, cpp)
for bn, progs in ((16, 7), (32, 3), (64, 5)):
    n_ch = math.ceil(ctx / bn)
    o = torch.empty(progs)
    _balanced_read[(progs,)](kc, vc, bt, o, ctx, n_ch, b * hkv * n_ch, *strides,
                             NUM_KV_HEADS=hkv, BLOCK_N=bn, HEAD_DIM=d, BLOCK_SIZE=bs)
    assert torch.allclose(o.sum(), want.sum(), rtol=1e-5, atol=1e-2), (bn, progs)
x = torch.randn(5000).to(torch.bfloat16)
o = torch.empty(3)
_flat_read[(3,)](x, o, 5000, BLOCK=512, ITERS=4)
assert torch.allclose(o.sum(), x.float().sum(), atol=1e-2)
print("reads ok")
"""


@pytest.mark.slow  # a benchmark script's checks: five interpreters
def test_decode_limits_reads_cover_exactly_the_paged_bytes():
    """bench/decode_limits.py's bare reads (the ceilings issue 5's goals are measured against)
    sum exactly the K/V elements of each sequence through its block table, whatever the grid:
    per (sequence, KV head) for the split grid, in total for the persistent balanced grid; on the
    Triton interpreter. Malformed --cases / --splits are refused by name; without CUDA the
    script says so and exits 0."""
    bench = Path(__file__).resolve().parents[1] / "bench"
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", _DECODE_LIMITS_CHECK, str(bench)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "reads ok" in r.stdout, r.stderr[-2000:]
    for bad in (["--cases", "8"], ["--cases", "1:x"], ["--splits", "0"]):
        r = subprocess.run([sys.executable, str(bench / "decode_limits.py"), *bad],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and "--cases wants" in r.stderr, bad
    if not torch.cuda.is_available():
        r = subprocess.run([sys.executable, str(bench / "decode_limits.py")],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and "needs a CUDA device" in r.stdout
