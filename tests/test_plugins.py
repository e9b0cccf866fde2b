"""Plugin framework: entry-point discovery, throwaway plugins, garbage proposals, the CLI."""

from __future__ import annotations

import importlib.metadata as md
import json
import subprocess
import sys

import pytest

from speculant import LLM, Proposal, SamplingParams, hookimpl
from speculant.engine.spec_decode import ProposalError
from speculant.plugin_manager import (
    ENTRY_POINT_GROUP,
    get_plugin_manager,
    list_plugins,
    register,
    unregister,
)
from speculant.spec_registry import StrategyError, available_strategies

BUILTINS = {"ngram", "rejection_sampler"}


def test_builtins_load_through_entry_points():
    eps = {ep.name: ep for ep in md.entry_points(group=ENTRY_POINT_GROUP)}
    assert BUILTINS <= set(eps), "every built-in strategy is its own entry point"
    for name in BUILTINS:
        assert eps[name].dist.name == "speculant"
        assert get_plugin_manager().has_plugin(name)


def test_example_package_is_installed_and_discovered():
    eps = {ep.name: ep for ep in md.entry_points(group=ENTRY_POINT_GROUP)}
    assert "bigram" in eps, "examples/speculant-bigram must be installed (see README)"
    assert eps["bigram"].dist.name == "speculant-bigram"
    assert "bigram" in available_strategies("proposer")


def test_example_plugin_runs_lossless(tiny_llama):
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 9, 10]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(model=str(tiny_llama)).generate(prompts, params, use_tqdm=False)
    llm = LLM(model=str(tiny_llama), speculative_config={"method": "bigram", "num_speculative_tokens": 3})
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.spec.strategy.calls > 0
    assert llm.get_metrics().num_draft_tokens > 0


class _Throwaway:
    """A plugin module stand-in registering one strategy."""

    def __init__(self, strategy_cls):
        self.strategy_cls = strategy_cls

    @hookimpl
    def register_strategies(self, register):
        register(self.strategy_cls)


@pytest.fixture
def throwaway():
    names = []

    def add(strategy_cls):
        names.append(register(_Throwaway(strategy_cls), name=f"test-{strategy_cls.name}"))

    yield add
    for n in names:
        unregister(n)
    assert not any(n in available_strategies() for n in ("echo_last", "garbage_oov", "garbage_long"))


def _make(name, fn):
    return type(name, (), {"name": name, "num_speculative_tokens": 3,
                           "__init__": lambda self, cfg, ctx: None,
                           "propose": hookimpl(fn)})


def test_registered_plugin_proposes_and_engine_uses_it(throwaway, tiny_llama):
    calls = []

    def propose(self, batch):
        calls.append(len(batch))
        # propose the last token repeated: sometimes right, often wrong
        return Proposal(token_ids=[[s.token_ids[-1]] * s.max_draft for s in batch.seqs])

    throwaway(_make("echo_last", propose))
    assert "echo_last" in available_strategies()
    names = [p["name"] for p in list_plugins()]
    assert "test-echo_last" in names
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [[1, 2, 3, 3, 3], [4, 4, 4, 4]]
    plain = LLM(model=str(tiny_llama)).generate(prompts, params, use_tqdm=False)
    llm = LLM(model=str(tiny_llama), speculative_config={"method": "echo_last", "num_speculative_tokens": 3})
    out = llm.generate(prompts, params, use_tqdm=False)
    assert calls, "the engine never called the plugin's propose"
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    assert llm.get_metrics().num_draft_tokens == 3 * sum(calls) or llm.get_metrics().num_draft_tokens > 0


@pytest.mark.parametrize(
    "name,drafts,message",
    [
        ("garbage_oov", lambda s: [10**9], "outside the vocabulary"),
        ("garbage_long", lambda s: [1] * (s.max_draft + 2), "more than its limit"),
    ],
)
@pytest.mark.slow
def test_garbage_proposals_get_a_clear_error(throwaway, tiny_llama, name, drafts, message,
                                            caplog):
    """A garbage proposal is a contained fault (docs/hooks.md "Faults"): logged naming the
    strategy and the problem, counted, the request decodes plain (same tokens)."""
    throwaway(_make(name, lambda self, batch: Proposal(token_ids=[drafts(s) for s in batch.seqs])))
    params = SamplingParams(temperature=0, max_tokens=8)
    plain = LLM(model=str(tiny_llama)).generate([[1, 2, 3]], params, use_tqdm=False)
    llm = LLM(model=str(tiny_llama), speculative_config={"method": name, "num_speculative_tokens": 3})
    with caplog.at_level("WARNING", logger="speculant"):
        out = llm.generate([[1, 2, 3]], params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    faults = [r.getMessage() for r in caplog.records if "fault" in r.getMessage()]
    assert len(faults) == 1 and name in faults[0] and message in faults[0], faults
    assert llm.get_metrics().num_faults == 1 == out[0].metrics.num_faults
    assert issubclass(ProposalError, RuntimeError)  # still importable


def test_misspelt_hook_fails_loudly(tiny_llama):
    class Bad:
        @hookimpl
        def propse(self, batch):  # typo on purpose
            return None

    pm = get_plugin_manager()
    with pytest.raises(Exception) as e:
        register(Bad(), name="test-misspelt")
    assert "propse" in str(e.value)
    if pm.has_plugin("test-misspelt"):
        unregister("test-misspelt")


def test_unknown_method_lists_installed_strategies(tiny_llama):
    with pytest.raises(StrategyError) as e:
        LLM(model=str(tiny_llama), speculative_config={"method": "ngarm", "num_speculative_tokens": 3})
    msg = str(e.value)
    assert "ngarm" in msg and "ngram" in msg and "bigram" in msg


@pytest.mark.slow
def test_cli_plugins_lists_versions_and_hooks():
    out = subprocess.run([sys.executable, "-m", "speculant.cli", "plugins", "--json"],
                         capture_output=True, text=True, check=True)
    data = {p["name"]: p for p in json.loads(out.stdout)}
    assert data["ngram"]["distribution"] == "speculant"
    assert data["ngram"]["version"]
    assert "register_strategies" in data["ngram"]["hooks"]
    assert data["ngram"]["strategies"][0]["hooks"] == ["on_requests_finished", "propose"]
    assert data["bigram"]["distribution"] == "speculant-bigram"


@pytest.mark.slow  # two interpreters (~6 s busy)
def test_block_list_env_hides_a_plugin():
    code = ("from speculant.spec_registry import available_strategies;"
            "print(sorted(available_strategies()))")
    env = {**__import__("os").environ, "SPECULANT_DISABLE_PLUGINS": "bigram"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert "bigram" not in out.stdout and "ngram" in out.stdout
    env = {**env, "SPECULANT_DISABLE_PLUGINS": "", "SPECULANT_PLUGINS": "ngram,rejection_sampler"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert "bigram" not in out.stdout and "ngram" in out.stdout


def test_strategy_on_batch_size_change_hook_turns_speculation_off(throwaway, tiny_llama):
    """A strategy's own ``on_batch_size_change`` is called on every batch-size change (old and
    new size), and returning False makes the step plain: no ``propose`` calls, same tokens."""
    changes, proposed = [], []

    def propose(self, batch):
        proposed.append(len(batch))
        return Proposal(token_ids=[[s.token_ids[-1]] * s.max_draft for s in batch.seqs])

    def on_batch_size_change(self, old_size, new_size):
        changes.append((old_size, new_size))
        return new_size < 2  # off while two or more sequences run

    cls = _make("size_gated", propose)
    cls.on_batch_size_change = hookimpl(on_batch_size_change)
    throwaway(cls)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (6, 20)]
    prompts = [[1, 2, 3, 3, 3], [4, 4, 4, 4]]
    plain = LLM(model=str(tiny_llama)).generate(prompts, params, use_tqdm=False)
    llm = LLM(model=str(tiny_llama), speculative_config={"method": "size_gated", "num_speculative_tokens": 3})
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    assert changes[0] == (0, 2) and (2, 1) in changes, changes
    # proposals only once the batch shrank to one sequence
    assert proposed and set(proposed) == {1}
    m = llm.get_metrics()
    assert m.num_times_enabled == 1 and m.num_draft_tokens > 0


def test_builtins_follow_the_strategy_contract():
    """Every built-in strategy (and the example package's) subclasses hookspecs.Strategy, and the
    registry reads each through strategy_info, plugin name included."""
    from speculant.hookspecs import Strategy
    from speculant.plugin_manager import collect_strategies
    from speculant.spec_registry import lookup

    infos = {i.name: i for i in collect_strategies()}
    for name in ("ngram", "oracle", "batch_size_disable", "rejection_sampler", "bigram"):
        assert issubclass(infos[name].cls, Strategy), name
    assert infos["rejection_sampler"].kind == "verifier"
    assert infos["rejection_sampler"].lossless and infos["rejection_sampler"].lossless_declared
    assert infos["batch_size_disable"].kind == "modifier"
    ngram = lookup("prompt_lookup")  # an alias
    assert ngram.name == "ngram" and ngram.plugin == "ngram" and ngram.Config is not None
    assert (ngram.needs_hidden_states, ngram.aux_hidden_layers) == (False, ())
    with pytest.raises(StrategyError, match="installed verifier strategies: .*rejection_sampler"):
        lookup("ngram", "verifier")


@pytest.mark.parametrize("attr,value", [
    ("aliases", "one_string"), ("kind", "drafter"), ("Config", dict),
    ("num_speculative_tokens", 0), ("needs_hidden_states", "yes"), ("aux_hidden_layers", [1, -2]),
    ("default_for_model", 1), ("matches_model", True), ("lossless", "yes"),
])
def test_a_contract_breach_names_the_plugin_and_the_attribute(throwaway, attr, value):
    cls = _make("bad_attr", lambda self, batch: None)
    setattr(cls, attr, value)
    throwaway(cls)
    with pytest.raises(StrategyError) as e:
        available_strategies()
    unregister("test-bad_attr")  # before the fixture's own check looks the strategies up
    assert "plugin 'test-bad_attr'" in str(e.value) and f"`{attr}`" in str(e.value)


def test_contract_checks_what_init_sets(throwaway, tiny_llama):
    """needs_hidden_states / aux_hidden_layers / num_speculative_tokens may be set in __init__;
    they are checked there too, and a plain class (no Strategy base) keeps the defaults."""
    from speculant.hookspecs import strategy_info

    def init(self, cfg, ctx):
        self.needs_hidden_states = 1  # not a bool

    cls = _make("bad_init", lambda self, batch: None)
    cls.__init__ = init
    throwaway(cls)
    with pytest.raises(StrategyError, match=r"'test-bad_init'.*`needs_hidden_states` must be a bool"):
        LLM(model=str(tiny_llama), speculative_config={"method": "bad_init"})
    plain = _make("plain", lambda self, batch: None)
    info = strategy_info(plain(None, None), "p")
    assert (info.num_speculative_tokens, info.kind, info.aliases) == (None, "proposer", ())
    assert strategy_info(plain).num_speculative_tokens == 3  # the class default
    assert info.matches_model(None, {}) is False
