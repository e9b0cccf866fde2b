"""auto_disable (engine/spec_control.py): speculation runs only while its steps beat plain ones.

The controller's decisions are tested with an injected fake clock (no timed assertions); the
engine tests drive a tiny random model with the oracle strategy (alpha=0: every draft wrong,
alpha=1: every draft right) and a fake clock advanced by a cost model of the target forwards, so
they are deterministic too. Outputs always equal plain greedy decoding."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from speculant import LLM, SamplingParams
from speculant.engine.spec_control import WARMUP, SpecController
from speculant.spec_registry import SpeculativeConfig, StrategyError


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def drive(ctl: SpecController, clock: Clock, steps: int, bs: int, t_plain: float, t_spec: float,
          tokens: float) -> list[bool]:
    """``steps`` decode steps of ``bs`` sequences: a plain step takes ``t_plain``, a speculative
    one ``t_spec`` and emits ``tokens`` per sequence. Returns the kinds run (True: speculative)."""
    kinds = []
    for _ in range(steps):
        spec = ctl.begin(bs)
        clock.t += t_spec if spec else t_plain
        ctl.end(round(bs * tokens) if spec else bs)
        kinds.append(spec)
    return kinds


def plain_runs(kinds: list[bool]) -> list[int]:
    """Lengths of the runs of plain steps that are followed by a speculative step."""
    runs, n = [], 0
    for k in kinds:
        if k:
            if n:
                runs.append(n)
            n = 0
        else:
            n += 1
    return runs


def make(**kw) -> tuple[SpecController, Clock]:
    clock = Clock()
    return SpecController(clock=clock, **kw), clock


# --------------------------------------------------------------------------------------------
# the controller alone
# --------------------------------------------------------------------------------------------
def test_warmup_measures_plain_then_speculative_steps():
    ctl, clock = make()
    kinds = drive(ctl, clock, 2 * WARMUP, 1, 1.0, 1.2, 3.0)
    assert kinds == [False] * WARMUP + [True] * WARMUP


@pytest.mark.parametrize(
    "t_spec, runs",
    [
        # cheap probes (2 x 0.06 excess: 5 plain steps within the 2.5% budget): 1, 2, 4, ...
        # capped at the interval, never below what the probe's cost allows
        (1.06, [5, 5, 5, 8, 16, 32, 64, 64, 64]),
        # costly probes (2 x 0.5 excess): 40 plain steps per probe at least
        (1.5, [40, 40, 40, 40, 40, 40, 64, 64, 64]),
    ],
)
def test_losing_speculation_is_switched_off_with_exponential_probes(t_spec, runs):
    ctl, clock = make(interval=64)
    kinds = drive(ctl, clock, 800, 1, t_plain=1.0, t_spec=t_spec, tokens=1.0)  # < 0.95x plain
    assert kinds[: 2 * WARMUP] == [False] * WARMUP + [True] * WARMUP
    assert (ctl.num_disabled, ctl.num_enabled) == (1, 0)
    assert plain_runs(kinds[2 * WARMUP :])[:9] == runs
    # each probe is two speculative steps (the first one untimed: proposer catch-up)
    spec_after = kinds[2 * WARMUP :]
    assert plain_runs([not k for k in spec_after])[: ctl.num_probes - 1] == [2] * (ctl.num_probes - 1)
    assert sum(spec_after) in (2 * ctl.num_probes, 2 * ctl.num_probes - 1)
    assert sum(kinds) < 0.1 * len(kinds), sum(kinds)
    assert not ctl.buckets[1].on


def test_probe_waits_grow_with_the_catch_up_cost():
    """A stateful proposer (draft model) pays a catch-up on every token it missed in a probe's
    first step: probes are spaced so that their excess stays within tolerance / 2 of the time."""
    ctl, clock = make(interval=64)  # tolerance 0.05: budget 2.5%
    t_plain, t_spec, catch_up = 1.0, 1.5, 30.0
    total_plain = total = 0.0
    last = None
    for _ in range(20000):
        spec = ctl.begin(1)
        dt = t_spec if spec else t_plain
        if spec and last is False:  # the first speculative step after plain ones
            dt += catch_up
        clock.t += dt
        ctl.end(1)
        total += dt
        total_plain += t_plain  # each step emits one token, as a plain step would
        last = spec
    b = ctl.buckets[1]
    assert not b.on and ctl.num_enabled == 0
    assert b.probe_cost == pytest.approx(catch_up + 2 * (t_spec - t_plain), rel=0.01)
    assert b.wait <= ctl._cost_wait(b, b.probe_cost)
    assert ctl._cost_wait(b, b.probe_cost) == 1240  # 31 / (0.025 x 1.0)
    # the first probes before the cost was measured, then at most ~2.5% over plain
    assert ctl.num_probes <= 20
    assert total / total_plain < 1.0 + 0.025 + 0.01, total / total_plain


def test_paying_speculation_stays_on_with_rare_plain_refreshes():
    ctl, clock = make(interval=64)
    kinds = drive(ctl, clock, 600, 1, t_plain=1.0, t_spec=1.4, tokens=2.5)  # 1.8x plain
    assert ctl.num_disabled == 0
    plain = [i for i, k in enumerate(kinds) if not k]
    assert plain[:WARMUP] == list(range(WARMUP))
    assert len(plain) - WARMUP == ctl.num_refresh == (600 - 2 * WARMUP) // 65
    assert all(b - a == 65 for a, b in zip(plain[WARMUP:], plain[WARMUP + 1 :]))


def test_comes_back_when_speculation_pays_again():
    ctl, clock = make(interval=64)
    drive(ctl, clock, 400, 1, t_plain=1.0, t_spec=1.5, tokens=1.0)
    assert ctl.num_disabled == 1 and not ctl.buckets[1].on
    kinds = drive(ctl, clock, 300, 1, t_plain=1.0, t_spec=1.4, tokens=2.5)
    assert ctl.num_enabled == 1 and ctl.buckets[1].on
    back = next(i for i in range(len(kinds)) if all(kinds[i : i + 20]))
    assert back <= 64 + 2, back  # the next probe (at most one interval away) is enough
    assert sum(kinds[back:]) > 0.95 * len(kinds[back:])
    assert ctl.buckets[1].backoff == 1  # reset by the probe that paid


def test_tolerance_band():
    for t_spec, tol, on in [(1.03, 0.05, True), (1.03, 0.0, False), (1.12, 0.05, False),
                            (1.12, 0.15, True)]:
        ctl, clock = make(tolerance=tol)
        drive(ctl, clock, 200, 2, t_plain=1.0, t_spec=t_spec, tokens=1.0)
        assert ctl.buckets[2].on is on, (t_spec, tol)


def test_batch_size_buckets_decide_independently():
    ctl, clock = make()
    # memory-bound small batches: speculation pays; big batches: it costs
    drive(ctl, clock, 100, 2, t_plain=1.0, t_spec=1.2, tokens=2.0)
    drive(ctl, clock, 100, 40, t_plain=3.0, t_spec=9.0, tokens=2.0)
    assert ctl.buckets[2].on and not ctl.buckets[6].on
    assert drive(ctl, clock, 1, 3, 1.0, 1.2, 2.0) == [True]  # 3 shares the bucket of 2
    assert not ctl.would_speculate(33) and ctl.would_speculate(2)
    assert ctl.would_speculate(64) is False  # a new bucket starts with plain steps


def test_one_time_costs_do_not_switch_speculation_off():
    """The first step at a new shape (CUDA graph capture, kernel compile) or a GC pause."""
    ctl, clock = make()
    assert ctl.begin(1) is False
    clock.t += 50.0  # first plain step: 50x
    ctl.end(1)
    drive(ctl, clock, 1, 1, 1.0, 1.4, 2.5)
    assert ctl.begin(1) is True
    clock.t += 100.0  # first speculative step: 100x
    ctl.end(3)
    drive(ctl, clock, 100, 1, 1.0, 1.4, 2.5)
    for _ in range(3):  # isolated spikes later on are clipped
        assert ctl.begin(1) is True
        clock.t += 100.0
        ctl.end(3)
        drive(ctl, clock, 20, 1, 1.0, 1.4, 2.5)
    assert ctl.num_disabled == 0
    assert ctl.buckets[1].t_spec < 2.0 and ctl.buckets[1].t_plain < 1.5


def test_steps_run_plain_by_a_modifier_are_timed_but_never_speculative():
    ctl, clock = make()
    for _ in range(10):
        assert ctl.begin(8, allowed=False) is False
        clock.t += 1.0
        assert ctl.end(8) is None
    b = ctl.buckets[4]
    assert b.n_plain == 10 and b.t_plain == 1.0 and b.n_spec == 0 and b.on
    assert (ctl.num_disabled, ctl.num_enabled, ctl.num_probes, ctl.num_refresh) == (0, 0, 0, 0)
    # plain timings already known: speculation is measured next
    assert drive(ctl, clock, 2, 8, 1.0, 1.2, 2.0) == [True, True]


# --------------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------------
def test_config_defaults_and_validation():
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    assert (cfg.auto_disable, cfg.auto_disable_tolerance, cfg.auto_disable_interval) == \
        (False, 0.05, 64)
    for bad in ({"auto_disable_tolerance": -0.1}, {"auto_disable_tolerance": 1.0},
                {"auto_disable_interval": 1}, {"auto_disable_interval": 0},
                {"auto_disable": "maybe"}):
        with pytest.raises(ValidationError):
            SpeculativeConfig(method="ngram", num_speculative_tokens=2, **bad)


# --------------------------------------------------------------------------------------------
# the engine
# --------------------------------------------------------------------------------------------
K = 4
MAX_TOKENS = 96
PROMPTS = [[1, 17, 300, 4000, 52], [1, 9, 9, 9], [1, 2000, 31, 77, 5, 6, 7], [1, 42]]
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_factory):
    return str(tiny_factory("llama", tokenizer=False))


@pytest.fixture(scope="module")
def recorded(tiny):
    """Plain greedy outputs, and oracle references K tokens longer (full drafts to the end)."""
    llm = LLM(model=tiny, skip_tokenizer_init=True, max_num_seqs=8)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS + K,
                                                ignore_eos=True), use_tqdm=False)
    long = [list(o.outputs[0].token_ids) for o in outs]
    refs = [{"prompt_token_ids": p, "output_token_ids": t} for p, t in zip(PROMPTS, long)]
    return [t[:MAX_TOKENS] for t in long], refs


def _oracle(tiny, refs, alpha, cost_clock=True, **extra):
    """An LLM with the oracle strategy. ``cost_clock``: the controller's clock is a fake one that
    each target forward advances by 1 + 0.25 x (query tokens per sequence): a speculative step of
    k=4 costs 2.25, a plain one 1.25 (memory-bound: cost barely depends on the batch size)."""
    llm = LLM(model=tiny, skip_tokenizer_init=True, max_num_seqs=8, speculative_config={
        "method": "oracle", "num_speculative_tokens": K, "alpha": alpha, "references": refs,
        **extra})
    spec = llm.engine.spec
    if cost_clock and spec.control is not None:
        clock, runner = Clock(), llm.engine.runner
        forward = runner.forward

        def timed(seqs, new_tokens, *a, **kw):
            clock.t += 1.0 + 0.25 * max(len(t) for t in new_tokens)
            return forward(seqs, new_tokens, *a, **kw)

        runner.forward = timed
        spec.control.clock = clock
    return llm


def _generate(llm):
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def test_engine_wrong_drafts_fall_back_to_plain_steps(tiny, recorded, caplog):
    plain, refs = recorded
    always = _oracle(tiny, refs, 0.0)
    assert _generate(always) == plain
    m0 = always.get_metrics()
    assert m0.num_plain_steps == 0 and m0.num_spec_steps == len(PROMPTS) * (MAX_TOKENS - 1)

    auto = _oracle(tiny, refs, 0.0, auto_disable=True)
    with caplog.at_level(logging.INFO, logger="speculant"):
        assert _generate(auto) == plain
    m = auto.get_metrics()
    assert m.num_spec_steps < 0.3 * m0.num_spec_steps, (m.num_spec_steps, m0.num_spec_steps)
    assert m.num_spec_steps + m.num_plain_steps == len(PROMPTS) * (MAX_TOKENS - 1)
    assert (m.num_times_disabled, m.num_times_enabled) == (1, 0)
    ctl = auto.engine.spec.control
    # probes spaced by their cost: 2 steps x 1.0 excess over a 1.25 plain step -> 64 steps
    assert ctl.num_disabled == 1 and ctl.num_probes >= 1
    assert all(b.on or b.backoff >= 1 and b.wait <= 64 for b in ctl.buckets.values())
    assert any("auto_disable: speculation off" in r.getMessage() for r in caplog.records)
    # the proposer did no work during plain steps
    assert auto.engine.spec.strategy.num_proposed == K * m.num_spec_steps


def test_engine_right_drafts_keep_speculating(tiny, recorded):
    plain, refs = recorded
    auto = _oracle(tiny, refs, 1.0, auto_disable=True)
    assert _generate(auto) == plain
    m = auto.get_metrics()
    assert (m.num_times_disabled, m.num_times_enabled) == (0, 0)
    assert m.num_plain_steps == len(PROMPTS) * WARMUP  # the warm-up's plain steps only
    assert m.num_accepted_tokens == m.num_draft_tokens > 0
    assert auto.engine.spec.control.buckets[3].on


def test_engine_wall_clock_is_lossless(tiny, recorded):
    """The real clock (timings on a shared CPU are noisy: no assertion on the decisions)."""
    plain, refs = recorded
    for alpha in (0.0, 0.6):
        llm = _oracle(tiny, refs, alpha, cost_clock=False, auto_disable=True,
                      auto_disable_interval=4)
        assert _generate(llm) == plain
        assert llm.get_metrics().num_emitted_tokens == len(PROMPTS) * (MAX_TOKENS - 1)
        assert llm.engine.spec.control.buckets[3].n_spec >= WARMUP


def test_engine_with_batch_size_disable(tiny, recorded):
    """The modifier's off steps are plain whatever the controller thinks."""
    plain, refs = recorded
    llm = _oracle(tiny, refs, 1.0, auto_disable=True, disable_by_batch_size=2)
    assert _generate(llm) == plain
    m = llm.get_metrics()
    assert m.num_spec_steps == 0 and m.num_times_disabled == 1  # the modifier's switch
    ctl = llm.engine.spec.control
    assert ctl.buckets[3].n_plain == MAX_TOKENS - 1 and ctl.num_disabled == 0


def test_engine_config_errors(tiny):
    base = {"method": "ngram", "num_speculative_tokens": 2}
    for bad in ({"auto_disable_tolerance": 2}, {"auto_disable_interval": 1},
                {"auto_disable": "maybe"}):
        with pytest.raises(StrategyError, match="auto_disable"):
            LLM(model=tiny, skip_tokenizer_init=True, speculative_config={**base, **bad})
    with pytest.raises(StrategyError, match="unknown option.*auto_disabled"):
        LLM(model=tiny, skip_tokenizer_init=True,
            speculative_config={**base, "auto_disabled": True})
    # the engine's options are not handed to the strategy's own Config (extra="forbid")
    llm = LLM(model=tiny, skip_tokenizer_init=True, speculative_config={
        **base, "auto_disable": True, "auto_disable_tolerance": 0.1, "auto_disable_interval": 8})
    ctl = llm.engine.spec.control
    assert (ctl.tolerance, ctl.interval) == (0.1, 8)
    assert LLM(model=tiny, skip_tokenizer_init=True,
               speculative_config=base).engine.spec.control is None
