"""Copy checkpoint tensors into a model's parameters, packing q/k/v and gate/up, and report
missing or unexpected keys with the file they came from."""

from __future__ import annotations

import torch
from torch import nn


class WeightLoadError(ValueError):
    pass


class WeightLoader:
    def __init__(self, model: nn.Module, source: str, packed: dict[str, tuple[str, ...]]) -> None:
        self.model = model
        self.source = source
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

    def load(self, name: str, tensor: torch.Tensor) -> None:
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
                self._copy(pname, tensor, offset)
                self.part_loaded.setdefault(pname, set()).add(part)
                if len(self.part_loaded[pname]) == len(parts):
                    self.loaded.add(pname)
                return
        if name in self.params:
            self._copy(name, tensor)
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
