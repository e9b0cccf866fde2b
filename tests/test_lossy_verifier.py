"""A verifier that is not lossless says so (issue 34, defect 7): ``Strategy.lossless``. A verifier
(or any class with its own ``verify`` / ``score``) declares it; undeclared it is treated as lossy.
A lossy one is logged as a warning naming it and its plugin when an engine starts with it,
marked ``LOSSY`` in ``speculant plugins`` and in the metrics (``SpecMetrics.lossless``); the
built-in rejection sampler declares itself lossless."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from speculant import LLM, SamplingParams, hookimpl
from speculant.hookspecs import Strategy, strategy_info
from speculant.plugin_manager import list_plugins, register, unregister
from speculant.spec_registry import StrategyError, lookup
from speculant.spec_types import VerifyResult


class Top2Verifier(Strategy):
    """Accept a draft while it is among the target's two most likely tokens (greedy only): fast,
    and not lossless: it declares so."""

    name = "top2"
    kind = "verifier"
    lossless = False

    @hookimpl
    def verify(self, batch, proposal, scores):
        tokens, accepted, row = [], [], 0
        for drafts in proposal.token_ids:
            top2 = torch.topk(scores.logits[row : row + len(drafts) + 1], 2, dim=-1).indices
            n = 0
            while n < len(drafts) and int(drafts[n]) in top2[n].tolist():
                n += 1
            tokens.append([int(d) for d in drafts[:n]] + [int(top2[n, 0])])
            accepted.append(n)
            row += len(drafts) + 1
        return VerifyResult(token_ids=tokens, num_accepted=accepted)


class UndeclaredVerifier(Top2Verifier):
    name = "undeclared"
    lossless = None  # as a class that never mentions it


class ProposerWithVerify(Strategy):
    """A proposer that also implements verify (which then overrides the built-in): it decides
    the output, so it must declare lossless too."""

    name = "sneaky"
    num_speculative_tokens = 2

    @hookimpl
    def propose(self, batch):
        return None

    @hookimpl
    def verify(self, batch, proposal, scores):
        return None


class _Plugin:
    def __init__(self, *classes):
        self.classes = classes

    @hookimpl
    def register_strategies(self, register):
        for cls in self.classes:
            register(cls)


@pytest.fixture
def plugin():
    name = register(_Plugin(Top2Verifier, UndeclaredVerifier), name="test-lossy")
    yield name
    unregister(name)


def test_contract_resolves_lossless():
    top2 = strategy_info(Top2Verifier, "p")
    assert (top2.lossless, top2.lossless_declared) == (False, True)
    undeclared = strategy_info(UndeclaredVerifier, "p")
    assert (undeclared.lossless, undeclared.lossless_declared) == (False, False)
    sneaky = strategy_info(ProposerWithVerify, "p")
    assert (sneaky.kind, sneaky.lossless) == ("proposer", False)
    ngram = lookup("ngram")  # only proposes: lossless whatever it drafts, without declaring it
    assert (ngram.lossless, ngram.lossless_declared) == (True, False)
    builtin = lookup("rejection_sampler", "verifier")
    assert (builtin.lossless, builtin.lossless_declared) == (True, True)
    bad = type("BadLossless", (Top2Verifier,), {"name": "bad", "lossless": "yes"})
    with pytest.raises(StrategyError, match=r"plugin 'p'.*`lossless` must be a bool"):
        strategy_info(bad, "p")


def _engine(tiny_llama, caplog, **spec):
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="speculant"):
        llm = LLM(model=str(tiny_llama), max_model_len=64,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3, **spec})
    return llm, [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_lossy_verifier_warns_and_is_marked_in_the_metrics(plugin, tiny_llama, caplog):
    llm, warnings = _engine(tiny_llama, caplog, acceptance_method="top2")
    lossy = [w for w in warnings if "not lossless" in w]
    assert len(lossy) == 1, warnings
    assert "verifier 'top2' of plugin 'test-lossy'" in lossy[0]
    assert "declares lossless = False" in lossy[0]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([[5, 6, 7, 5, 6, 7, 5, 6]], params, use_tqdm=False)
    m = llm.get_metrics()
    assert m.lossless is False and m.as_dict()["lossless"] is False
    assert m.num_spec_steps > 0  # it did verify

    _, warnings = _engine(tiny_llama, caplog, acceptance_method="undeclared")
    lossy = [w for w in warnings if "not lossless" in w]
    assert len(lossy) == 1 and "verifier 'undeclared'" in lossy[0], warnings
    assert "does not declare `lossless`" in lossy[0] and "treated as lossy" in lossy[0]


def test_builtin_verifier_is_lossless_and_silent(tiny_llama, caplog):
    llm, warnings = _engine(tiny_llama, caplog)
    assert not [w for w in warnings if "lossless" in w], warnings
    assert llm.engine.spec.lossless is True and llm.get_metrics().lossless is True


def test_speculant_plugins_marks_lossy_verifiers(plugin, capsys):
    from speculant.cli import main

    assert main(["plugins"]) == 0
    lines = capsys.readouterr().out.splitlines()
    line = {ln.split("'")[1]: ln for ln in lines if ln.strip().startswith("strategy ")}
    assert "[verifier, LOSSY: declared lossless = False]" in line["top2"]
    assert "[verifier, LOSSY: does not declare lossless]" in line["undeclared"]
    assert "[verifier, lossless]" in line["rejection_sampler"]
    assert "[proposer]" in line["ngram"] and "LOSSY" not in line["ngram"]
    assert main(["plugins", "--json"]) == 0
    listed = {s["name"]: s for p in json.loads(capsys.readouterr().out) for s in p["strategies"]}
    assert listed["top2"]["lossless"] is False and listed["rejection_sampler"]["lossless"] is True
    assert {s["name"]: s["lossless"] for p in list_plugins() for s in p["strategies"]}["top2"] is False
