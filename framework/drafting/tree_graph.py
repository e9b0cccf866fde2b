"""The levels of a :class:`~speculant.drafting.trees.HeadTreeDrafter`'s tree as one CUDA graph
replay per propose: every head level over the frontier paths (tree-masked attention), the
head's ranked tokens after each, the frontier's top-k by cumulative score (EAGLE-2) or a static
shape's node fill, and the gathers between them (``HeadTreeDrafter.draft``). The catch-up forward
before it stays eager (its row count follows the accepted tokens); its states are copied into
the graph's static input.

One graph per padded batch bucket ``Bp`` (:func:`~speculant.drafting.graphs.bucket`) in the
drafter's ``GraphCache``, block tables ``HeadTreeDrafter.graph_width`` wide; captured at start-up
for every bucket up to ``max_num_seqs`` (:func:`capture_all`, the ``capture_graphs`` hook) on
padding inputs, other buckets on first use. Inputs: ``ints`` (int64, the layout of
:class:`~speculant.drafting.trees.TreeInputs`; the graph's first node copies it from a pinned
host vector the host writes: ``pinned_copy``) and ``x`` (``[Bp, H]`` catch-up states). Padding
sequences (``live`` 0) write no K/V (slot -1) and attend nothing (context length 0, an empty
query range). Calls of more than 256 drafting sequences, or with a block table wider than the
graph's, return None and run eagerly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from speculant.drafting.graphs import BUCKETS, bucket
from speculant.kernels.stage_copy import pinned_copy

if TYPE_CHECKING:
    from speculant.drafting.head_drafter import CatchUp
    from speculant.drafting.trees import HeadTreeDrafter

MAX_BATCH = BUCKETS[-1]


def entry(tree: HeadTreeDrafter, Bp: int):
    """(key, its static inputs ([n_ints] device, [Bp, H] catch-up states, [n_ints] pinned host),
    the function the graph captures) of the tree graph of batch bucket ``Bp``."""
    d = tree.drafter
    dev, graphs, W = d.ctx.device, d.graphs, tree.graph_width
    n_ints = tree.num_ints(Bp, W)

    def make() -> tuple[torch.Tensor, ...]:
        return (
            torch.zeros(n_ints, dtype=torch.long, device=dev),
            torch.zeros(Bp, d.hidden_size, dtype=d.ctx.dtype, device=dev),
            graphs.host_vector(n_ints),
        )

    key = ("tree", Bp)
    bufs = graphs.buffers(key, make)  # [n_ints], [Bp, H], [n_ints]

    def fn(ints: torch.Tensor, xs: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
        pinned_copy(host, ints)  # [n_ints] pinned -> device: the graph's first node
        return tree.draft(ints, xs, W)  # dynamic [Bp, 3, C] float64, static [Bp, nodes] int64

    return key, bufs, fn


def draft_graph(
    tree: HeadTreeDrafter,
    x: torch.Tensor,  # [A, H] the catch-up states of the drafting sequences
    rows: list[CatchUp],  # the A drafting sequences
) -> torch.Tensor | None:  # [A, ...] HeadTreeDrafter.draft's rows; None: not in a graph
    """``tree.draft`` of ``rows`` as a replay of the graph of their batch bucket (the capture
    on first use), or None where graphs are off or the call does not fit one."""
    graphs, A, W = tree.drafter.graphs, len(rows), tree.graph_width
    if not graphs.enabled or A > MAX_BATCH or any(len(p.st.table) > W for p in rows):
        return None
    Bp = bucket(A)
    key, (ints_buf, x_buf, host), fn = entry(tree, Bp)
    tree.write_ints(graphs.writable(host), rows, Bp, W)  # the graph copies it
    x_buf[:A].copy_(x)
    out = graphs.replay(key, fn)
    if out is None:  # the capture failed: eagerly, on the same buffers
        out = fn(ints_buf, x_buf, host)
    return out[:A]


def capture_all(tree: HeadTreeDrafter, max_seqs: int, progress: bool = True) -> int:
    """Capture now, on padding inputs (nothing written to the draft cache), the tree graph of
    every batch bucket up to ``max_seqs`` sequences (at most 256) not captured yet. Returns how
    many were captured."""
    d, W = tree.drafter, tree.graph_width
    top = bucket(min(max_seqs, MAX_BATCH))

    def pad(host: np.ndarray, Bp: int) -> None:
        tree.padding_ints(host, Bp, W)

    return d.graphs.capture_all(
        [b for b in BUCKETS if b <= top],
        lambda Bp: entry(tree, Bp),
        pad,
        f"Capturing {d.name} tree graphs",
        progress,
    )
