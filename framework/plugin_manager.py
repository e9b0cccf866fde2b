"""The process-wide plugin manager: loads plugin modules from the ``speculant.strategies``
entry-point group (built-ins and third-party alike) and collects the strategies they register
(:func:`collect_strategies`; :mod:`speculant.spec_registry` looks them up by name).

Environment:
- ``SPECULANT_PLUGINS=a,b``: load only these entry points (allow-list).
- ``SPECULANT_DISABLE_PLUGINS=a,b``: never load these (block-list).
"""

from __future__ import annotations

import importlib.metadata as md
import sys
from dataclasses import dataclass, field
from typing import Any

import pluggy

from speculant import hookspecs
from speculant.envs import env_list
from speculant.hookspecs import StrategyInfo, strategy_info
from speculant.spec_types import StrategyError

ENTRY_POINT_GROUP = "speculant.strategies"


class PluginError(RuntimeError):
    pass


@dataclass
class PluginInfo:
    name: str
    module: Any
    distribution: str | None = None
    version: str | None = None
    strategies: list[str] = field(default_factory=list)


_pm: pluggy.PluginManager | None = None
_infos: dict[str, PluginInfo] = {}


def _csv_env(name: str) -> set[str] | None:
    v = env_list(name)
    return None if v is None else set(v)


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide manager, created and populated from entry points on first use."""
    global _pm
    if _pm is not None:
        return _pm
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    allow, block = _csv_env("SPECULANT_PLUGINS"), _csv_env("SPECULANT_DISABLE_PLUGINS")
    for ep in sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        if (allow is not None and ep.name not in allow) or (block and ep.name in block):
            continue
        if pm.has_plugin(ep.name):
            continue
        try:
            module = ep.load()
        except Exception as e:
            raise PluginError(
                f"plugin {ep.name!r} ({ep.value}) from entry-point group {ENTRY_POINT_GROUP!r} "
                f"failed to import: {type(e).__name__}: {e}. Uninstall it or block it with "
                f"SPECULANT_DISABLE_PLUGINS={ep.name}"
            ) from e
        pm.register(module, name=ep.name)
        dist = getattr(ep, "dist", None)
        _infos[ep.name] = PluginInfo(ep.name, module, dist.name if dist else None,
                                     dist.version if dist else None)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as e:
        raise PluginError(f"a plugin implements a hook that does not exist: {e}") from e
    _pm = pm
    return pm


def register(plugin: Any, name: str | None = None) -> str:
    """Register a plugin module or object directly (tests, notebooks). Returns its name."""
    pm = get_plugin_manager()
    registered = pm.register(plugin, name=name)
    if registered is None:
        raise PluginError(f"plugin {name or plugin!r} is already registered or blocked")
    pm.check_pending()
    _infos[registered] = PluginInfo(registered, plugin, None, None)
    return registered


def unregister(name: str) -> None:
    pm = get_plugin_manager()
    if pm.has_plugin(name):
        pm.unregister(name=name)
    _infos.pop(name, None)


def plugin_info(name: str) -> PluginInfo | None:
    """What is known of the loaded plugin ``name``: its distribution and version (None for one
    registered directly, or an unknown name)."""
    get_plugin_manager()
    return _infos.get(name)


def collect_strategies() -> list[StrategyInfo]:
    """Every strategy class the loaded plugins register (their ``register_strategies`` hooks run
    now), each checked against the :class:`~speculant.hookspecs.Strategy` contract, in
    registration order. Raises :class:`~speculant.spec_types.StrategyError` for a class whose
    attributes break the contract, or a name (or alias) two classes claim."""
    pm = get_plugin_manager()
    found: list[StrategyInfo] = []
    owner: dict[str, StrategyInfo] = {}
    for impl in pm.hook.register_strategies.get_hookimpls():
        classes: list[type] = []
        if "register" in impl.argnames:
            impl.function(register=classes.append)
        for cls in classes:
            info = strategy_info(cls, impl.plugin_name)
            for key in (info.name, *info.aliases):
                if key in owner and owner[key].cls is not cls:
                    raise StrategyError(
                        f"strategy name {key!r} is registered twice ({owner[key].cls.__module__} "
                        f"and {cls.__module__}); block one with SPECULANT_DISABLE_PLUGINS"
                    )
                owner[key] = info
            found.append(info)
    return found


def list_plugins() -> list[dict]:
    """Loaded plugins with their distribution, version, hooks and the strategies they provide
    (each: name, kind, hooks, ``lossless`` and whether the class declared it,
    :attr:`speculant.hookspecs.Strategy.lossless`)."""
    pm = get_plugin_manager()
    by_plugin: dict[str, list[StrategyInfo]] = {}
    for info in collect_strategies():
        by_plugin.setdefault(info.plugin, []).append(info)
    out = []
    for name, plugin in pm.list_name_plugin():
        info = _infos.get(name) or PluginInfo(name, plugin)
        hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or [])
        strategies = []
        for s in by_plugin.get(name, []):
            impl = sorted(h for h in hookspecs.HOOK_NAMES if callable(getattr(s.cls, h, None))
                          and hasattr(getattr(s.cls, h), "speculant_impl"))
            strategies.append({"name": s.name, "kind": s.kind, "hooks": impl,
                               "lossless": s.lossless, "lossless_declared": s.lossless_declared})
        out.append({
            "name": name,
            "distribution": info.distribution,
            "version": info.version or getattr(info.module, "__version__", None),
            "hooks": hooks,
            "strategies": strategies,
        })
    return out


def _reset_for_tests() -> None:
    global _pm
    _pm = None
    _infos.clear()
    sys.modules.pop("speculant._never", None)
