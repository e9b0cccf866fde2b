"""batch-size-disable (``disable_by_batch_size`` / the seeds' ``speculative_disable_by_batch_size``).

The decode batch is driven over the threshold and back: a few long requests speculate, a burst of
short requests arrives (speculation off: plain steps, no proposer call), the burst finishes
(speculation back on: stateful proposers catch up on the tokens they missed). The output stays
token-for-token the plain run's, and the switches are logged and counted. Also the legacy flat
keywords of the seeds (``speculative_model="[ngram]"``, ``num_speculative_tokens=``,
``ngram_prompt_lookup_max=``, ``speculative_disable_by_batch_size=``)."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest
import torch
from test_eagle import SMALL_V, TARGET_LAYERS, make_eagle1, make_eagle3

from speculant import LLM, SamplingParams
from speculant.spec_registry import StrategyError, pop_legacy_kwargs

THRESHOLD = 3
K = 3
# small KV blocks: the step that turns speculation back on needs K more cache slots than the
# plain step before it reserved, which with 4-token blocks almost always means a new block
BLOCK = 4


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 12, (n,), generator=g).tolist()
    return [torch.randint(3, SMALL_V, (m,), generator=g).tolist() for m in lens]


# two long requests first, then a burst of six short ones
LONG = _prompts(2, seed=10)
BURST = _prompts(6, seed=11)
LONG_TOKENS, BURST_TOKENS = [40, 34], [10, 7, 12, 9, 11, 8]


def _greedy(m: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tiny_factory) -> Path:
    return tiny_factory(
        "llama", vocab_size=SMALL_V, tokenizer=False, num_hidden_layers=TARGET_LAYERS
    )


@pytest.fixture(scope="module")
def plain(target) -> list[list[int]]:
    llm = LLM(model=str(target), skip_tokenizer_init=True, max_num_seqs=8)
    params = [_greedy(m) for m in LONG_TOKENS + BURST_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in LONG + BURST], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def specs(target, tmp_path_factory) -> dict[str, dict]:
    d = tmp_path_factory.mktemp("bsd")
    return {
        "ngram": {"method": "ngram", "prompt_lookup_max": 3},
        "eagle": {"model": str(make_eagle1(d / "e1", target, SMALL_V, copy=True, seed=2))},
        "eagle3": {"model": str(make_eagle3(d / "e3", SMALL_V, SMALL_V, target=target, seed=3))},
        "draft_model": {"model": str(target)},  # the target as its own draft
    }


class Trace:
    """Per decode step: (batch size, speculation on?, propose() calls); the run's accepted
    draft tokens after each step."""

    def __init__(self, llm: LLM) -> None:
        self.steps: list[tuple[int, bool, int]] = []
        self.accepted: list[int] = []
        self.drafted: list[int] = []
        self.proposed: list[int] = []  # batch sizes propose() was called with
        spec = llm.engine.spec
        real_step = spec.step

        def step(seqs):
            n_before = len(self.proposed)
            real_step(seqs)
            self.steps.append((len(seqs), spec.enabled, len(self.proposed) - n_before))
            self.accepted.append(spec.total.num_accepted_tokens)
            self.drafted.append(spec.total.num_draft_tokens)

        def before(hook_name, hook_impls, kwargs):
            if hook_name == "propose":
                self.proposed.append(len(kwargs["batch"]))

        spec.step = step
        spec.pm.add_hookcall_monitoring(before, lambda *a: None)


def _drive(llm: LLM) -> list[list[int]]:
    """Run LONG, and once they are a few steps in add BURST; return outputs in LONG + BURST order."""
    eng, done = llm.engine, {}
    for i, (p, m) in enumerate(zip(LONG, LONG_TOKENS)):
        eng.add_request(f"long{i}", None, p, _greedy(m))
    for _ in range(5):
        for out in eng.step():
            done[out.request_id] = out
    for i, (p, m) in enumerate(zip(BURST, BURST_TOKENS)):
        eng.add_request(f"burst{i}", None, p, _greedy(m))
    while eng.has_unfinished_requests():
        for out in eng.step():
            done[out.request_id] = out
    ids = [f"long{i}" for i in range(len(LONG))] + [f"burst{i}" for i in range(len(BURST))]
    return [list(done[i].outputs[0].token_ids) for i in ids]


@pytest.mark.parametrize("method", ["ngram", "eagle", "eagle3", "draft_model"])
def test_off_over_the_threshold_and_back_on(target, plain, specs, method, caplog):
    llm = LLM(
        model=str(target),
        skip_tokenizer_init=True,
        max_num_seqs=8,
        block_size=BLOCK,
        speculative_config={
            **specs[method],
            "num_speculative_tokens": K,
            "disable_by_batch_size": THRESHOLD,
        },
    )
    assert llm.engine.spec.name == method
    trace = Trace(llm)
    with caplog.at_level(logging.INFO, logger="speculant"):
        assert _drive(llm) == plain

    sizes = [n for n, _, _ in trace.steps]
    assert max(sizes) > THRESHOLD and sizes[0] <= THRESHOLD and sizes[-1] <= THRESHOLD
    for n, on, proposed in trace.steps:
        assert on == (n <= THRESHOLD), trace.steps
        if not on:
            assert proposed == 0, "a proposer ran while speculation was off"
    assert trace.proposed and max(trace.proposed) <= THRESHOLD
    # speculation ran before the burst, and again after it
    first_off = next(i for i, (_, on, _) in enumerate(trace.steps) if not on)
    last_off = max(i for i, (_, on, _) in enumerate(trace.steps) if not on)
    assert any(p for _, _, p in trace.steps[:first_off])
    assert any(p for _, _, p in trace.steps[last_off + 1 :])

    # switches counted in the run metrics and by the modifier, and logged
    switches_off = sum(1 for a, b in zip(trace.steps, trace.steps[1:]) if a[1] and not b[1])
    switches_on = sum(1 for a, b in zip(trace.steps, trace.steps[1:]) if not a[1] and b[1])
    assert switches_off >= 1 and switches_on >= 1
    m = llm.get_metrics()
    assert (m.num_times_disabled, m.num_times_enabled) == (switches_off, switches_on)
    modifier = llm.engine.spec.pm.get_plugin("modifier:batch_size_disable")
    assert (modifier.num_disabled, modifier.num_enabled) == (switches_off, switches_on)
    assert m.num_plain_steps >= sum(n for n, on, _ in trace.steps if not on)
    logged = [r.getMessage() for r in caplog.records if "batch_size_disable" in r.getMessage()]
    assert sum("speculation off" in r for r in logged) == switches_off, logged
    assert sum("speculation back on" in r for r in logged) == switches_on, logged
    # the proposers work again after the burst (the stateful ones caught up on the tokens they
    # missed): drafts are accepted after speculation came back
    late_accepted = trace.accepted[-1] - trace.accepted[last_off]
    late_drafted = trace.drafted[-1] - trace.drafted[last_off]
    assert late_accepted > 0, trace.accepted
    if method == "draft_model":  # the target as its own draft, back in sync: all accepted
        assert late_accepted == late_drafted


def test_threshold_itself_still_speculates(target, plain, specs):
    """vLLM's semantics: off only while the batch is LARGER than the threshold."""
    llm = LLM(
        model=str(target),
        skip_tokenizer_init=True,
        max_num_seqs=8,
        block_size=BLOCK,
        speculative_config={
            **specs["ngram"],
            "num_speculative_tokens": K,
            "disable_by_batch_size": len(LONG) + len(BURST),
        },
    )
    trace = Trace(llm)
    assert _drive(llm) == plain
    assert all(on for _, on, _ in trace.steps)
    m = llm.get_metrics()
    assert (m.num_times_disabled, m.num_times_enabled) == (0, 0) and m.num_spec_steps > 0


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_draft_context_survives_the_off_period(target, specs, method):
    """While speculation is off the target's hidden states keep being collected, so when it
    comes back the EAGLE head catches up on every position it missed: each draft after the burst
    equals what the published EAGLE forward proposes from the FULL context (a head whose context
    restarted at the re-enable point would draft differently)."""
    from test_eagle import Reference

    llm = LLM(
        model=str(target),
        skip_tokenizer_init=True,
        max_num_seqs=8,
        block_size=BLOCK,
        speculative_config={
            **specs[method],
            "num_speculative_tokens": K,
            "disable_by_batch_size": THRESHOLD,
        },
    )
    trace = Trace(llm)
    seen = []
    real = llm.engine.spec._propose

    def spy(batch):
        prop = real(batch)
        seen.append((len(trace.steps), [list(s.token_ids) for s in batch.seqs], prop.token_ids))
        return prop

    llm.engine.spec._propose = spy
    _drive(llm)
    last_off = max(i for i, (_, on, _) in enumerate(trace.steps) if not on)
    ref = Reference(target, Path(specs[method]["model"]), 1 if method == "eagle" else 3)
    checked = 0
    for step, token_lists, drafts in seen:
        if step <= last_off:
            continue
        for toks, got in zip(token_lists, drafts):
            for g, (w, margin) in zip(got, ref.drafts(toks, len(got))):
                if margin < 1e-3:
                    break
                assert g == w, (step, toks, got)
                checked += 1
    assert checked >= 10, checked


# --------------------------------------------------------------------------------------------
# the seeds' legacy flat keywords
# --------------------------------------------------------------------------------------------
def test_legacy_flat_keywords(target, plain):
    prompts = [{"prompt_token_ids": p} for p in LONG + BURST]
    params = [_greedy(m) for m in LONG_TOKENS + BURST_TOKENS]
    with pytest.warns(DeprecationWarning, match="speculative_config"):
        llm = LLM(
            model=str(target),
            skip_tokenizer_init=True,
            max_num_seqs=8,
            block_size=BLOCK,
            speculative_model="[ngram]",
            num_speculative_tokens=2,
            ngram_prompt_lookup_max=2,
            speculative_disable_by_batch_size=THRESHOLD,
        )
    spec = llm.engine.spec
    assert spec.name == "ngram" and spec.k == 2
    assert spec.strategy_config.prompt_lookup_max == 2
    assert spec.spec_config.disable_by_batch_size == THRESHOLD
    trace = Trace(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == plain
    # eight requests at once, then fewer as they finish: off first, then back on
    assert trace.steps[0][:2] == (8, False) and trace.steps[-1][1] is True
    assert llm.get_metrics().num_times_enabled == 1


def test_legacy_keywords_translation_and_errors(target, specs):
    with pytest.warns(DeprecationWarning) as w:
        got = pop_legacy_kwargs(
            {
                "speculative_model": "x",
                "num_speculative_tokens": 4,
                "ngram_prompt_lookup_max": 5,
                "ngram_prompt_lookup_min": 2,
                "speculative_disable_by_batch_size": 7,
                "seed": 1,
            }
        )
    assert got == {
        "model": "x",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 5,
        "prompt_lookup_min": 2,
        "disable_by_batch_size": 7,
    }
    assert "speculative_disable_by_batch_size" in str(w[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pop_legacy_kwargs({"seed": 1}) is None  # nothing legacy: no warning
    # a path alone infers the method, through the legacy keyword too
    with pytest.warns(DeprecationWarning):
        llm = LLM(
            model=str(target),
            skip_tokenizer_init=True,
            speculative_model=specs["eagle"]["model"],
            num_speculative_tokens=2,
        )
    assert llm.engine.spec.name == "eagle"
    with (
        pytest.raises(ValueError, match="either speculative_config or the legacy"),
        pytest.warns(DeprecationWarning),
    ):
        LLM(
            model=str(target),
            skip_tokenizer_init=True,
            speculative_model="[ngram]",
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )
    with pytest.raises(StrategyError, match="disable_by_batch_size"):
        LLM(
            model=str(target),
            skip_tokenizer_init=True,
            speculative_config={
                "method": "ngram",
                "num_speculative_tokens": 2,
                "disable_by_batch_size": 0,
            },
        )
