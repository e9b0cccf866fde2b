"""Shipped heads (spec_registry/shipped.py) and training recipes (speculant.training.recipes):
a recipe run, split with --stop-at / --resume, installs its head where
``speculative_config={"method": "eagle", "model": NAME}`` finds it by name (its token_map.json
picked up, greedy output equal to plain decoding); before that the name is an error naming the
command that trains it; ``speculant demo`` shows an installed head beside n-gram. A tiny random
Llama stands in for SmolLM2 (the registry and the recipes monkeypatched)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from speculant import LLM, SamplingParams
from speculant.spec_registry import shipped
from speculant.training import recipes


@pytest.fixture(scope="module")
def target(tiny_factory) -> Path:
    return tiny_factory("llama")


@pytest.fixture()
def registry(monkeypatch, tmp_path, target):
    """SHIPPED = {"tiny-eagle": a head for ``target``}, installed under tmp_path/heads, with its
    recipe (4 steps)."""
    monkeypatch.setattr(shipped, "HEADS_DIR", tmp_path / "heads")
    head = shipped.ShippedHead("tiny-eagle", "eagle", str(target), "tiny-eagle")
    monkeypatch.setattr(shipped, "SHIPPED", {"tiny-eagle": head})
    recipe = recipes.Recipe(name="tiny-eagle", method="eagle", target=str(target),
                            max_new_tokens=16, num_prompts=8,
                            head_options={"steps": 2, "hot_vocab": 64},
                            train={"steps": 4, "batch_size": 4, "warmup": 1,
                                   "checkpoint_every": 2})
    monkeypatch.setattr(recipes, "RECIPES", {"tiny-eagle": recipe})
    return head


def _greedy(llm) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=16)
    return [o.outputs[0].token_ids for o in llm.generate(["The capital of", "def f(x):"],
                                                         params, use_tqdm=False)]


def test_the_registry_names_the_smollm2_head_and_its_recipe():
    head = shipped.SHIPPED["smollm2-eagle"]
    recipe = recipes.get_recipe(head.recipe)
    assert (head.method, head.target) == (recipe.method, recipe.target) == ("eagle", "default")
    assert recipe.max_new_tokens == 192 and recipe.train["steps"] == 1200
    assert head.train_command == recipe.command("runs/smollm2-eagle")
    assert head.num_speculative_tokens == recipe.head_options["steps"] == 4  # the demo's k
    with pytest.raises(ValueError, match="unknown recipe 'nope'"):
        recipes.get_recipe("nope")


@pytest.mark.slow  # a recipe's training run (~5 s)
def test_recipe_run_split_then_installed_and_loaded_by_name(registry, target, tmp_path, capsys):
    from speculant.cli import main

    with pytest.raises(ValueError, match="not in this repository yet.*speculant train eagle "
                       f"--model {target} --recipe tiny-eagle"):
        LLM(model=str(target), speculative_config={"method": "eagle", "model": "tiny-eagle"})
    out = tmp_path / "run"
    cmd = ["train", "eagle", "--model", str(target), "--recipe", "tiny-eagle", "--out", str(out)]
    assert main(cmd + ["--stop-at", "0"]) == 0  # the data only
    assert "stopped after step 0 of 4" in capsys.readouterr().out
    assert len(list((out / "data").glob("distill-train-*.pt"))) == 1
    assert main(cmd + ["--stop-at", "2", "--resume"]) == 0
    text = capsys.readouterr()
    assert "estimated training wall time" in text.out + text.err
    assert "stopped after step 2 of 4" in text.out and not registry.available
    assert main(cmd + ["--resume"]) == 0
    assert "installed" in capsys.readouterr().out and registry.available
    history = json.loads((registry.folder / "history.json").read_text())
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    assert json.loads((registry.folder / "recipe.json").read_text())["train"]["steps"] == 4
    assert (registry.folder / "token_map.json").is_file()
    assert not (registry.folder / "trainer_state.pt").exists()

    plain = _greedy(LLM(model=str(target)))
    llm = LLM(model=str(target), speculative_config={"model": "tiny-eagle",
                                                     "num_speculative_tokens": 3})
    assert llm.engine.spec.name == "eagle" and llm.engine.spec.strategy.hot is not None
    assert _greedy(llm) == plain
    with pytest.raises(ValueError, match="shipped 'eagle' head; use method 'eagle'"):
        LLM(model=str(target), speculative_config={"method": "medusa", "model": "tiny-eagle"})


def test_a_recipe_fixes_its_settings(registry, target, tmp_path):
    from speculant.cli import main

    base = ["--model", str(target), "--recipe", "tiny-eagle", "--out", str(tmp_path)]
    with pytest.raises(SystemExit, match="fixes --steps, --lr"):
        main(["train", "eagle", *base, "--steps", "9", "--lr", "0.1"])
    with pytest.raises(SystemExit, match="trains a 'eagle' head, not 'medusa'"):
        main(["train", "medusa", *base])
    with pytest.raises(SystemExit, match="is for --model"):
        main(["train", "eagle", "--model", "default", "--recipe", "tiny-eagle", "--out", "x"])


@pytest.mark.slow  # a whole demo run (6 s): CI's slow run keeps it
def test_demo_shows_an_installed_head_beside_ngram(registry, target, tmp_path, capsys):
    from speculant.demo import default_methods, run_demo

    assert default_methods(str(target)) == ["ngram"]  # not installed yet
    registry.folder.mkdir(parents=True)
    (registry.folder / "config.json").write_text("{}")
    assert default_methods(str(target)) == ["ngram", "eagle=tiny-eagle"]
    assert default_methods(None) == ["ngram"]  # trained for another model
    (registry.folder / "config.json").unlink()

    recipes.train_recipe("tiny-eagle", tmp_path / "run", progress=False)
    assert run_demo(model=str(target), max_tokens=12, k=3, repeats=1, retime=0) == 0
    out = capsys.readouterr().out
    rows = [ln.split()[0] for ln in out.splitlines() if ln[:1].isalpha()]
    assert "ngram" in rows and "tiny-eagle" in rows
    assert out.count("greedy output identical to plain decoding: yes") == 2


def test_the_shipped_smollm2_head_is_in_the_repository():
    """The trained head itself: fp16, within issue 37's 10 MB, with its token map and recipe."""
    from safetensors import safe_open

    head = shipped.SHIPPED["smollm2-eagle"]
    assert head.available, f"{head.folder} has no config.json: run {head.train_command}"
    weights = head.folder / "model.safetensors"
    assert weights.stat().st_size <= 10 * 1024 * 1024
    with safe_open(str(weights), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}
    assert (head.folder / "token_map.json").is_file()
    recipe = json.loads((head.folder / "recipe.json").read_text())
    assert recipe["name"] == "smollm2-eagle" and recipe["train"]["steps"] == 1200
    assert [h["step"] for h in json.loads((head.folder / "history.json").read_text())][-1] == 1200


@pytest.mark.slow
def test_the_shipped_smollm2_head_loads_by_name_and_is_lossless(smollm, default_model_path):
    """``{"method": "eagle", "model": "smollm2-eagle"}`` on the embedded default model: greedy
    output equal to plain decoding, and the trained head's drafts are accepted."""
    prompts = ["What is 12 times 7? Answer with the number and a short explanation.",
               "Write a Python function that returns the square of a number."]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    plain = [o.outputs[0].token_ids for o in smollm.generate(prompts, params, use_tqdm=False)]
    llm = LLM(model=str(default_model_path), speculative_config={"method": "eagle", "model": "smollm2-eagle",
                                  "num_speculative_tokens": 4})
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    m = llm.get_metrics()
    assert m.num_draft_tokens > 0 and m.num_accepted_tokens / m.num_draft_tokens > 0.1
