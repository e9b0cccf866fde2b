"""The process-wide plugin manager: loads plugin modules from the ``speculant.strategies``
entry-point group (built-ins and third-party alike) and collects the strategies they register.

Environment:
- ``SPECULANT_PLUGINS=a,b``: load only these entry points (allow-list).
- ``SPECULANT_DISABLE_PLUGINS=a,b``: never load these (block-list).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import pluggy

from speculant import hookspecs

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
    v = os.environ.get(name)
    if v is None:
        return None
    return {x.strip() for x in v.split(",") if x.strip()}


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


def list_plugins() -> list[dict]:
    """Loaded plugins with their distribution, version, hooks and the strategies they provide."""
    from speculant.spec_registry import strategies_by_plugin

    pm = get_plugin_manager()
    by_plugin = strategies_by_plugin()
    out = []
    for name, plugin in pm.list_name_plugin():
        info = _infos.get(name) or PluginInfo(name, plugin)
        hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or [])
        strategies = []
        for cls in by_plugin.get(name, []):
            impl = sorted(h for h in hookspecs.HOOK_NAMES if callable(getattr(cls, h, None))
                          and hasattr(getattr(cls, h), "speculant_impl"))
            strategies.append({"name": cls.name, "kind": getattr(cls, "kind", "proposer"),
                               "hooks": impl})
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
