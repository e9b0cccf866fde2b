"""Copy checkpoint tensors into a model's parameters, packing q/k/v and gate/up, and report
missing or unexpected keys with the file they came from; say what is wrong with a weight file
that cannot be read (:func:`safetensors_error`, :func:`state_dict_error`).

Under tensor parallelism a model gives the loader its ``weight_shard(name, part)`` rule: the
rows or columns of a checkpoint tensor this rank keeps (:class:`WeightShard`). The loader reads
only those, from a lazy safetensors slice (``safe_open(...).get_slice(name)``) or by narrowing a
tensor already in memory."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class WeightShard:
    """This rank's part of a checkpoint tensor: rows (``dim`` 0: a column-parallel weight or its
    bias) or columns (``dim`` 1: a row-parallel weight) ``start:end``; ``zeros``: a row-parallel
    layer's bias on a rank other than 0 (the bias is added once, by rank 0, before the sum);
    ``full``: the unsharded size of ``dim`` the config implies (checked against the tensor)."""

    dim: int = 0
    start: int = 0
    end: int = 0
    full: int = 0
    zeros: bool = False


ShardRule = Callable[[str, "str | None"], "WeightShard | None"]  # (param name, packed part)


def read_shard(src: Any, shard: WeightShard | None) -> torch.Tensor:
    """``src`` (a tensor, or a lazy safetensors slice: ``get_shape()`` and indexing) read whole
    (``shard`` None) or only its ``shard`` rows / columns."""
    lazy = not isinstance(src, torch.Tensor)
    if shard is None:
        return src[:] if lazy else src
    if shard.zeros:  # nothing read
        return torch.zeros(source_shape(src), dtype=torch.float32)
    if shard.dim == 0:
        return src[shard.start : shard.end] if lazy else src[shard.start : shard.end]
    return src[:, shard.start : shard.end] if lazy else src[:, shard.start : shard.end]


def source_shape(src: Any) -> tuple[int, ...]:
    return tuple(src.shape) if isinstance(src, torch.Tensor) else tuple(src.get_shape())

_FIX = "download or save the checkpoint again"


class WeightLoadError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and what is wrong."""


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with the safetensors file ``path`` (in words, without the path), read from
    its layout (8-byte little-endian header length, JSON header, tensor data), or None when the
    layout is sound: shorter than the length field, a header longer than the file, a header
    that is not JSON, or tensor data shorter (truncated) or longer than the header describes."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            raw = fh.read(n) if 0 < n <= size - 8 else b""
    except OSError as e:
        return str(e.strerror or e)
    if size < 8:
        return (f"truncated or not a safetensors file: {size} bytes, fewer than the 8-byte "
                "header length a safetensors file starts with")
    if n > size - 8:
        return (f"truncated or not a safetensors file: its first 8 bytes give a header of {n} "
                f"bytes, but only {size - 8} bytes follow")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"corrupt: its {n}-byte header is not valid JSON ({e})"
    if not isinstance(header, dict):
        return "corrupt: its header is not a JSON object"
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
                  default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        return "corrupt: a tensor of its header has no valid data_offsets"
    have = size - 8 - n
    if end > have:
        return (f"truncated: its header describes {end} bytes of tensor data but the file "
                f"holds {have} ({end - have} bytes missing)")
    if end < have:
        return (f"corrupt: it holds {have} bytes of tensor data, {have - end} more than its "
                "header describes")
    return None


def safetensors_error(path: Path, error: BaseException) -> str:
    """The message for a safetensors file that failed to open with ``error``: the file and what
    is wrong with it (:func:`safetensors_problem`), else the reader's own words, and the fix."""
    problem = safetensors_problem(path)
    if problem is None:
        problem = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return f"{path}: cannot be read as safetensors: {problem}; {_FIX}"


def state_dict_error(path: Path, error: BaseException) -> str:
    """The message for a PyTorch weight file (``pytorch_model.bin``) ``torch.load`` failed on."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    size = path.stat().st_size if path.exists() else 0
    return (f"{path}: cannot be read as a PyTorch state dict ({first}); the file ({size} bytes) "
            f"is truncated or corrupt: {_FIX}")


class WeightLoader:
    """Loads (name, tensor) pairs into ``model``'s parameters. ``shard``: the model's rule for
    which part of each tensor this rank keeps (None: every tensor whole); a tensor may then also
    be a lazy safetensors slice, of which only that part is read."""

    def __init__(self, model: nn.Module, source: str, packed: dict[str, tuple[str, ...]],
                 shard: ShardRule | None = None) -> None:
        self.model = model
        self.source = source
        self.shard = shard
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.packed = packed
        self.loaded: set[str] = set()
        self.unexpected: list[str] = []
        self.part_loaded: dict[str, set[str]] = {}

    def _copy(self, pname: str, tensor: torch.Tensor, offset: int | None = None) -> None:
        param = self.params[pname]
        with torch.no_grad():
            if offset is None:
                if tuple(param.shape) != tuple(tensor.shape):
                    raise WeightLoadError(
                        f"{self.source}: tensor {pname!r} has shape {tuple(tensor.shape)} but the "
                        f"config implies {tuple(param.shape)}; the checkpoint and its config.json "
                        "do not match"
                    )
                param.copy_(tensor.to(param.dtype))
            else:
                n = tensor.shape[0]
                if offset + n > param.shape[0] or tuple(param.shape[1:]) != tuple(tensor.shape[1:]):
                    raise WeightLoadError(
                        f"{self.source}: tensor for {pname!r} (part at rows {offset}:{offset + n}) has "
                        f"shape {tuple(tensor.shape)}, which does not fit {tuple(param.shape)}; the "
                        "checkpoint and its config.json do not match"
                    )
                param[offset : offset + n].copy_(tensor.to(param.dtype))

    def _read(self, pname: str, part: str | None, src: Any, name: str) -> torch.Tensor:
        shard = None if self.shard is None else self.shard(pname, part)
        if shard is not None and not shard.zeros:
            shape = source_shape(src)
            if len(shape) <= shard.dim or shape[shard.dim] != shard.full:
                raise WeightLoadError(
                    f"{self.source}: tensor {name!r} has shape {shape} but the config implies "
                    f"{shard.full} along dim {shard.dim} (this rank reads {shard.start}:"
                    f"{shard.end} of it); the checkpoint and its config.json do not match")
        return read_shard(src, shard)

    def load(self, name: str, tensor: Any) -> None:
        """Load the checkpoint tensor ``name`` (a tensor, or a lazy safetensors slice)."""
        for packed_name, parts in self.packed.items():
            for i, part in enumerate(parts):
                token = f".{part}."
                if token not in f".{name}":
                    continue
                pname = f".{name}".replace(token, f".{packed_name}.")[1:]
                if pname not in self.params:
                    continue
                module = self.model.get_submodule(pname.rsplit(".", 2)[0])
                sizes = _part_sizes(module, packed_name, len(parts))
                offset = sum(sizes[:i])
                self._copy(pname, self._read(pname, part, tensor, name), offset)
                self.part_loaded.setdefault(pname, set()).add(part)
                if len(self.part_loaded[pname]) == len(parts):
                    self.loaded.add(pname)
                return
        if name in self.params:
            self._copy(name, self._read(name, None, tensor, name))
            self.loaded.add(name)
        else:
            self.unexpected.append(name)

    def finish(self, optional: tuple[str, ...] = ()) -> None:
        missing = [n for n in self.params if n not in self.loaded and n not in optional]
        if missing:
            shown = ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else "")
            raise WeightLoadError(
                f"{self.source}: {len(missing)} weight(s) missing from the checkpoint: {shown}. "
                "The checkpoint is incomplete or is not of the architecture its config.json names."
            )
        if self.unexpected:
            shown = ", ".join(self.unexpected[:6]) + (" ..." if len(self.unexpected) > 6 else "")
            raise WeightLoadError(
                f"{self.source}: {len(self.unexpected)} unexpected tensor(s) in the checkpoint: "
                f"{shown}. The checkpoint does not match the architecture its config.json names."
            )


def _part_sizes(module: nn.Module, packed_name: str, n: int) -> list[int]:
    if packed_name == "qkv_proj":
        return [module.q_size, module.kv_size, module.kv_size]
    total = getattr(module, packed_name).weight.shape[0]
    return [total // n] * n
