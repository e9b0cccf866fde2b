"""speculant.drafting: the public toolkit of model-based proposers (docs/drafting.md).

Everything a learned strategy (a draft model, EAGLE, MLPSpeculator, Medusa, ...) needs beyond the
hook API (:mod:`speculant.hookspecs`, :mod:`speculant.spec_types`), and nothing engine-private:

- reading a draft or head checkpoint (:func:`resolve_draft_folder`, :func:`read_config_json`,
  :func:`iter_checkpoint`, :func:`checkpoint_keys`, :func:`target_hidden_size`);
- draft sampling that keeps the draft probabilities ``q`` the lossless verifier needs
  (:class:`DraftSampler`) and reading a call's drafts back (:func:`split_drafts`);
- CUDA graphs of a draft loop (:class:`GraphCache`, :data:`BUCKETS`, :func:`bucket`,
  :func:`to_device_async`);
- token maps (FR-Spec: :class:`HotHead`, :func:`load_token_map`, :func:`build_token_map`, ...);
- the building blocks the built-in draft networks use: the target's own layers and kernels.

Built-in strategies (``plugins/``) and third-party packages import only from here, from
``speculant``, ``speculant.hookspecs`` and ``speculant.spec_types`` (tests/test_public_api.py).
"""

from __future__ import annotations

from speculant.drafting.blocks import *  # noqa: F403
from speculant.drafting.blocks import __all__ as _blocks
from speculant.drafting.checkpoint import (
    checkpoint_files,
    checkpoint_keys,
    iter_checkpoint,
    read_config_json,
    resolve_draft_folder,
    target_hidden_size,
)
from speculant.drafting.graphs import BUCKETS, GraphCache, bucket, graphs_wanted, to_device_async
from speculant.drafting.sampling import DraftSampler, split_drafts
from speculant.drafting.token_map import (
    HotHead,
    TokenMapError,
    ascending_ids,
    build_token_map,
    build_token_map_from_corpus,
    count_tokens,
    hot_argmax,
    load_token_map,
    save_token_map,
    scatter_hot,
)
from speculant.spec_types import StrategyError

__all__ = [
    # checkpoints
    "checkpoint_files",
    "checkpoint_keys",
    "iter_checkpoint",
    "read_config_json",
    "resolve_draft_folder",
    "target_hidden_size",
    # graphs
    "BUCKETS",
    "GraphCache",
    "bucket",
    "graphs_wanted",
    "to_device_async",
    # sampling
    "DraftSampler",
    "split_drafts",
    # token maps
    "HotHead",
    "TokenMapError",
    "build_token_map",
    "build_token_map_from_corpus",
    "count_tokens",
    "ascending_ids",
    "hot_argmax",
    "load_token_map",
    "save_token_map",
    "scatter_hot",
    # errors
    "StrategyError",
    # building blocks (drafting/blocks.py)
    *_blocks,
]
