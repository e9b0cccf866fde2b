"""Training recipes: every hyper-parameter of a shipped head's run, fixed under a name, so
``speculant train eagle --model default --recipe smollm2-eagle --out DIR`` is the whole recipe
(data included: the prompts are ``speculant.training.prompts``' train split and the replies the
target's greedy ones). A finished recipe run installs its head where the shipped-heads registry
(``speculant.spec_registry.shipped``) finds it by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Recipe(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    method: str = Field(description="the head's method (speculant train METHOD)")
    target: str = Field("default", description="the target model (resolve_model's argument)")
    max_new_tokens: int = Field(ge=1, description="length of the target's greedy reply")
    num_prompts: int | None = Field(None, description="train prompts used (None: all)")
    head_options: dict[str, Any] = Field(default_factory=dict)
    val_prompts: int | None = Field(None, description="held-out prompts evaluated in training")
    train: dict[str, Any] = Field(description="TrainConfig fields")

    def command(self, out: str | Path) -> str:
        return (f"speculant train {self.method} --model {self.target} --recipe {self.name} "
                f"--out {out}")


RECIPES: dict[str, Recipe] = {
    # docs/training.md, "The shipped head": 2,000 prompts (1,500 + 500 input-grounded) x <= 192
    # reply tokens (~240k tokens), then 1,200 steps of 8 sequences (~5 epochs), 2-core CPU
    "smollm2-eagle": Recipe(
        name="smollm2-eagle", method="eagle", target="default", max_new_tokens=192,
        head_options={"num_layers": 1, "steps": 4, "token_weight": 0.5, "feature_weight": 1.0,
                      "hot_vocab": 8192},
        val_prompts=20,
        train={"steps": 1200, "batch_size": 8, "lr": 1e-3, "warmup": 50, "weight_decay": 0.0,
               "grad_clip": 1.0, "checkpoint_every": 50, "eval_every": 100, "seed": 0,
               "save_dtype": "float16"},
    ),
    # docs/training.md, "EAGLE-3": the same data and schedule as smollm2-eagle, an EAGLE-3 head
    # (the inputs of target layers 2, 15 and 27; its own 8,192-token draft vocabulary)
    "smollm2-eagle3": Recipe(
        name="smollm2-eagle3", method="eagle3", target="default", max_new_tokens=192,
        head_options={"steps": 4, "hot_vocab": 8192},
        val_prompts=20,
        train={"steps": 1200, "batch_size": 8, "lr": 1e-3, "warmup": 50, "weight_decay": 0.0,
               "grad_clip": 1.0, "checkpoint_every": 50, "eval_every": 100, "seed": 0,
               "save_dtype": "float16"},
    ),
}

# what a recipe run copies into the shipped head's folder (the rest of OUT, the distilled data
# and the trainer state, stays out of the repository)
SHIPPED_FILES = ("config.json", "model.safetensors", "token_map.json", "history.json", "loss.png")


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; recipes: {sorted(RECIPES)}")
    return RECIPES[name]


def install_head(recipe: Recipe, out: str | Path, dest: Path | None = None) -> Path:
    """Copy the trained head in ``out`` into its shipped folder (``dest``, default
    ``spec_registry/heads/<recipe name>``) with ``recipe.json`` (the recipe and its command)."""
    from speculant.spec_registry.shipped import HEADS_DIR

    out = Path(out)
    dest = Path(dest) if dest is not None else HEADS_DIR / recipe.name
    dest.mkdir(parents=True, exist_ok=True)
    for name in SHIPPED_FILES:
        if (out / name).is_file():
            shutil.copy2(out / name, dest / name)
    (dest / "recipe.json").write_text(json.dumps(
        {"command": recipe.command("DIR"), **recipe.model_dump()}, indent=1) + "\n")
    return dest


__all__ = ["RECIPES", "Recipe", "get_recipe", "install_head"]


def train_recipe(name: str, out: str | Path, *, resume: bool = False, stop_at: int | None = None,
                 cache_dir: str | Path | None = None, device: str | None = None,
                 progress: bool = True, install_to: Path | None = None,
                 cpu_threads: int | None = None):
    """Run recipe ``name`` into ``out`` (``train`` with every setting the recipe's); split it
    with ``stop_at`` and ``resume``; ``cpu_threads``: ``train``'s (a machine setting, not the
    recipe's). When the run reaches its last step the head is installed
    into its shipped folder (``install_head``; ``install_to`` overrides where). Returns
    ``(TrainResult, installed folder or None)``."""
    from speculant.training.api import train

    recipe = get_recipe(name)
    res = train(recipe.method, out, recipe.target, num_prompts=recipe.num_prompts,
                max_new_tokens=recipe.max_new_tokens, cache_dir=cache_dir,
                head_options=dict(recipe.head_options), resume=resume, progress=progress,
                device=device, stop_at=stop_at, val_prompts=recipe.val_prompts,
                cpu_threads=cpu_threads,
                **recipe.train)
    done = res.steps >= recipe.train["steps"]
    return res, (install_head(recipe, out, install_to) if done else None)


__all__ += ["train_recipe"]
