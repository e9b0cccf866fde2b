"""Reading a draft model's or a draft head's checkpoint: the folder (a path or a cached hub id),
its ``config.json``, and its tensors (safetensors, sharded index or ``pytorch_model.bin``).
Errors are :class:`~speculant.spec_types.StrategyError` naming the file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from speculant.spec_types import StrategyContext, StrategyError


def resolve_draft_folder(model: str) -> Path:
    """The local folder (with config.json) of a draft checkpoint given as a path or hub id."""
    from speculant.models.loader import resolve_model

    try:
        return resolve_model(model)
    except (FileNotFoundError, ValueError) as e:
        raise StrategyError(f"speculative model {model!r}: {e}") from None


def read_config_json(folder: Path) -> dict[str, Any]:
    f = folder / "config.json"
    try:
        data = json.loads(f.read_text())
    except FileNotFoundError:
        raise StrategyError(
            f"{f}: missing (a speculator checkpoint needs its config.json)"
        ) from None
    except json.JSONDecodeError as e:
        raise StrategyError(f"{f}: invalid JSON ({e})") from None
    if not isinstance(data, dict):
        raise StrategyError(f"{f}: expected a JSON object")
    return data


def checkpoint_files(folder: Path) -> list[Path]:
    from speculant.models.loader import weight_files

    try:
        return weight_files(folder)
    except FileNotFoundError as e:
        raise StrategyError(str(e)) from None


def iter_checkpoint(folder: Path) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """(file, tensor name, tensor) for every tensor of a safetensors / pytorch_model.bin checkpoint."""
    from safetensors import safe_open

    for f in checkpoint_files(folder):
        if f.suffix == ".safetensors":
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    yield f, k, sf.get_tensor(k)
        else:
            try:
                state = torch.load(str(f), map_location="cpu", weights_only=True)
            except Exception as e:
                raise StrategyError(f"{f}: cannot be read as a PyTorch state dict ({e})") from None
            if not isinstance(state, dict):
                raise StrategyError(f"{f}: expected a state dict, got {type(state).__name__}")
            for k, v in state.items():
                yield f, k, v


def checkpoint_keys(folder: Path) -> set[str]:
    """Tensor names of a checkpoint without reading the tensors (for method inference)."""
    from safetensors import safe_open

    keys: set[str] = set()
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (folder / index).exists():
            try:
                return set(json.loads((folder / index).read_text())["weight_map"])
            except (json.JSONDecodeError, KeyError, TypeError):
                return set()
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
    for f in files:
        try:
            if f.suffix == ".safetensors":
                with safe_open(str(f), framework="pt") as sf:
                    keys.update(sf.keys())
            else:
                state = torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
                keys.update(state.keys())
        except Exception:
            continue
    return keys


def target_hidden_size(ctx: StrategyContext) -> int:
    h = getattr(ctx.target_model, "hidden_size", None) or getattr(
        ctx.target_config, "hidden_size", None
    )
    if h is None:
        raise StrategyError("the target model does not expose its hidden size")
    return int(h)


__all__ = [
    "checkpoint_files",
    "checkpoint_keys",
    "iter_checkpoint",
    "read_config_json",
    "resolve_draft_folder",
    "target_hidden_size",
]
