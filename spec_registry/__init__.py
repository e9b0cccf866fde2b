"""Strategy registry: names to strategy classes (collected from plugins), and the
``SpeculativeConfig`` users pass as ``speculative_config``."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from speculant.hookspecs import StrategyInfo, StrategyKind, strategy_info
from speculant.plugin_manager import collect_strategies, plugin_info
from speculant.spec_types import StrategyError

logger = logging.getLogger("speculant")


def _by_name(kind: StrategyKind | None = None) -> dict[str, StrategyInfo]:
    """Every registered name and alias (of ``kind``, or of any kind) -> its strategy."""
    return {key: info for info in collect_strategies() for key in (info.name, *info.aliases)
            if kind is None or info.kind == kind}


def available_strategies(kind: StrategyKind | None = None) -> dict[str, type]:
    """Every registered name and alias (of ``kind``, or of any kind) -> its strategy class."""
    return {n: info.cls for n, info in _by_name(kind).items()}


def strategies_by_plugin() -> dict[str, list[type]]:
    """Plugin name -> the strategy classes it registers."""
    out: dict[str, list[type]] = {}
    for info in collect_strategies():
        out.setdefault(info.plugin, []).append(info.cls)
    return out


def lookup(name: str, kind: StrategyKind = "proposer") -> StrategyInfo:
    """The strategy of ``kind`` registered as ``name`` (or an alias), with its attributes
    checked against :class:`speculant.hookspecs.Strategy`. Unknown: a StrategyError listing
    the installed ones."""
    found = _by_name(kind)
    if name not in found:
        names = sorted({info.name for info in found.values()})
        raise StrategyError(
            f"unknown speculative method {name!r}; installed {kind} strategies: "
            f"{', '.join(names) or '(none)'}. Check the spelling, or install the plugin package "
            "that provides it (`speculant plugins` lists what is loaded)"
        )
    return found[name]


def get_strategy(name: str, kind: StrategyKind = "proposer") -> type:
    """The strategy class of ``kind`` registered as ``name`` (:func:`lookup`)."""
    return lookup(name, kind).cls


def lossy_reason(info: StrategyInfo) -> str | None:
    """Why the strategy ``info`` does not keep the output the target's
    (:attr:`speculant.hookspecs.Strategy.lossless`), naming it and its plugin; None when it
    does."""
    if info.lossless:
        return None
    dist = plugin_info(info.plugin) if info.plugin else None
    origin = f"plugin {info.plugin!r}" if info.plugin else "an unnamed plugin"
    if dist is not None and dist.distribution:
        origin += f" ({dist.distribution} {dist.version or ''})".replace(" )", ")")
    why = ("declares lossless = False" if info.lossless_declared else
           "does not declare `lossless` (speculant.hookspecs.Strategy.lossless), so it is "
           "treated as lossy")
    return (f"{info.kind} {info.name!r} of {origin} {why}: with it, greedy output may differ "
            "from plain decoding and sampled output may not follow the target distribution")


def check_lossless(*infos: StrategyInfo) -> bool:
    """Whether the strategies an engine runs (its proposer, its verifier) all keep the output
    the target's; each that does not is logged as a warning (:func:`lossy_reason`). Called
    once at engine start-up."""
    lossless = True
    for info in infos:
        reason = lossy_reason(info)
        if reason is not None:
            logger.warning("speculative decoding is not lossless: %s", reason)
            lossless = False
    return lossless


class SpeculativeConfig(BaseModel):
    """vLLM's ``speculative_config``. Fields a strategy defines itself (``prompt_lookup_max``
    for n-gram, ...) are passed on to that strategy's own ``Config`` which rejects unknown ones."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    method: str | None = None
    model: str | None = None
    num_speculative_tokens: int | None = Field(None, ge=1, le=64)
    # vLLM's option, common to every method: the drafter is not sharded (it runs on rank 0,
    # whatever the target's tensor_parallel_size), so 1 is the only value
    draft_tensor_parallel_size: int | None = Field(None, ge=1)
    disable_by_batch_size: int | None = Field(None, ge=1)
    acceptance_method: str = "rejection_sampler"
    # engine-level: run plain steps while speculative ones measure slower (engine/spec_control.py)
    auto_disable: bool = False
    auto_disable_tolerance: float = Field(0.05, ge=0.0, lt=1.0)  # off below (1 - this) x plain
    auto_disable_interval: int = Field(64, ge=2, le=65536)  # most steps between two measurements
    # engine-level: plugin faults (bad proposals, hooks that raise; docs/hooks.md "Faults") after
    # which the engine stops speculating (plain decoding from then on)
    max_plugin_faults: int = Field(3, ge=1, le=1_000_000)

    @field_validator("draft_tensor_parallel_size")
    @classmethod
    def _draft_tp(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError(
                f"draft_tensor_parallel_size={v}: tensor parallelism is not supported yet for "
                "the drafter (it runs unsharded on rank 0's device, whatever the target's "
                "tensor_parallel_size); use draft_tensor_parallel_size=1 or leave it out"
            )
        return v

    @model_validator(mode="after")
    def _method(self) -> SpeculativeConfig:
        if self.model is not None:  # a shipped head's name (spec_registry/shipped.py)
            from speculant.spec_registry.shipped import resolve_shipped

            head = resolve_shipped(self.model, self.method)
            if head is not None:
                self.method, self.model = head.method, str(head.folder)
        if self.method is None:
            if self.model in ("[ngram]", "ngram"):
                self.method, self.model = "ngram", None
            elif self.model is not None:
                self.method = infer_method(self.model)
            else:
                raise ValueError("speculative_config needs a `method` (e.g. \"ngram\") or a `model`")
        return self

    @property
    def strategy_options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


def infer_method(model: str) -> str:
    """Ask every proposer strategy whether it recognises the checkpoint (its folder and
    config.json). ``model`` is a local folder, a .gguf file, or a hub id found in the local
    Hugging Face cache (or downloaded where a network exists), as the strategies will load it."""
    from speculant.models.loader import resolve_model

    path = Path(model).expanduser()
    if not path.is_dir():
        try:
            path = resolve_model(model)
        except Exception as e:
            raise StrategyError(
                f"cannot infer the speculative method of {model!r}: its checkpoint cannot be "
                f"read ({e}). Set `method` explicitly (e.g. \"draft_model\", \"eagle\", "
                "\"eagle3\", \"mlp_speculator\") and pass a checkpoint that exists here"
            ) from None
    cfg_file = path / "config.json"
    config: dict[str, Any] = {}
    if cfg_file.exists():
        try:
            config = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise StrategyError(f"{cfg_file}: invalid JSON ({e})") from None
    fallback = None
    for info in {info.cls: info for info in _by_name("proposer").values()}.values():
        if info.matches_model(path, config):
            return info.name
        if info.default_for_model:
            fallback = info.name
    if fallback is None:
        raise StrategyError(
            f"cannot infer the speculative method for model {model!r}; set `method` explicitly"
        )
    return fallback


_LEGACY = {
    "speculative_model": "model",
    "num_speculative_tokens": "num_speculative_tokens",
    "ngram_prompt_lookup_max": "prompt_lookup_max",
    "ngram_prompt_lookup_min": "prompt_lookup_min",
    "speculative_disable_by_batch_size": "disable_by_batch_size",
    "speculative_draft_tensor_parallel_size": "draft_tensor_parallel_size",
    "spec_decoding_acceptance_method": "acceptance_method",
}


def pop_legacy_kwargs(kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """Turn vLLM's old flat keywords into a speculative_config dict (with a warning)."""
    found = {k: kwargs.pop(k) for k in list(kwargs) if k in _LEGACY}
    found = {k: v for k, v in found.items() if v is not None}
    if not found:
        return None
    warnings.warn(
        f"the flat keywords {sorted(found)} are deprecated (as in vLLM); pass "
        "speculative_config={...} instead",
        DeprecationWarning,
        stacklevel=3,
    )
    return {_LEGACY[k]: v for k, v in found.items()}


# SpeculativeConfig fields the engine consumes itself (never passed to a strategy's Config)
ENGINE_OPTIONS = ("method", "acceptance_method", "disable_by_batch_size", "draft_tensor_parallel_size",
                  "auto_disable", "auto_disable_tolerance", "auto_disable_interval",
                  "max_plugin_faults")


def build_strategy_config(strategy: type | StrategyInfo, spec: SpeculativeConfig) -> BaseModel | None:
    """Validate the options meant for ``strategy`` (a class or its :class:`StrategyInfo`) with
    its own pydantic ``Config``."""
    info = strategy if isinstance(strategy, StrategyInfo) else strategy_info(strategy)
    Config, name = info.Config, info.name
    data = {k: v for k, v in spec.model_dump(exclude_none=True).items()
            if k not in ENGINE_OPTIONS}
    data.update(spec.strategy_options)
    if Config is None:
        extra = sorted(set(data) - {"num_speculative_tokens"})
        if extra:
            raise StrategyError(f"strategy {name!r} takes no options, got {extra}")
        return None
    known = set(Config.model_fields)
    unknown = sorted(set(data) - known)
    if unknown:
        raise StrategyError(
            f"speculative_config for method {name!r}: unknown option(s) {unknown}; "
            f"{name!r} accepts {sorted(known)}, and every method "
            f"{sorted(set(ENGINE_OPTIONS) - {'method'})}"
        )
    try:
        return Config(**data)
    except ValidationError as e:
        raise StrategyError(f"speculative_config for method {name!r} is invalid:\n{e}") from None


__all__ = [
    "SpeculativeConfig", "StrategyError", "available_strategies", "check_lossless", "get_strategy",
    "infer_method", "pop_legacy_kwargs", "build_strategy_config", "strategies_by_plugin",
    "lookup", "lossy_reason",
]
