"""``train(method, ...)``: self-distillation data, a head of ``method``, the training loop and
its checkpoint, in one call (what ``speculant train`` runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from speculant.engine.cpu_threads import torch_threads
from speculant.training.data import build_dataset
from speculant.training.heads import HEADS, TargetInfo, Trainable
from speculant.training.loop import TrainConfig, TrainResult, train_head


def make_head(method: str, target: TargetInfo, **options: Any) -> Trainable:
    """A fresh trainable head of ``method`` (``HEADS``' keys) for ``target``; ``options`` go to
    its constructor (e.g. ``steps=4`` for eagle, ``n_predict=3`` for mlp_speculator)."""
    if method not in HEADS:
        raise ValueError(f"no trainable head for method {method!r}; trainable: {sorted(HEADS)} "
                         "(a third-party head: pass it to speculant.training.train_head)")
    return HEADS[method](target, **options)


def hot_token_ids(counts: torch.Tensor, n: int) -> torch.Tensor:
    """[n] int64 ascending: the ``n`` most frequent token ids of ``counts`` [vocab] (ties by
    lower id)."""
    if not 0 < n <= len(counts):
        raise ValueError(f"hot_vocab={n} must be in [1, {len(counts)}] (the vocabulary size)")
    order = torch.argsort(-counts, stable=True)[:n]
    return order.sort().values


def train(method: str, out: str | Path, model: str | None = None, *, num_prompts: int | None = None,
          max_new_tokens: int = 128, cache_dir: str | Path | None = None,
          head_options: dict[str, Any] | None = None, resume: bool = False,
          progress: bool = True, device: str | None = None, stop_at: int | None = None,
          val_prompts: int | None = None, cpu_threads: int | None = None,
          **train_options: Any) -> TrainResult:
    """Train a ``method`` head for ``model`` (default: the embedded SmolLM2-135M-Instruct) on
    the target's own greedy replies to the training prompts; write it into ``out`` in the
    layout ``speculative_config={"method": method, "model": out}`` loads. The eagle head option
    ``hot_vocab`` (N) trains its token loss over the N most frequent reply tokens only and writes
    them as ``out/token_map.json`` (pass ``"token_map": ".../token_map.json"`` to load it so,
    which also makes drafting cheaper); for ``eagle3`` those N tokens are the head's own draft
    vocabulary (its ``lm_head`` rows and ``d2t``). ``train_options``
    are :class:`TrainConfig` fields (steps, lr, batch_size, ...); ``cache_dir`` (default
    ``out/data``) keeps the distilled data for later runs; ``stop_at``: see ``train_head``;
    ``val_prompts``: that many held-out prompts (distilled the same way) are evaluated every
    ``eval_every`` steps; ``cpu_threads``: threads of the hidden-state pass and of training on
    the CPU (None: every available CPU; ``speculant.engine.cpu_threads.torch_threads``)."""
    from speculant.models.loader import resolve_model

    config = TrainConfig(**train_options)
    folder = resolve_model(model)
    target = TargetInfo.load(folder)
    options = dict(head_options or {})
    hot_vocab = options.pop("hot_vocab", None)
    if hot_vocab is not None and method not in ("eagle", "eagle3"):
        raise ValueError(f"head option hot_vocab is for methods 'eagle' and 'eagle3' only (got "
                         f"{method!r}); remove it")
    head = make_head(method, target, **options)  # fails early on a bad method or option
    data = build_dataset(str(folder), "train", num_prompts, max_new_tokens,
                         aux_layers=tuple(head.aux_layers),
                         cache_dir=cache_dir if cache_dir is not None else Path(out) / "data",
                         progress=progress, cpu_threads=cpu_threads)
    val = None
    if val_prompts:
        val = build_dataset(str(folder), "held-out", val_prompts, max_new_tokens,
                            aux_layers=tuple(head.aux_layers),
                            cache_dir=cache_dir if cache_dir is not None else Path(out) / "data",
                            progress=progress, cpu_threads=cpu_threads)
    if hot_vocab is not None:  # the N most frequent reply tokens: a token map (FR-Spec) / d2t
        options["hot_ids"] = hot_token_ids(data.token_counts(), int(hot_vocab))
    torch.manual_seed(config.seed)  # the head's initial weights follow the run's seed
    head = make_head(method, target, **options)
    with torch_threads(cpu_threads):
        return train_head(head, data, out, config, resume=resume, progress=progress,
                          device=device, stop_at=stop_at, val_data=val)
