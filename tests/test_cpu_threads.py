"""EngineConfig.cpu_threads (engine/cpu_threads.py) and the demo's timing / reporting (issue 32).

A CPU engine sets torch's thread count when it starts: the user's ``cpu_threads``, else 1 unless
the user set a count (OMP_NUM_THREADS / MKL_NUM_THREADS, torch.set_num_threads). The demo times
plain and speculative decoding interleaved, keeps each side's fastest run, re-times a category
that comes out slower and flags one that stays slower."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

import speculant
from speculant import demo
from speculant.config import EngineConfig
from speculant.engine import cpu_threads
from speculant.models import cpu_kernels


@pytest.fixture
def threads(monkeypatch):
    """Restore torch's thread count and the module's record of it; no thread env vars."""
    before, applied = torch.get_num_threads(), cpu_threads._applied
    kernels = cpu_kernels.threads()
    for var in cpu_threads.ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    yield
    torch.set_num_threads(before)
    cpu_threads._applied = applied
    if cpu_kernels.available():
        cpu_kernels.set_threads(kernels)


# ---------------------------------------------------------------------------- the config field
@pytest.mark.parametrize("v", [None, 1, 2, 64, "3"])
def test_field_accepts(v):
    assert EngineConfig(cpu_threads=v).cpu_threads == (None if v is None else int(v))


@pytest.mark.parametrize("v", [0, -1, True, False, 1.5, "x", "0"])
def test_field_rejects(v):
    with pytest.raises(ValueError, match="cpu_threads"):
        EngineConfig(cpu_threads=v)


def test_field_default_is_automatic():
    assert EngineConfig().cpu_threads is None


def test_llm_rejects_bad_value_before_loading():
    with pytest.raises(ValueError, match="cpu_threads"):
        speculant.LLM(model="/nonexistent", cpu_threads=0)


# ---------------------------------------------------------------------------- the choice
def test_available_cpus_is_the_affinity_mask():
    n = cpu_threads.available_cpus()
    assert 1 <= n <= (os.cpu_count() or n)
    if hasattr(os, "sched_getaffinity"):
        assert n == len(os.sched_getaffinity(0))


def test_auto_choice_is_sane():
    n = cpu_threads.auto_cpu_threads()
    assert n == 1  # measured fastest for small-model decoding, quiet or busy (module docstring)
    assert 1 <= n <= cpu_threads.available_cpus()


def test_explicit_count_wins(threads, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads.resolve_cpu_threads(2) == (2, "cpu_threads=2")


@pytest.mark.parametrize("var", cpu_threads.ENV_VARS)
def test_env_var_is_kept(threads, monkeypatch, var):
    monkeypatch.setenv(var, "2")
    n, why = cpu_threads.resolve_cpu_threads(None)
    assert n is None and var in why
    torch.set_num_threads(2)
    assert cpu_threads.apply_cpu_threads(None) == 2  # left alone


def test_users_set_num_threads_is_kept(threads):
    cpu_threads._applied = None
    torch.set_num_threads(cpu_threads._initial + 1)
    n, why = cpu_threads.resolve_cpu_threads(None)
    assert n is None and "torch.set_num_threads" in why
    assert cpu_threads.apply_cpu_threads(None) == cpu_threads._initial + 1


def test_default_count_is_replaced(threads):
    cpu_threads._applied = None
    torch.set_num_threads(cpu_threads._initial)  # torch's count at import: not the user's
    assert cpu_threads.resolve_cpu_threads(None)[0] == cpu_threads.auto_cpu_threads()
    assert cpu_threads.apply_cpu_threads(None) == cpu_threads.auto_cpu_threads()
    # a second engine sees the first one's count, not a user's
    assert cpu_threads.user_setting() is None
    # a change after that is the user's again
    torch.set_num_threads(2)
    assert cpu_threads.user_setting() == "torch.set_num_threads(2)"


@pytest.mark.parametrize("cpus", [1, 2, 8])
def test_kernel_threads(threads, monkeypatch, cpus):
    """The C kernels' products take a helper thread (2) with 2+ torch threads, or automatically
    where there are 2+ CPUs for each process (a tensor-parallel group's ranks share them); an
    explicit or a user's count of 1 keeps them on one thread."""
    monkeypatch.setattr(cpu_threads, "available_cpus", lambda: cpus)
    cpu_threads._applied = None
    torch.set_num_threads(cpu_threads._initial)
    assert cpu_threads.kernel_threads(None, 1) == (2 if cpus >= 2 else 1)
    assert cpu_threads.kernel_threads(1, 1) == 1
    assert cpu_threads.kernel_threads(2, 2) == 2
    assert cpu_threads.kernel_threads(None, 1, processes=2) == (2 if cpus >= 4 else 1)
    assert cpu_threads.kernel_threads(2, 2, processes=2) == 2  # the user's own count
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the user's one thread
    assert cpu_threads.kernel_threads(None, 1) == 1


@pytest.mark.slow
def test_engine_applies_it(threads, tiny_llama):
    llm = speculant.LLM(model=str(tiny_llama), cpu_threads=1)
    assert llm.engine.cpu_threads == 1 == torch.get_num_threads() == cpu_kernels.threads()
    llm = speculant.LLM(model=str(tiny_llama), cpu_threads=2)
    assert llm.engine.cpu_threads == 2 == torch.get_num_threads()
    assert cpu_kernels.threads() == (2 if cpu_kernels.available() else 1)
    llm = speculant.LLM(model=str(tiny_llama))  # automatic: the engine's own 2 is not the user's
    assert llm.engine.cpu_threads == cpu_threads.auto_cpu_threads() == torch.get_num_threads()
    helper = cpu_kernels.available() and cpu_threads.available_cpus() >= 2
    assert cpu_kernels.threads() == (2 if helper else 1)
    out = llm.generate([[1, 2, 3]], speculant.SamplingParams(max_tokens=3, temperature=0.0),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


# ---------------------------------------------------------------------------- the demo's figures
def test_speedups_and_slowdown_flags():
    per, overall = demo.speedups([2.0, 1.0, 3.0], [1.0, 1.25, 1.0])
    assert per == [2.0, 0.8, 3.0] and overall == pytest.approx(6.0 / 3.25)
    assert demo.slower(["a", "b", "c"], per, overall) == ["b (0.80x)"]
    assert demo.slower(["a"], [0.9], 0.9) == ["a (0.90x)", "overall (0.90x)"]
    assert demo.slower(["a", "b"], [1.0, 1.3], 1.1) == []


class _Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def _fake_llm(clock, costs, calls, cpu_clock=None, cpu_costs=None):
    """An LLM whose chat() advances ``clock`` by ``costs(method, category, n)`` seconds, n: how
    many times that prompt ran on it (``cpu_clock`` by ``cpu_costs``, default the same), and
    returns the same tokens for either method."""
    cats = {p: c for c, p in demo.DEMO_PROMPTS}

    class FakeLLM:
        def __init__(self, model=None, speculative_config=None):
            self.method = (speculative_config or {}).get("method", "none")
            spec = SimpleNamespace(total=SimpleNamespace(__init__=lambda: None)) \
                if speculative_config else None
            self.engine = SimpleNamespace(cpu_threads=1, device="cpu", spec=spec)

        n = 0

        def chat(self, messages, params, use_tqdm=False):
            self.n += 1
            cat = cats[messages[0][0]["content"]]
            key = (self.method, cat, params.max_tokens)
            calls[key] = calls.get(key, 0) + 1
            clock.t += costs(self.method, cat, calls[key])
            if cpu_clock is not None:
                cpu_clock.t += (cpu_costs or costs)(self.method, cat, calls[key])
            stats = SimpleNamespace(num_accepted_tokens=1, num_draft_tokens=2,
                                    mean_accepted_length=1.5)
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1] * 10, text="hi")],
                                    metrics=SimpleNamespace(spec=stats))]

        def get_metrics(self):
            # acceptance_rate: calls so far / 100, to tell when it was read
            return SimpleNamespace(per_position_acceptance=[0.5], acceptance_rate=self.n / 100,
                                   mean_accepted_length=1.5)

    return FakeLLM


def _demo(monkeypatch, capsys, costs, cpu_costs=None, **kw):
    clock, cpu_clock, calls = _Clock(), _Clock(), {}
    monkeypatch.setattr(demo.time, "perf_counter", clock)
    monkeypatch.setattr(demo.time, "process_time", cpu_clock)
    # the demo collects garbage before each timed run: with the test run's heap that costs
    # 0.2-0.6 s a call and nothing here, where the runs and the clocks are fakes
    monkeypatch.setattr(demo.gc, "collect", lambda *a: 0)
    monkeypatch.setattr(speculant, "LLM", _fake_llm(clock, costs, calls, cpu_clock, cpu_costs),
                        raising=False)
    rc = demo.run_demo(**kw)
    return rc, capsys.readouterr().out, calls


def _line(out, cat):
    return next(ln for ln in out.splitlines() if ln.strip().startswith(cat))


def test_demo_keeps_each_sides_fastest_run(monkeypatch, capsys):
    # a busy neighbour slows one plain and one speculative run: neither counts
    def costs(method, cat, n):
        base = 1.0 if method == "none" else 0.5
        return base * (5.0 if n == 2 else 1.0)

    rc, out, calls = _demo(monkeypatch, capsys, costs, repeats=3)
    assert rc == 0
    assert "2.00x" in _line(out, "qa") and "SLOWER" not in out
    assert calls[("none", "qa", 128)] == calls[("ngram", "qa", 128)] == 3  # same work both sides


def test_demo_retimes_a_slower_category(monkeypatch, capsys):
    # qa's speculative runs are disturbed in the first 3 repeats only: re-timed, both sides
    def costs(method, cat, n):
        if method == "none":
            return 1.0
        return 1.2 if cat == "qa" and n <= 3 else 0.8

    rc, out, calls = _demo(monkeypatch, capsys, costs, repeats=3, retime=3)
    assert rc == 0 and "SLOWER" not in out
    assert "1.25x" in _line(out, "qa") and "timed 4x" in _line(out, "qa")
    assert calls[("none", "qa", 128)] == calls[("ngram", "qa", 128)] == 4
    assert calls[("none", "rewrite", 128)] == 3  # the others are not re-timed


def test_demo_flags_a_lasting_slowdown(monkeypatch, capsys):
    def costs(method, cat, n):
        return 1.0 if method == "none" or cat != "summarize" else 1.1

    rc, out, calls = _demo(monkeypatch, capsys, costs, repeats=2, retime=2)
    assert "0.91x" in _line(out, "summarize") and "timed 4x" in _line(out, "summarize")
    assert "SLOWER than plain decoding" in out and "ngram: summarize (0.91x)" in out
    assert calls[("ngram", "summarize", 128)] == 4
    # acceptance figures cover the warm-up and one pass of the 4 prompts, not the re-timed runs
    assert _line(out, "ngram").split()[3] == "0.05"


@pytest.mark.slow  # ~4.5 s busy: the default run keeps the other demo tests
def test_demo_reports_unequal_outputs(monkeypatch, capsys):
    clock, calls = _Clock(), {}
    fake = _fake_llm(clock, lambda m, c, n: 1.0, calls)

    class Diverging(fake):
        def chat(self, messages, params, use_tqdm=False):
            out = super().chat(messages, params, use_tqdm)
            if self.method != "none":
                out[0].outputs[0].token_ids = [2] * 10
            return out

    monkeypatch.setattr(demo.time, "perf_counter", clock)
    monkeypatch.setattr(demo.time, "process_time", clock)
    monkeypatch.setattr(speculant, "LLM", Diverging, raising=False)
    assert demo.run_demo(repeats=1, retime=0) == 1
    assert "identical to plain decoding: NO" in capsys.readouterr().out


def test_demo_on_a_starved_cpu_reports_cpu_time(monkeypatch, capsys):
    # more CPU-bound processes than cores: every run waits ~as long as it computes, in bursts
    # that hit qa's speculative runs; the CPU time (the work) says 1.25x, and the output says
    # which clock the figures are from and gives the wall-clock tokens/s
    def wall(method, cat, n):
        return 3.0 if method == "ngram" and cat == "qa" else 2.0

    def cpu(method, cat, n):
        return 1.0 if method == "none" else 0.8

    rc, out, calls = _demo(monkeypatch, capsys, wall, cpu, repeats=2, retime=2)
    assert rc == 0 and "SLOWER" not in out
    assert "1.25x" in _line(out, "qa") and "timed" not in _line(out, "qa")
    assert "got 42% of a CPU" in out and "CPU time of each run" in out
    assert "wall-clock tokens/s" in out and "none 5.0, ngram 4.4" in out
    assert _line(out, "none").split()[1] == "10.0"  # 10 tokens per run, 1.0 s of CPU


# the wall clock is the clock of every other demo test but the starved one
def test_demo_keeps_the_wall_clock_with_a_core_to_itself(monkeypatch, capsys):
    # CPU time ~ wall time: the wall clock, which here shows qa slower: re-timed, then flagged
    def wall(method, cat, n):
        return 1.1 if method == "ngram" and cat == "qa" else 1.0

    def cpu(method, cat, n):
        return 0.95 * wall(method, cat, n)

    rc, out, calls = _demo(monkeypatch, capsys, wall, cpu, repeats=2, retime=1)
    assert "CPU time" not in out and "0.91x" in _line(out, "qa") and "SLOWER" in out


def test_cpu_share():
    t = demo.Timings([[(2.0, 1.0), (1.0, 0.5)], [(1.0, 1.0)]])
    assert demo.cpu_share([t]) == pytest.approx(2.5 / 4.0)
    assert t.best(demo.WALL) == [1.0, 1.0] and t.best(demo.CPU) == [0.5, 1.0]
    assert demo.cpu_share([demo.Timings([[]])]) == 1.0
