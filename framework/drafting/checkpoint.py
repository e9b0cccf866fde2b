"""Reading a draft model's or a draft head's checkpoint: the folder (a path or a cached hub id),
its ``config.json`` (:class:`CheckpointConfig`, typed fields), and its tensors (safetensors,
a sharded ``*.index.json`` or ``pytorch_model.bin``), checked against the shapes the target
implies (:func:`read_tensors`, :func:`load_into`). Every error is a
:class:`~speculant.spec_types.StrategyError` naming the file, the key and what was expected."""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from speculant.spec_types import StrategyContext, StrategyError

T = TypeVar("T")
_REQUIRED: Any = object()
Shape = Sequence[int | None]  # expected tensor shape; None matches any size of that dimension


def resolve_draft_folder(model: str) -> Path:
    """The local folder (with config.json) of a draft checkpoint given as a path or a hub id
    (from the local hub cache). Raises StrategyError if neither exists."""
    from speculant.models.loader import resolve_model

    try:
        return resolve_model(model)
    except (FileNotFoundError, ValueError) as e:
        raise StrategyError(f"speculative model {model!r}: {e}") from None


class CheckpointConfig(dict):
    """A checkpoint's ``config.json``: the parsed JSON object (a plain ``dict``) that knows its
    file, with typed field access whose errors name the file and the field."""

    def __init__(self, data: Mapping[str, Any], file: Path) -> None:
        super().__init__(data)
        self.file = file  # the config.json it was read from

    def field(
        self, name: str, kind: type[T], default: Any = _REQUIRED, *, minimum: float | None = None
    ) -> T:
        """The value of field ``name`` as ``kind`` (bool, int, float, str, list, dict, ...).
        An absent or ``null`` field gives ``default``; without a default it is an error. An int
        is accepted for a float field; a bool is never an int. ``minimum``: the smallest value
        allowed (numbers only). Raises StrategyError naming the file and the field."""
        value = self.get(name)
        if value is None:
            if default is _REQUIRED:
                raise StrategyError(f"{self.file}: missing required field {name!r}")
            return default
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise StrategyError(
                f"{self.file}: field {name!r} must be {kind.__name__}, got {value!r}"
            )
        if minimum is not None and value < minimum:
            raise StrategyError(f"{self.file}: field {name!r} must be >= {minimum}, got {value}")
        return value

    def check_target(self, name: str, target_value: int, what: str) -> int:
        """Field ``name`` (a required int) must equal ``target_value``, the target's ``what``
        (e.g. ``"hidden size"``); returns it. Raises StrategyError naming the file, both values
        and that the checkpoint was trained for a different target."""
        value = self.field(name, int)
        if value != target_value:
            raise StrategyError(
                f"{self.file}: {name}={value} but the target model's {what} is {target_value}; "
                "this checkpoint was trained for a different target"
            )
        return value


def read_config_json(folder: Path) -> CheckpointConfig:
    """``folder/config.json`` as a :class:`CheckpointConfig` (a dict). Raises StrategyError if
    it is missing, not JSON, or not a JSON object."""
    f = folder / "config.json"
    try:
        data = json.loads(f.read_text())
    except FileNotFoundError:
        raise StrategyError(f"{f}: missing (a draft checkpoint needs its config.json)") from None
    except json.JSONDecodeError as e:
        raise StrategyError(f"{f}: invalid JSON ({e})") from None
    if not isinstance(data, dict):
        raise StrategyError(f"{f}: expected a JSON object")
    return CheckpointConfig(data, f)


def checkpoint_files(folder: Path) -> list[Path]:
    """The weight files of a checkpoint, in the engine's order of preference:
    ``model.safetensors.index.json`` shards, ``*.safetensors``, ``pytorch_model.bin.index.json``
    shards, ``pytorch_model*.bin``; or ``[folder]`` when ``folder`` is itself a weight file
    (``.safetensors``, or a ``torch.save`` state dict: ``.bin``, ``.pt``, ``.pth``; e.g. a
    head stored beside a base model). Raises StrategyError if there are none or a shard is
    missing."""
    from speculant.models.loader import weight_files

    if folder.is_file():
        return [folder]
    try:
        return weight_files(folder)
    except (FileNotFoundError, ValueError) as e:  # none, a shard missing, an unreadable index
        raise StrategyError(str(e)) from None


def _load_bin(f: Path) -> dict[str, torch.Tensor]:
    try:
        try:  # memory-mapped: tensors are read when touched
            state = torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the legacy (non-zip) format cannot be mapped
            state = torch.load(str(f), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file: say which
        from speculant.models.weights import state_dict_error

        raise StrategyError(state_dict_error(f, e)) from None
    if not isinstance(state, dict):
        raise StrategyError(f"{f}: expected a state dict, got {type(state).__name__}")
    return state


@contextmanager
def _opened(f: Path) -> Iterator[tuple[list[str], Callable[[str], tuple[int, ...]], Callable]]:
    """(keys, shape of a key, tensor of a key) of one weight file; shapes need no tensor read."""
    if f.suffix == ".safetensors":
        from safetensors import safe_open

        from speculant.models.weights import safetensors_error

        try:
            sf = safe_open(str(f), framework="pt")
        except Exception as e:  # noqa: BLE001 - truncated, corrupt: say which file and how
            raise StrategyError(safetensors_error(f, e)) from None
        yield list(sf.keys()), lambda k: tuple(sf.get_slice(k).get_shape()), sf.get_tensor
    else:
        state = _load_bin(f)
        yield list(state), lambda k: tuple(state[k].shape), state.__getitem__


def checkpoint_index(folder: Path) -> dict[str, Path]:
    """Tensor name -> the file that holds it, for every tensor of the checkpoint, from its
    ``*.index.json`` or the files' headers (no tensor is read). Raises StrategyError."""
    files = checkpoint_files(folder)
    sharded = "model.safetensors" if files[0].suffix == ".safetensors" else "pytorch_model.bin"
    index = folder / f"{sharded}.index.json"
    if folder.is_dir() and index.exists():
        try:
            return {k: folder / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise StrategyError(f"{index}: not a weight index ({e!r})") from None
    out: dict[str, Path] = {}
    for f in files:
        with _opened(f) as (keys, _shape, _get):
            out.update((k, f) for k in keys)
    return out


def checkpoint_keys(folder: Path) -> set[str]:
    """Tensor names of a checkpoint without reading the tensors (for method inference from a
    folder): an empty set where the folder holds no readable checkpoint, never an error."""
    try:
        return set(checkpoint_index(folder))
    except StrategyError:
        return set()


def iter_checkpoint(folder: Path) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """(file, tensor name, tensor) for every tensor of a checkpoint, unchecked, file by file."""
    for f in checkpoint_files(folder):
        with _opened(f) as (keys, _shape, get):
            for k in keys:
                yield f, k, get(k)


def _fmt_shape(shape: Shape) -> str:
    dims = ["?" if d is None else str(d) for d in shape]
    return f"({', '.join(dims)}{',' if len(dims) == 1 else ''})"


def _listed(names: list[str], n: int = 8) -> str:
    return ", ".join(names[:n]) + (" ..." if len(names) > n else "")


def _read(
    folder: Path,
    expected: Mapping[str, Shape],
    store: Callable[[str, torch.Tensor], None],
    strip_prefixes: Sequence[str],
    rename: Callable[[str], str | None] | None,
    optional: Collection[str],
    strict: bool,
    hint: str,
    what: str,
) -> None:
    targets: dict[Path, list[tuple[str, str]]] = {}  # file -> [(checkpoint key, name)]
    keys_of: dict[str, int] = {}  # name -> how many checkpoint keys map to it
    unexpected: list[str] = []
    for key, f in checkpoint_index(folder).items():
        name = key
        for p in strip_prefixes:
            if name.startswith(p):
                name = name[len(p) :]
                break
        if rename is not None:
            name = rename(name)
            if name is None:
                continue
        if name in expected:
            targets.setdefault(f, []).append((key, name))
            keys_of[name] = keys_of.get(name, 0) + 1
        else:
            unexpected.append(f"{key} ({f.name})")
    note = f" ({hint})" if hint else ""
    if unexpected and strict:
        raise StrategyError(
            f"{folder}: {len(unexpected)} unexpected tensor(s) in the {what}: "
            f"{_listed(unexpected, 6)}; expected {_listed(sorted(expected), 6)}{note}"
        )
    missing = [n for n in expected if n not in keys_of and n not in optional]
    if missing:
        raise StrategyError(
            f"{folder}: {len(missing)} tensor(s) missing from the {what}: {_listed(missing)}{note}"
        )
    first: dict[str, tuple[str, Path, torch.Tensor | None]] = {}  # tensor kept for tied names
    for f in sorted(targets):
        with _opened(f) as (_keys, shape_of, get):
            for key, name in targets[f]:
                shape, want = shape_of(key), expected[name]
                if len(shape) != len(want) or any(w not in (None, s) for s, w in zip(shape, want)):
                    via = "" if key == name else f" for {name!r}"
                    raise StrategyError(
                        f"{f}: tensor {key!r} has shape {_fmt_shape(shape)}, expected "
                        f"{_fmt_shape(want)}{via}{note}"
                    )
                tensor = get(key)
                if name in first:  # another key loads the same name (tied weights): equal
                    k0, f0, t0 = first[name]
                    if not torch.equal(t0, tensor):
                        raise StrategyError(
                            f"{f}: tensor {key!r} differs from {k0!r} ({f0.name}), which it "
                            f"must equal: both load {name!r}{note}"
                        )
                    continue
                first[name] = (key, f, tensor if keys_of[name] > 1 else None)
                store(name, tensor)


def read_tensors(
    folder: Path,
    expected: Mapping[str, Shape],
    *,
    strip_prefixes: Sequence[str] = (),
    rename: Callable[[str], str | None] | None = None,
    optional: Collection[str] = (),
    strict: bool = True,
    hint: str = "",
    what: str = "checkpoint",
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    into: Callable[[str, torch.Tensor], None] | None = None,
) -> dict[str, torch.Tensor]:
    """The tensors of the checkpoint in ``folder`` (a folder, or one weight file: see
    :func:`checkpoint_files`), by name, checked against ``expected`` (name -> shape; ``None`` in
    a shape matches any size of that dimension).

    Each checkpoint key is mapped to a name: the first of ``strip_prefixes`` it starts with is
    removed, then ``rename(name)`` applies (returning None skips the key silently). Keys whose
    name is not in ``expected`` are unexpected (an error if ``strict``, else skipped); names of
    ``expected`` no key maps to are missing (an error unless in ``optional``). Several keys may
    map to one name (a checkpoint storing tied copies): they must be equal. Tensors are read
    lazily, file by file (shapes from the headers before any read), then cast to ``dtype`` and
    moved to ``device`` if given. ``what`` names the checkpoint in errors (``"Medusa head"``)
    and ``hint`` is appended to them (e.g. the config values the shapes come from).

    ``into``: called as ``into(name, tensor)`` (the tensor as read, before any cast) for each
    checked tensor instead of collecting them, so only one tensor is held at a time (e.g. to
    copy heads into one stacked tensor); the result is then an empty dict.

    Raises StrategyError naming the file, the key, its shape and the expected shape; or the
    folder and every missing or unexpected key (with its file)."""
    out: dict[str, torch.Tensor] = {}

    def store(name: str, t: torch.Tensor) -> None:
        out[name] = t.to(device=device, dtype=dtype) if dtype or device else t

    _read(
        folder, expected, into or store, strip_prefixes, rename, optional, strict, hint, what
    )
    return out


def load_into(
    module: nn.Module,
    folder: Path,
    *,
    strip_prefixes: Sequence[str] = (),
    rename: Callable[[str], str | None] | None = None,
    optional: Collection[str] = (),
    strict: bool = True,
    hint: str = "",
    what: str = "checkpoint",
) -> nn.Module:
    """Fill ``module``'s parameters and buffers (its ``state_dict()`` names and shapes) from the
    checkpoint in ``folder`` (a folder or one weight file), with :func:`read_tensors`'s key
    mapping, checks and errors; each tensor is copied into place (converted to the parameter's
    dtype and device) as it is read. Returns ``module``."""
    state = module.state_dict()  # tensors sharing the parameters' storage
    expected = {k: tuple(v.shape) for k, v in state.items()}

    def store(name: str, t: torch.Tensor) -> None:
        with torch.no_grad():
            state[name].copy_(t)

    _read(folder, expected, store, strip_prefixes, rename, optional, strict, hint, what)
    return module


def target_hidden_size(ctx: StrategyContext) -> int:
    """The target model's hidden size (the width of ``SpecBatch.hidden_states``). Raises
    StrategyError if the target does not expose it."""
    h = getattr(ctx.target_model, "hidden_size", None) or getattr(
        ctx.target_config, "hidden_size", None
    )
    if h is None:
        raise StrategyError("the target model does not expose its hidden size")
    return int(h)


__all__ = [
    "CheckpointConfig",
    "checkpoint_files",
    "checkpoint_index",
    "checkpoint_keys",
    "iter_checkpoint",
    "load_into",
    "read_config_json",
    "read_tensors",
    "resolve_draft_folder",
    "target_hidden_size",
]
