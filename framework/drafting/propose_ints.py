"""The int64 inputs of a one-graph greedy propose (the catch-up forward, the gather of each
sequence's last catch-up row, K greedy steps), one layout for both: :mod:`head_graph
<speculant.drafting.head_graph>` (heads on the target's features) and :mod:`draft_graph
<speculant.drafting.draft_graph>` (draft models) fill it, and the C staging's ``eagle_ints`` and
``draft_ints`` write it. With M = Bp * Q catch-up rows over Bp padded sequences, S = K - 1 steps
and block tables of width W::

    ids [M] | positions [M] | slots [M] | context lens [Bp] | query starts [Bp + 1] |
    last catch-up row of each sequence [Bp] | step positions [S, Bp] | step slots [S, Bp] |
    step context lens [S, Bp] | step query starts [Bp + 1] | block tables [Bp, W]

The last five parts alone are a chain's inputs (K steps after an eager catch-up:
``chain_sizes``); the block tables serve the catch-up and the steps. Padding follows
engine/cuda_graph.py: a padding row has token 0, position 0 and slot -1 (store_kv skips it), a
padding sequence context length 0 and an empty query range (the attention kernel skips it).
"""

from __future__ import annotations

import numpy as np

PARTS = (
    "ids", "positions", "slots", "context_lens", "query_starts", "last", "step_positions",
    "step_slots", "step_context_lens", "step_query_starts", "block_tables",
)  # fmt: skip


def sizes(Bp: int, Q: int, K: int, W: int) -> list[int]:
    """The length of each of the :data:`PARTS`, in order."""
    M = Bp * Q
    return [M, M, M, Bp, Bp + 1, Bp, *chain_sizes(Bp, K, W)]


def chain_sizes(Bp: int, K: int, W: int) -> list[int]:
    """The lengths of the last five parts (step positions .. block tables)."""
    S = (K - 1) * Bp
    return [S, S, S, Bp + 1, Bp * W]


def padding_ints(out: np.ndarray, Bp: int, Q: int, K: int, W: int) -> None:
    """The ints of a call in which every row is padding: token 0 at position 0 and slot -1 in
    the catch-up and in every step (no K/V written), context length 0 and empty query ranges
    everywhere (nothing attended), block tables 0."""
    out[:] = 0
    M = Bp * Q
    out[2 * M : 3 * M] = -1  # catch-up slots
    chain_padding(out[3 * M + 3 * Bp + 1 :], Bp, K)


def chain_padding(out: np.ndarray, Bp: int, K: int) -> None:
    """The chain part of :func:`padding_ints` alone: every step's slots -1, the rest 0."""
    out[:] = 0
    S = (K - 1) * Bp
    out[S : 2 * S] = -1
