"""speculant.drafting: the public toolkit of model-based proposers (docs/drafting.md).

Everything a learned strategy (a draft model, EAGLE, MLPSpeculator, Medusa, ...) needs beyond the
hook API (:mod:`speculant.hookspecs`, :mod:`speculant.spec_types`), and nothing engine-private.
Built-in strategies (``plugins/``) and third-party packages import only from here, from
``speculant``, ``speculant.hookspecs`` and ``speculant.spec_types`` (tests/test_public_api.py).

Each submodule declares its public names in its own ``__all__``; this package re-exports them
all, so ``from speculant.drafting import X`` is the one spelling plugins use.
"""

from __future__ import annotations

from speculant.drafting import (
    checkpoint,
    graphs,
    head_drafter,
    heads,
    kv_cache,
    lookup,
    runner,
    sampling,
    token_map,
    tree_verification,
    trees,
    verification,
)
from speculant.drafting.checkpoint import *  # noqa: F403
from speculant.drafting.graphs import *  # noqa: F403
from speculant.drafting.head_drafter import *  # noqa: F403
from speculant.drafting.heads import *  # noqa: F403
from speculant.drafting.kv_cache import *  # noqa: F403
from speculant.drafting.lookup import *  # noqa: F403
from speculant.drafting.runner import *  # noqa: F403
from speculant.drafting.sampling import *  # noqa: F403
from speculant.drafting.token_map import *  # noqa: F403
from speculant.drafting.tree_verification import *  # noqa: F403
from speculant.drafting.trees import *  # noqa: F403
from speculant.drafting.verification import *  # noqa: F403
from speculant.spec_types import StrategyError

_MODULES = (checkpoint, graphs, kv_cache, lookup, heads, head_drafter, runner, sampling, token_map,
            verification, tree_verification, trees)
__all__ = ["StrategyError", *(name for m in _MODULES for name in m.__all__)]
