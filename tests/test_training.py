"""speculant.training (docs/training.md): every trainable method learns on self-distillation data
of a tiny random Llama (its loss falls), writes a checkpoint that ``speculative_config={"method":
..., "model": out}`` loads unchanged and whose greedy output equals plain decoding; training
resumes where its saved state left off; eval-acceptance writes its table, JSON and plot; the
``speculant train`` / ``eval-acceptance`` commands run the same code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from speculant import LLM, SamplingParams
from speculant.training import (
    TargetInfo,
    Trainable,
    TrainConfig,
    build_dataset,
    eval_acceptance,
    make_head,
    prompt_set,
    train_head,
)
from speculant.training.prompts import CATEGORIES, SPLITS

HEAD_OPTIONS = {"eagle": {"steps": 3}, "mlp_speculator": {"n_predict": 2},
                "medusa": {"num_heads": 2}}


@pytest.fixture(scope="module")
def target(tiny_factory) -> Path:
    return tiny_factory("llama")


@pytest.fixture(scope="module")
def data(target, tmp_path_factory):
    cache = tmp_path_factory.mktemp("distill")
    ds = build_dataset(str(target), "train", num_prompts=8, max_new_tokens=24, cache_dir=cache,
                       progress=False)
    again = build_dataset(str(target), "train", num_prompts=8, max_new_tokens=24,
                          cache_dir=cache, progress=False)  # from the cache file
    assert len(list(cache.iterdir())) == 1
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(ds.examples, again.examples))
    return ds


def test_prompt_sets_cover_every_category_and_never_share_a_prompt():
    from speculant.training.prompts import GROUNDED

    sets = {s: prompt_set(s) for s in SPLITS}
    for s in SPLITS:
        assert {p.category for p in sets[s]} == set(CATEGORIES) | ({GROUNDED} if s == "train"
                                                                    else set())
        assert {p.category for p in sets[s][:4]} == set(CATEGORIES)  # interleaved
    assert len(sets["held-out"]) == 84
    assert not {p.text for p in sets["train"]} & {p.text for p in sets["held-out"]}
    with pytest.raises(ValueError, match="unknown prompt split"):
        prompt_set("test")


def test_train_prompts_are_1500_balanced_then_grounded_distinct_and_share_no_held_out_topic():
    from speculant.demo import CODE, PASSAGE
    from speculant.training import prompts as P

    train = prompt_set("train")
    texts = [p.text for p in train]
    assert len(texts) == len(set(texts)) == 4 * P.TRAIN_PER_CATEGORY + P.TRAIN_GROUNDED == 2000
    for c in CATEGORIES:
        assert sum(p.category == c for p in train[:1500]) == P.TRAIN_PER_CATEGORY
    assert {p.category for p in train[1500:]} == {P.GROUNDED}
    for demo_text in (CODE.strip(), PASSAGE, "moving_average", "Rhine"):  # the demo's own text
        assert not [t for t in texts if demo_text in t], demo_text
    assert texts == [p.text for p in prompt_set("train")]  # deterministic
    held_topics = (P._split(P._CHAT_TOPICS, "held-out") + P._split(P._CODE_TASKS, "held-out")
                   + [s for s, _, _ in P._split(P._SUMMARY_SUBJECTS, "held-out")])
    held_items = P._split(P._MATH_ITEMS, "held-out")
    assert len(held_topics) == 22 and len(held_items) == 4
    for topic in held_topics:
        assert not [t for t in texts if topic in t], topic
    for item in held_items:  # a whole word: "cards" is a train item, "postcards" too
        assert not [t for t in texts if f" {item}" in t], item
    for held in prompt_set("held-out"):
        assert held.text not in texts


def test_an_interrupted_build_continues_from_its_saved_chunks(target, data, tmp_path,
                                                              monkeypatch):
    from speculant.training import data as D

    real, calls = D._distill, []

    def distill(*args, **kw):
        calls.append(len(args[1]))
        if len(calls) == 2:
            raise KeyboardInterrupt  # the session ends during the second chunk
        return real(*args, **kw)

    monkeypatch.setattr(D, "CHUNK", 4)
    monkeypatch.setattr(D, "_distill", distill)
    with pytest.raises(KeyboardInterrupt):
        build_dataset(str(target), "train", 8, 24, cache_dir=tmp_path, progress=False)
    assert [f.name.split("-")[1] for f in tmp_path.iterdir()] == ["part"]
    ds = build_dataset(str(target), "train", 8, 24, cache_dir=tmp_path, progress=False)
    assert calls == [4, 4, 4]  # the first chunk came from its file
    assert [f.name.split("-")[1] for f in tmp_path.iterdir()] == ["train"]  # parts removed
    assert [e.tokens.tolist() for e in ds.examples] == [e.tokens.tolist() for e in data.examples]


def test_dataset_holds_the_targets_greedy_replies_and_their_features(target, data):
    """The reply tokens are the target's greedy continuation, and the final hidden state at each
    position gives (through the target's LM head) the next token of the reply."""
    info = TargetInfo.load(target)
    assert data.num_tokens > 0 and data.hidden_size == info.hidden_size
    e = data.examples[0]
    logits = e.final.float() @ info.lm_head.T  # [T, V]
    pred = logits.argmax(-1)[e.start - 1:-1]  # the token each position produced
    assert (pred == e.tokens[e.start:]).float().mean() > 0.95  # fp16 features: near ties aside


def replies(llm: LLM) -> list[list[int]]:
    """Greedy replies of ``llm`` to three held-out prompts."""
    params = SamplingParams(temperature=0.0, max_tokens=24)
    prompts = [[{"role": "user", "content": p.text}] for p in prompt_set("held-out")[:3]]
    return [o.outputs[0].token_ids for o in llm.chat(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain(target) -> list[list[int]]:
    return replies(LLM(model=str(target)))


# the default run trains EAGLE (~5 s on a busy 2-core machine); the other two are slow
@pytest.mark.parametrize("method", ["eagle", pytest.param("mlp_speculator", marks=pytest.mark.slow),
                                    pytest.param("medusa", marks=pytest.mark.slow)])
def test_each_method_learns_and_its_checkpoint_runs_losslessly(method, target, data, plain,
                                                              tmp_path):
    from speculant.spec_registry import available_strategies

    if method not in available_strategies():
        pytest.skip(f"strategy {method!r} not installed (examples/speculant-medusa)")
    torch.manual_seed(0)
    head = make_head(method, TargetInfo.load(target), **HEAD_OPTIONS[method])
    assert isinstance(head, Trainable)
    out = tmp_path / method
    cfg = TrainConfig(steps=20, batch_size=4, lr=3e-3, warmup=3, save_dtype="float32")
    res = train_head(head, data, out, cfg, progress=False, device="cpu")
    losses = [h["loss"] for h in res.history]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.9 * first, (method, losses)
    assert len(res.history[-1]["acc"]) == head.num_positions
    assert (out / "loss.png").stat().st_size > 0 and (out / "trainer_state.pt").exists()
    assert len(json.loads((out / "history.json").read_text())) == 20

    llm = LLM(model=str(target), speculative_config={"method": method, "model": str(out)})
    assert replies(llm) == plain
    m = llm.get_metrics()
    assert m.num_draft_tokens > 0


def test_eagle3_learns_on_layer_inputs_and_its_checkpoint_runs_losslessly(tiny_factory, tmp_path):
    """EAGLE-3 reads three target layers' inputs: a 4-layer target, data with aux_layers, a
    draft vocabulary of the 96 most frequent reply tokens written as d2t."""
    from speculant.training import train

    deep = tiny_factory("llama", num_hidden_layers=4)
    out = tmp_path / "eagle3"
    res = train("eagle3", out, str(deep), num_prompts=8, max_new_tokens=24,
                head_options={"steps": 2, "aux_layers": [0, 1, 3], "hot_vocab": 96}, steps=20,
                batch_size=4, lr=3e-3, warmup=3, save_dtype="float32", progress=False,
                device="cpu", cache_dir=tmp_path / "data")
    losses = [h["loss"] for h in res.history]
    assert sum(losses[-3:]) < 0.9 * sum(losses[:3]), losses
    assert len(res.history[-1]["acc"]) == 2
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 96
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 3]

    llm = LLM(model=str(deep), speculative_config={"model": str(out)})  # method inferred
    strategy = llm.engine.spec.strategy
    assert strategy.name == "eagle3" and strategy.aux_hidden_layers == (0, 1, 3)
    assert replies(llm) == replies(LLM(model=str(deep)))
    assert llm.get_metrics().num_accepted_tokens > 0  # the trained head drafts the target's tokens
    with pytest.raises(ValueError, match="aux_layers needs 3 distinct target layers"):
        make_head("eagle3", TargetInfo.load(deep), aux_layers=(0, 9, 1))


@pytest.mark.slow  # two short training runs: CI's slow run keeps it
def test_resume_continues_exactly(target, data, tmp_path):
    def run(out: Path, resume: bool, stop_at: int | None = None) -> dict:
        torch.manual_seed(0)
        head = make_head("mlp_speculator", TargetInfo.load(target), n_predict=2)
        cfg = TrainConfig(steps=6, batch_size=2, lr=1e-3, warmup=2, checkpoint_every=2)
        res = train_head(head, data, out, cfg, resume=resume, progress=False, device="cpu",
                         stop_at=stop_at)
        return {"head": head.state_dict(), "history": res.history}

    whole = run(tmp_path / "whole", False)
    assert len(run(tmp_path / "parts", False, stop_at=3)["history"]) == 3
    resumed = run(tmp_path / "parts", True)
    assert [h["step"] for h in resumed["history"]] == list(range(1, 7))
    for a, b in zip(whole["history"], resumed["history"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    for k, v in whole["head"].items():
        torch.testing.assert_close(resumed["head"][k], v)
    torch.manual_seed(0)
    head = make_head("mlp_speculator", TargetInfo.load(target), n_predict=2)
    with pytest.raises(ValueError, match="other training settings"):
        train_head(head, data, tmp_path / "parts", TrainConfig(steps=8, batch_size=3),
                   resume=True, progress=False, device="cpu")


def test_unknown_method_names_the_trainable_ones(target):
    with pytest.raises(ValueError, match="trainable: .*eagle"):
        make_head("ngram", TargetInfo.load(target))


def test_eval_acceptance_writes_table_json_and_plot(target, tmp_path, capsys):
    res = eval_acceptance({"method": "ngram", "num_speculative_tokens": 3}, model=str(target),
                          num_prompts=1, max_tokens=16, out=tmp_path)
    table = capsys.readouterr().out
    assert set(res["categories"]) == set(CATEGORIES)
    assert res["all"]["identical"] is True
    assert res["all"]["tokens_per_forward"] >= 1.0
    saved = json.loads((tmp_path / "acceptance.json").read_text())
    assert saved["all"] == res["all"]
    assert (tmp_path / "acceptance.png").stat().st_size > 0
    for c in (*CATEGORIES, "all"):
        assert c in table


class SkipOneHead(torch.nn.Module):
    """A third-party head: one linear map from h_p to the token after next, t_{p+2}."""

    method = "skip_one"
    num_positions = 1
    aux_layers = ()

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.out = torch.nn.Linear(hidden, vocab, bias=False)
        self.saved: Path | None = None

    def loss(self, batch):
        from speculant.training.heads import HeadLoss, shifted, token_loss

        ce, hits, n = token_loss(batch.final, self.out.weight, shifted(batch.tokens, 2),
                                 shifted(batch.target, 2, False))
        return HeadLoss(ce, hits[None], n[None])

    def save_pretrained(self, out: Path, dtype=torch.float16) -> None:
        from safetensors.torch import save_file

        save_file({"out.weight": self.out.weight.detach().to(dtype)}, str(out / "head.safetensors"))
        self.saved = out


def test_a_third_party_head_trains_through_the_same_loop(data, tmp_path):
    torch.manual_seed(0)
    head = SkipOneHead(data.hidden_size, data.vocab_size)
    assert isinstance(head, Trainable)
    res = train_head(head, data, tmp_path, TrainConfig(steps=15, batch_size=4, lr=1e-2, warmup=0,
                                                       eval_every=5),
                     progress=False, device="cpu", val_data=data)
    assert res.history[-1]["loss"] < 0.8 * res.history[0]["loss"]
    val = [h for h in res.history if "val_loss" in h]
    assert [h["step"] for h in val] == [5, 10, 15] and len(val[0]["val_acc"]) == 1
    assert val[-1]["val_loss"] < val[0]["val_loss"]  # evaluated on the training data itself
    assert head.saved == tmp_path and (tmp_path / "head.safetensors").exists()


@pytest.mark.slow  # a training run and an evaluation through the CLI (~4 s)
def test_cli_train_then_eval_acceptance(target, tmp_path, capsys):
    from speculant.cli import main

    out = tmp_path / "mlp"
    assert main(["train", "mlp_speculator", "--model", str(target), "--out", str(out),
                 "--steps", "4", "--batch-size", "2", "--num-prompts", "4",
                 "--max-new-tokens", "8", "--head-options", '{"n_predict": 2}',
                 "--val-prompts", "1", "--eval-every", "2"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["n_predict"] == 2
    assert len(list((out / "data").glob("distill-train-*.pt"))) == 1
    assert len(list((out / "data").glob("distill-held-out-*.pt"))) == 1
    history = json.loads((out / "history.json").read_text())
    assert [h["step"] for h in history if "val_loss" in h] == [2, 4]
    spec = json.dumps({"method": "mlp_speculator", "model": str(out)})
    assert main(["eval-acceptance", "--model", str(target), "--spec", spec, "--num-prompts", "1",
                 "--max-tokens", "8", "--out", str(tmp_path / "acc")]) == 0
    assert "tok/fwd" in capsys.readouterr().out
    assert json.loads((tmp_path / "acc" / "acceptance.json").read_text())["all"]["identical"]
    assert main(["train", "ngram", "--model", str(target), "--out", str(tmp_path / "x")]) == 2


@pytest.mark.slow  # a training run (~3 s busy)
def test_eagle_hot_vocab_writes_a_token_map_that_loads(target, plain, tmp_path):
    from speculant.training import train

    out = tmp_path / "eagle-hot"
    res = train("eagle", out, str(target), num_prompts=8, max_new_tokens=24,
                head_options={"steps": 2, "hot_vocab": 64}, steps=4, batch_size=4,
                progress=False, device="cpu", cache_dir=tmp_path / "data")
    assert len(res.history) == 4
    ids = json.loads((out / "token_map.json").read_text())
    assert len(ids) == 64 and ids == sorted(ids)
    llm = LLM(model=str(target), speculative_config={
        "method": "eagle", "model": str(out), "token_map": str(out / "token_map.json")})
    assert replies(llm) == plain
    # without the option, the folder's token_map.json is picked up
    auto = LLM(model=str(target), speculative_config={"method": "eagle", "model": str(out)})
    assert auto.engine.spec.strategy.hot is not None
    assert replies(auto) == plain
    with pytest.raises(ValueError, match="hot_vocab is for methods 'eagle' and 'eagle3' only"):
        train("medusa", tmp_path / "m", str(target), head_options={"hot_vocab": 8})


def test_the_seed_fixes_the_heads_initial_weights(target, tmp_path):
    """Two runs of the same arguments (seed 0) start from the same head: the same first loss."""
    from speculant.training import train

    def first_loss(name: str) -> float:
        torch.manual_seed(len(name))  # whatever the process's generator holds before
        res = train("eagle", tmp_path / name, str(target), num_prompts=4, max_new_tokens=16,
                    head_options={"steps": 2, "hot_vocab": 32}, steps=1, batch_size=2,
                    progress=False, device="cpu", cache_dir=tmp_path / "data")
        return res.history[0]["loss"]

    assert first_loss("a") == first_loss("bb")


def test_threads_are_in_force_for_hidden_states_and_training_then_restored(target, tmp_path,
                                                                            monkeypatch):
    """``cpu_threads`` (``torch_threads``): the hidden-state pass and the training steps run on the count asked for
    (``--cpu-threads`` too; default every available CPU); the process's count is restored after
    (a CPU engine keeps its own), and a bad count is refused."""
    from speculant.cli import main
    from speculant.engine.cpu_threads import available_cpus, torch_threads
    from speculant.training import api
    from speculant.training import data as data_mod

    seen = []
    real_hidden, real_loop = data_mod._hidden_states, api.train_head

    def hidden(*a, **k):
        seen.append(("hidden", torch.get_num_threads()))
        return real_hidden(*a, **k)

    def loop(*a, **k):
        seen.append(("train", torch.get_num_threads()))
        return real_loop(*a, **k)

    monkeypatch.setattr(data_mod, "_hidden_states", hidden)
    monkeypatch.setattr(api, "train_head", loop)
    before = torch.get_num_threads()
    args = ["train", "medusa", "--model", str(target), "--steps", "1", "--batch-size", "2",
            "--num-prompts", "2", "--max-new-tokens", "4", "--head-options",
            '{"num_heads": 1}']
    assert main([*args, "--out", str(tmp_path / "a"), "--cpu-threads", "1"]) == 0
    assert seen == [("hidden", 1), ("train", 1)]
    assert torch.get_num_threads() == before
    seen.clear()
    assert main([*args, "--out", str(tmp_path / "b")]) == 0
    assert seen == [("hidden", available_cpus()), ("train", available_cpus())]
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="cpu_threads=0 must be >= 1"):
        with torch_threads(0):
            pass


@pytest.mark.slow  # two spawned engine processes (~10 s)
def test_replies_from_two_engine_processes_equal_one_engines(target):
    """``generate_replies(workers=2)`` splits the prompts over two spawned CPU engines; a CPU
    forward is batch-invariant, so every reply is the one a single engine writes."""
    from speculant.training.data import generate_replies

    prompts = prompt_set("train")[:5]
    one = generate_replies(str(target), prompts, 12, "cpu", workers=1, progress=False)
    two = generate_replies(str(target), prompts, 12, "cpu", workers=2, progress=False)
    assert two == one and all(len(r) > 0 for _, r in one)
