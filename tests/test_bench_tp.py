"""bench/gpu_tp.py (the tensor-parallel GPU benchmark) on the CPU: its figures (weight bytes per
GPU, rooflines, the TP N / TP 1 summary, greedy comparison), the JSON + figure writing and
--replot on a small made-up result, its argument checks, and (slow) the whole run at TP 2 on a
tiny model over gloo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import gpu_tp  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def test_weight_bytes_match_the_8b_measurement_and_shard():
    # TP 1: every parameter but the input embedding, as gpu_8b measured on the H100
    # (weight_bytes_per_step of the Llama-3-8B geometry: bench/results/gpu_8b_h100.json)
    one = gpu_tp.weight_bytes_per_gpu(gpu_tp.LLAMA3_8B, 1)
    assert one["rank0"] == 15_009_849_344
    head = 128256 * 4096 * 2
    assert one["worker"] == one["rank0"] - head
    two = gpu_tp.weight_bytes_per_gpu(gpu_tp.LLAMA3_8B, 2)
    # the layers halve (but for the replicated norms); the LM head stays whole on rank 0
    norms = (2 * 32 + 1) * 4096 * 2
    assert two["worker"] - norms == (one["worker"] - norms) // 2
    assert two["rank0"] == two["worker"] + head
    # a vocab-parallel head: every rank reads half of it
    vp = gpu_tp.weight_bytes_per_gpu(gpu_tp.LLAMA3_8B, 2, vocab_parallel=True)
    assert vp["rank0"] == vp["worker"] == two["worker"] + head // 2
    # more ranks than KV heads: each rank keeps one KV head (replicated, as vLLM)
    g = dict(gpu_tp.LLAMA3_70B, num_hidden_layers=1)
    h, d = 8192, 128
    sixteen = gpu_tp.weight_bytes_per_gpu(g, 16)
    q = 64 // 16 * d
    layer = (q + 2 * d) * h + q * h + 3 * (28672 // 16) * h + 2 * h
    assert sixteen["worker"] == (layer + h) * 2


def test_roofline():
    assert gpu_tp.roofline(3e12, 15e9) == pytest.approx(200.0)
    # 64 all-reduces of 10 us add 0.64 ms to a 5 ms step
    assert gpu_tp.roofline(3e12, 15e9, 64 * 10e-6) == pytest.approx(1 / 5.64e-3)


def test_compare_greedy():
    r = gpu_tp.compare_greedy([[1, 2, 3], [4, 5, 6], [7, 8]], [[1, 2, 3], [4, 9, 6], [7, 8, 9]])
    assert r == {"prompts": 3, "equal_prompts": 1, "first_divergence": [None, 1, 2],
                 "tokens_per_prompt": 2}


def test_parse_oracle_grid():
    assert gpu_tp.parse_oracle_grid("0.6:3, 0.8:5") == [(0.6, 3), (0.8, 5)]
    assert gpu_tp.parse_oracle_grid("") == []
    with pytest.raises(ValueError, match="ALPHA:K"):
        gpu_tp.parse_oracle_grid("0.8")


def _row(method, bs, tps, name=None, speedup=1.0, **kw):
    return {"name": name or method, "method": method, "batch_size": bs, "tokens_per_s": tps,
            "step_s": bs / tps, "speedup": speedup, "theoretical_speedup": kw.pop("theo", None),
            "acceptance": kw.pop("acceptance", None), "same_tokens_as_plain": True, **kw}


def fake_result() -> dict:
    """A made-up 8B TP 2 run: plain and the oracle at TP 1 and 2, two strategies (one failed),
    all-reduce timings of both ranks, greedy tokens of both equality pairs."""
    g = dict(gpu_tp.LLAMA3_8B)
    tokens = [[5, 6, 7, 8], [9, 10, 11, 12]]

    def engine(tp, b1, b64, oracle, **more):
        runs = [_row("plain", 1, b1), _row("plain", 64, b64),
                _row("oracle", 1, b1 * oracle, "oracle a=0.8 k=5", oracle, theo=3.6,
                     acceptance=0.8)]
        return {"tp": tp, "geometry": g, "init": "scaled", "runs": runs,
                "weight_bytes_rank0": gpu_tp.weight_bytes_per_gpu(g, tp)["rank0"],
                "greedy": {"plain": tokens}, "errors": {}, **more}

    collectives = {
        "ranks": [{"rank": 0, "copy_bandwidth_Bps": 3.0e12, "device": "H100"},
                  {"rank": 1, "copy_bandwidth_Bps": 2.9e12, "device": "H100"}],
        "allreduce": {
            "rows_1": {"shape": [1, 4096], "correct": True, "speculant_eager_us": 20.0,
                       "speculant_graph_us": 8.0, "dist_eager_us": 25.0, "dist_graph_us": 12.0},
            "rows_64": {"shape": [64, 4096], "correct": True, "speculant_eager_us": 25.0,
                        "speculant_graph_us": 11.0, "dist_eager_us": 30.0, "dist_graph_us": 15.0},
        },
        "errors": {},
    }
    strat = [_row("plain", 1, 290.0), _row("ngram", 1, 280.0, "ngram k=3", 0.97, acceptance=0.0)]
    return {
        "mode": "8b", "tp": 2, "geometry": g, "init": "scaled", "device": "H100",
        "phases": {
            "collectives": collectives,
            "tp1": engine(1, 176.0, 8000.0, 3.5),
            "tp2": engine(2, 300.0, 14800.0, 3.3, strategy_runs=strat,
                          errors={"eagle": "RuntimeError: boom"}),
            "equality_tp1": {"tp": 1, "init": "dummy", "dtype": "float32", "greedy": {"plain": tokens}},
            "equality_tp2": {"tp": 2, "init": "dummy", "dtype": "float32",
                             "greedy": {"plain": [[5, 6, 7, 8], [9, 10, 0, 12]]}},
        },
    }


def test_summary_of_a_made_up_run():
    s = gpu_tp.summarize(fake_result())
    assert s["copy_bandwidth_Bps_per_gpu"] == [3.0e12, 2.9e12]
    assert s["tp_speedup_plain"] == {1: pytest.approx(300 / 176), 64: pytest.approx(1.85)}
    assert s["goal_tp_speedup_b1_met"] is True  # 1.705 >= 1.7
    assert s["goal_tp_speedup_b64_met"] is True
    (o,) = s["oracle_tp_vs_tp1"]
    assert o["ratio"] == pytest.approx(3.3 / 3.5) and o["within_goal"]
    # 2 all-reduces per layer, 32 layers, 8 us each in a graph
    assert s["allreduce_per_step_ms"]["rows_1"]["speculant_graph_ms"] == pytest.approx(0.512)
    tp2 = s["per_phase"]["tp2"]
    wb = gpu_tp.weight_bytes_per_gpu(gpu_tp.LLAMA3_8B, 2)["rank0"]
    assert tp2["roofline_tokens_per_s"] == pytest.approx(2.9e12 / wb)  # the slowest GPU
    assert tp2["roofline_with_allreduce_tokens_per_s"] == pytest.approx(
        1 / (wb / 2.9e12 + 64 * 8e-6))
    assert tp2["plain_b1_fraction_of_roofline"] == pytest.approx(300 / tp2["roofline_tokens_per_s"])
    assert [st["name"] for st in tp2["strategies"]] == ["ngram k=3"]
    assert tp2["errors"] == {"eagle": "RuntimeError: boom"}
    assert "equality_tp1" not in s["per_phase"]  # raw dummy weights: no timings
    eq = s["greedy_equality"]
    assert eq["tp2:plain vs tp1:plain"]["equal_prompts"] == 2
    bad = eq["equality_tp2:plain vs equality_tp1:plain"]
    assert bad["equal_prompts"] == 1 and bad["first_divergence"] == [None, 2]


def test_report_lines():
    r = fake_result()
    r["summary"] = gpu_tp.summarize(r)
    text = gpu_tp.report(r)
    assert "copy bandwidth per GPU: 3.000, 2.900 TB/s" in text
    assert "plain TP 2 / TP 1: b1 1.705, b64 1.850 (goals: b1 >= 1.7: True, b64 >= 1.8: True)" in text
    assert "oracle oracle a=0.8 k=5 b1: TP 2 / TP 1 speedup ratio 0.943 (within 10%: True)" in text
    assert "ngram k=3 b1: 280.0 tok/s, speedup 0.970, acceptance 0.000" in text
    assert "equality_tp2:plain vs equality_tp1:plain (dummy init, float32): 1/2 prompts equal" in text
    assert "errors in tp2: {'eagle': 'RuntimeError: boom'}" in text
    r70 = fake_70b_result()
    assert "8B example eagle k=3 b1: TP 4 / TP 1 2.375" in gpu_tp.report(r70)


def test_a_failed_phase_still_summarises_and_plots(tmp_path):
    r = fake_result()
    r["phases"]["tp2"] = {"errors": {"phase": "killed after 300s (time limit)"}, "timed_out": True}
    del r["phases"]["collectives"]
    s = gpu_tp.summarize(r)
    assert "tp_speedup_plain" not in s and "roofline_tokens_per_s" not in s["per_phase"]["tp1"]
    json_path, png = gpu_tp.write_result(r, tmp_path)
    assert png.read_bytes()[:8] == PNG and "plot_error" not in json.loads(json_path.read_text())


@pytest.mark.slow
def test_write_result_and_replot(tmp_path):
    json_path, png = gpu_tp.write_result(fake_result(), tmp_path / "run")
    saved = json.loads(json_path.read_text())
    assert saved["summary"]["tp_speedup_plain"]["1"] == pytest.approx(300 / 176)  # JSON keys
    assert png.read_bytes()[:8] == PNG and "plot_error" not in saved
    png.unlink()
    assert gpu_tp.main(["--replot", str(json_path), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again" / "gpu_tp.png").read_bytes()[:8] == PNG


def fake_70b_result() -> dict:
    """A made-up 70B TP 4 run: plain sweep, two oracle cells, the 8B EAGLE example at TP 1 / 4
    (EAGLE's greedy tokens at TP 4 differ from plain TP 1's at token 3 of prompt 0)."""
    g70, g8 = dict(gpu_tp.LLAMA3_70B), dict(gpu_tp.LLAMA3_8B)
    plain = [[1, 2, 3, 4], [5, 6, 7, 8]]
    runs70 = [_row("plain", 1, 60.0), _row("plain", 64, 3000.0),
              _row("oracle", 1, 150.0, "oracle a=0.8 k=5", 2.5, theo=3.0, acceptance=0.8,
                   speedup_vs_theoretical=2.5 / 3.0),
              _row("oracle", 1, 100.0, "oracle a=0.6 k=3", 1.67, theo=2.0, acceptance=0.6)]

    def eight(tp, b1, eagle, greedy):
        return {"tp": tp, "geometry": g8, "runs": [_row("plain", 1, b1)],
                "strategy_runs": [_row("plain", 1, b1), _row("eagle", 1, eagle, "eagle k=3", eagle / b1)],
                "greedy": greedy, "errors": {}}

    return {
        "mode": "70b", "tp": 4, "geometry": g70, "init": "scaled", "device": "H100",
        "phases": {
            "collectives": {"ranks": [{"copy_bandwidth_Bps": 3.0e12}] * 4,
                            "allreduce": {"rows_1": {"speculant_graph_us": 10.0}}},
            "70b_tp4": {"tp": 4, "geometry": g70, "runs": runs70, "errors": {}},
            "8b_tp1": eight(1, 176.0, 160.0, {"plain": plain, "eagle": plain}),
            "8b_tp4": eight(4, 420.0, 380.0, {"plain": plain, "eagle": [[1, 2, 3, 0], [5, 6, 7, 8]]}),
        },
    }


def test_summary_of_a_made_up_70b_run(tmp_path):
    s = gpu_tp.summarize(fake_70b_result())
    row = s["per_phase"]["70b_tp4"]
    wb = gpu_tp.weight_bytes_per_gpu(gpu_tp.LLAMA3_70B, 4)["rank0"]
    assert row["roofline_tokens_per_s"] == pytest.approx(3.0e12 / wb)
    # 2 x 80 all-reduces of 10 us
    assert row["roofline_with_allreduce_tokens_per_s"] == pytest.approx(1 / (wb / 3e12 + 1.6e-3))
    assert [o["speedup_vs_theoretical"] for o in row["oracle"]] == [pytest.approx(2.5 / 3), None]
    # the 8B example: all-reduces of 8192-wide rows say nothing of its 4096-wide ones
    assert "roofline_with_allreduce_tokens_per_s" not in s["per_phase"]["8b_tp4"]
    ex = s["8b_example_tp_speedup"]
    assert ex["plain"] == {1: pytest.approx(420 / 176)}
    assert ex["eagle k=3 b1"]["ratio"] == pytest.approx(380 / 160)
    eq = s["greedy_equality"]
    assert eq["8b_tp4:plain vs 8b_tp1:plain"]["equal_prompts"] == 2
    assert eq["8b_tp4:eagle vs 8b_tp1:plain"]["first_divergence"] == [3, None]
    assert "tp_speedup_plain" not in s
    _, png = gpu_tp.write_result(fake_70b_result(), tmp_path)
    assert png.read_bytes()[:8] == PNG


def test_plan_of_both_modes():
    args = gpu_tp.parser().parse_args(["--tp", "2"])
    args.init, args.argv = "scaled", []
    names = [p[0] for p in gpu_tp.plan(args)]
    assert names == ["collectives", "tp1", "tp2", "equality_tp1", "equality_tp2"]
    args = gpu_tp.parser().parse_args(["--geometry", "70b", "--tp", "4", "--skip", "collectives"])
    phases = {p[0]: p for p in gpu_tp.plan(args)}
    assert list(phases) == ["70b_tp4", "8b_tp1", "8b_tp4"]
    extra = phases["70b_tp4"][3]
    assert extra[extra.index("--oracle") + 1] == gpu_tp.ORACLE_70B
    assert extra[extra.index("--strategies") + 1] == "mlp"
    assert phases["8b_tp4"][2] == 4 and "eagle" in phases["8b_tp4"][3]
    # a phase's process parses the run's own arguments, then its phase's: the latter win
    run_argv = ["--geometry", "70b", "--tp", "4", "--out", "X"]
    child = gpu_tp.parser().parse_args([*run_argv, *phases["8b_tp4"][3]])
    assert (child.geometry, child.tp, child.layers, child.oracle) == ("8b", 4, 32, "")
    assert (child.strategies, child.greedy_strategies, child.batch_sizes) == ("eagle", "eagle", "1")
    child = gpu_tp.parser().parse_args([*run_argv, *phases["70b_tp4"][3]])
    assert (child.geometry, child.oracle_batch_sizes, child.strategies) == ("70b", "1", "mlp")
    assert child.layers is None  # the geometry's 80
    # --layers shrinks both models of the 70B mode
    args = gpu_tp.parser().parse_args(["--geometry", "70b", "--layers", "8"])
    args.tp = 4
    extra = {p[0]: p[3] for p in gpu_tp.plan(args)}["8b_tp1"]
    assert gpu_tp.parser().parse_args(["--layers", "8", *extra]).layers == 8


def test_install_loader_wraps_every_binding(monkeypatch):
    """The loader wrapper replaces every imported binding of load_model, passes the engine's
    arguments through untouched (and leaves models of other configs alone), and installs once;
    the scaled init refuses the CPU with the fix."""
    from types import SimpleNamespace

    import speculant.engine.llm_engine as llm_engine
    import speculant.models.loader as loader

    calls = []

    def fake(folder, config, *args, **kwargs):
        calls.append((folder, args, kwargs))
        return SimpleNamespace(name="model")

    monkeypatch.setattr(loader, "load_model", fake)
    monkeypatch.setattr(llm_engine, "load_model", fake)
    gpu_tp.install_loader()
    wrapped = loader.load_model
    assert wrapped is not fake and llm_engine.load_model is wrapped
    model = wrapped("folder", SimpleNamespace(speculant_tp_init="dummy"), "dtype", "dev", 8,
                    load_format="dummy")
    assert model.name == "model"
    assert calls == [("folder", ("dtype", "dev", 8), {"load_format": "dummy"})]
    gpu_tp.install_loader()
    assert loader.load_model is wrapped  # not wrapped twice
    cpu_model = SimpleNamespace(embed_tokens=SimpleNamespace(weight=torch.zeros(2, 2)))
    with pytest.raises(ValueError, match="--init dummy"):
        gpu_tp.scaled_init(cpu_model, 2)


def test_scaled_init_is_the_same_rescaling_at_every_tp_size(tmp_path):
    """The dummy weights of a rank's shard, rescaled: o_proj / down_proj by 1 / sqrt(2 layers),
    the embedding to std EMBED_STD, the LM head a permutation of the embeddings, the rest
    untouched; the replicated embedding and LM head come out the same at TP 1 and each rank of
    TP 2 (so the sharded layers, scaled elementwise, are TP 1's shards)."""
    import math

    from speculant.distributed import TensorParallel
    from speculant.models.loader import load_config, load_model

    folder = tmp_path / "tiny"
    folder.mkdir()
    cfg = dict(gpu_tp.TINY, num_hidden_layers=2, torch_dtype="float32")
    (folder / "config.json").write_text(json.dumps(cfg))
    config = load_config(folder)

    def load(rank, size):
        return load_model(folder, config, torch.float32, torch.device("cpu"), 64,
                          load_format="dummy", tp=TensorParallel(rank, size, None, None))

    heads = {}
    for rank, size in ((0, 1), (0, 2), (1, 2)):
        raw, scaled = load(rank, size), load(rank, size)
        gpu_tp.scaled_init(scaled, 2, allow_cpu=True)
        raw_p = dict(raw.named_parameters())
        for name, p in scaled.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                torch.testing.assert_close(p, raw_p[name] / math.sqrt(4))
            elif name.endswith("embed_tokens.weight"):
                torch.testing.assert_close(p, raw_p[name] * gpu_tp.EMBED_STD / 0.02)
            elif name != "lm_head.weight":
                assert torch.equal(p, raw_p[name]), name
        emb, head = scaled.embed_tokens.weight, scaled.lm_head.weight  # [vocab, hidden]
        # every LM head row is a multiple of one embedding row, each used once
        best = (head @ emb.T).argmax(dim=1)
        assert best.unique().numel() == emb.shape[0]
        heads[(rank, size)] = (emb.clone(), head.clone())
    for key in ((0, 2), (1, 2)):
        assert torch.equal(heads[key][0], heads[(0, 1)][0])
        assert torch.equal(heads[key][1], heads[(0, 1)][1])


def test_the_documented_commands_parse():
    """Every ``python bench/gpu_tp.py ...`` line of docs/tensor_parallel.md uses options the
    script has."""
    import shlex

    text = (BENCH.parent / "docs" / "tensor_parallel.md").read_text()
    lines = [ln.split("#")[0] for ln in text.splitlines() if ln.startswith("python bench/gpu_tp.py")]
    assert len(lines) >= 4
    for line in lines:
        gpu_tp.parser().parse_args(shlex.split(line)[2:])  # exits 2 on an unknown option


def test_argument_errors(capsys):
    with pytest.raises(SystemExit) as e:
        gpu_tp.main(["--device", "cpu", "--init", "scaled"])
    assert e.value.code == 2 and "--init dummy" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        gpu_tp.main(["--oracle", "0.8"])
    assert e.value.code == 2 and "ALPHA:K" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        gpu_tp.main(["--strategies", "ngram,medusa"])
    assert e.value.code == 2 and "medusa" in capsys.readouterr().err
    if torch.cuda.device_count() < 2:
        with pytest.raises(SystemExit) as e:
            gpu_tp.main(["--tp", "2"])
        assert e.value.code == 2 and "needs 2 CUDA devices" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        gpu_tp.main(["--tp", "0"])
    assert e.value.code == 2 and "at least 1" in capsys.readouterr().err


@pytest.mark.slow  # five phases of 1-2 processes each, two of them engines at TP 2 over gloo
def test_whole_run_at_tp2_on_the_cpu(tmp_path):
    """The bench's main path on the CPU: tiny Llama, 2 layers, TP 1 and TP 2 over gloo (ranks
    started as torchrun starts them): every phase ends, the greedy tokens of TP 2 equal TP 1's,
    the oracle, the n-gram strategy and a draft model (synthetic, on rank 0) ran at TP 2."""
    out = tmp_path / "run"
    cmd = [sys.executable, str(BENCH / "gpu_tp.py"), "--device", "cpu", "--geometry", "tiny",
           "--tp", "2", "--layers", "2", "--out", str(out), "--batch-sizes", "1,2",
           "--max-tokens", "12", "--prompt-len", "8", "--repeats", "1", "--warmup-tokens", "2",
           "--strategies", "ngram,draft", "--equality-prompts", "2", "--equality-tokens", "10",
           "--kv-cache-gib", "0.01", "--allreduce-iters", "20", "--budget-s", "500"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "gpu_tp.json").read_text())
    assert (out / "gpu_tp.png").read_bytes()[:8] == PNG
    for name, ph in result["phases"].items():
        assert ph["rc"] == 0 and not ph["errors"], (name, ph.get("errors"))
    s = result["summary"]
    assert set(s["tp_speedup_plain"]) == {"1", "2"}
    assert s["allreduce_us"]["rows_1"]["speculant_eager_us"] > 0
    assert all(c["correct"] for c in result["phases"]["collectives"]["allreduce"].values())
    for key, eq in s["greedy_equality"].items():
        assert eq["equal_prompts"] == eq["prompts"] == 2, (key, eq)
    for name in ("tp1", "tp2"):  # the weight bytes worked out = what rank 0's shard holds
        row = s["per_phase"][name]
        assert row["weight_bytes_per_gpu_analytic"]["rank0"] == row["weight_bytes_per_gpu_rank0"]
    tp2 = s["per_phase"]["tp2"]
    assert tp2["weight_bytes_per_gpu_rank0"] < s["per_phase"]["tp1"]["weight_bytes_per_gpu_rank0"]
    assert [st["name"] for st in tp2["strategies"]] == ["ngram k=3", "draft tiny k=3"]
    assert all(st["same_tokens_as_plain"] for st in tp2["strategies"])
    assert {o["batch_size"] for o in tp2["oracle"]} == {1, 2}
    assert all(o["same_tokens_as_plain"] for o in tp2["oracle"])
