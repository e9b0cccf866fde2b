"""CUDA graphs of a proposer's draft loop: :class:`GraphCache` (one graph per key over static
input buffers, captured on first use or at start-up), the padded batch sizes (:data:`BUCKETS`),
and :func:`to_device_async` (host values to the device without a synchronisation)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np
import torch

from speculant.engine.cuda_graph import gc_paused
from speculant.kernels.stage_copy import pinned_copy

logger = logging.getLogger("speculant")


def to_device_async(
    values: Sequence[float] | np.ndarray | torch.Tensor,  # python numbers, numpy or a CPU tensor
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """A tensor of ``values`` on ``device``. On CUDA it goes through pinned memory with an
    asynchronous copy: ``torch.tensor(values, device="cuda")`` copies from pageable memory,
    which waits for everything queued on the stream (a full synchronisation)."""
    if isinstance(values, torch.Tensor):
        t = values.to(dtype)
    elif isinstance(values, np.ndarray):
        t = torch.from_numpy(values).to(dtype)
    else:
        t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    # the caching host allocator keeps the pinned block alive until the copy has run
    return t.pin_memory().to(device, non_blocking=True)


def graphs_wanted(device: torch.device, enforce_eager: bool = False) -> bool:
    """Whether a proposer's draft loop should run as CUDA graphs: on CUDA with the Triton
    kernels (the torch attention path builds host tensors per call and cannot be captured),
    unless the engine runs eagerly (``enforce_eager``: ``StrategyContext.enforce_eager``)."""
    if device.type != "cuda" or enforce_eager:
        return False
    from speculant.kernels._triton_utils import triton_enabled

    return triton_enabled()


class GraphCache:
    """CUDA graphs of a function over static input buffers, one per key, captured on first use
    (or ahead, at start-up, by the strategies' ``capture_graphs`` hooks with padding inputs).

    ``buffers(key, make)`` returns the static inputs of ``key`` (made by ``make`` on first use);
    the caller fills them, then ``replay(key, fn)`` captures ``fn(*inputs)`` on first use and
    replays it, returning its (static) outputs: read or copy them before the next replay of the
    same key. The warm-up run before a capture executes ``fn`` once on the inputs as they are
    (so ``fn`` must be idempotent for given inputs, e.g. write the same K/V twice). If a capture
    fails the cache turns itself off (``enabled`` False) and the caller runs ``fn`` eagerly."""

    def __init__(self, device: torch.device, what: str, enforce_eager: bool = False) -> None:
        self.device = device
        self.what = what
        self.enabled = graphs_wanted(device, enforce_eager)
        self.inputs: dict[Any, tuple[torch.Tensor, ...]] = {}
        self.graphs: dict[Any, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self.pool = None
        self.inflight = False  # a replay whose pinned inputs may not have been read yet

    def buffers(
        self, key: Hashable, make: Callable[[], tuple[torch.Tensor, ...]]
    ) -> tuple[torch.Tensor, ...]:
        """The static inputs of ``key``, made by ``make()`` on first use (the last one, when the
        graph stages host values itself, a ``host_vector``)."""
        if key not in self.inputs:
            self.inputs[key] = make()
        return self.inputs[key]

    def host_vector(self, n: int) -> torch.Tensor:
        """A host int64 vector [n] for graph inputs the graph copies itself: pinned on CUDA (the
        graph's first node reads it with ``kernels/stage_copy.pinned_copy``), plain on CPU."""
        return torch.zeros(n, dtype=torch.long, pin_memory=self.device.type == "cuda")

    def writable(self, host: torch.Tensor) -> np.ndarray:
        """``host`` (a ``host_vector``) as a numpy array to write a call's inputs into, once the
        last replay has run (its pinned inputs may then be rewritten). The proposers read each
        call's drafts back (``split_drafts(..., graphs=)`` then calls ``consumed``) before they
        stage the next call, so this is a flag test; otherwise it waits for the stream."""
        if self.inflight:
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            self.inflight = False
        return host.numpy()

    def consumed(self) -> None:
        """The caller has read back results of work queued after the last replay: that replay
        has run."""
        self.inflight = False

    def replay(self, key: Hashable, fn: Callable[..., Any]) -> Any | None:
        """The outputs of ``fn`` on the static inputs of ``key``; None if the capture failed."""
        entry = self.graphs.get(key)
        if entry is None:
            try:
                entry = self.graphs[key] = self._capture(fn, self.inputs[key])
            except Exception as e:  # noqa: BLE001 - fall back to eager, say why
                torch.cuda.synchronize(self.device)
                self.enabled = False
                logger.warning(
                    "%s: CUDA graph capture failed, running eagerly (%s: %s)",
                    self.what,
                    type(e).__name__,
                    e,
                )
                return None
        entry[0].replay()
        self.inflight = True
        return entry[1]

    def capture_all(
        self,
        items: list,
        entry: Callable[[Any], tuple[Any, tuple[torch.Tensor, ...], Callable[..., Any]]],
        pad: Callable[[np.ndarray, Any], None],
        desc: str,
        progress: bool = True,
    ) -> int:
        """Capture now the graph of each of ``items`` not captured yet (a strategy's start-up
        capture, its ``capture_graphs`` hook): ``entry(item)`` gives (key, its static inputs, the
        last one the pinned host vector, the function to capture), ``pad(host, item)`` writes
        padding inputs into the host vector (nothing written to a cache, nothing attended). A
        tqdm bar shows progress. Returns how many were captured (fewer if a capture failed: the
        cache is then off)."""
        from tqdm.auto import tqdm

        if not self.enabled:
            return 0
        todo = [(item, *entry(item)) for item in items]
        todo = [t for t in todo if t[1] not in self.graphs]
        done = 0
        for item, key, bufs, fn in tqdm(
            todo, desc=desc, unit="graph", disable=not progress or not todo, dynamic_ncols=True
        ):
            pad(self.writable(bufs[-1]), item)
            if self.replay(key, fn) is None:
                break
            done += 1
        if todo and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.consumed()  # the replays ran: the pinned inputs may be rewritten
        return done

    def _capture(self, fn, inputs):
        cur = torch.cuda.current_stream(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(cur)
        with torch.cuda.stream(stream):  # warm-up: compiles kernels for these shapes
            fn(*inputs)
        cur.wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with gc_paused(), torch.cuda.graph(graph, pool=self.pool):
            out = fn(*inputs)
        return graph, out


class ChainGraphs(GraphCache):
    """CUDA graphs of a greedy draft chain conditioned, per sequence, on one state row and the
    last token (MLPSpeculator, a Medusa or MTP head): ``chain(state, tokens, K)`` maps states
    ``[rows, width]`` (in ``dtype``) and tokens ``[rows]`` int64 to K greedy drafts ``[rows, K]``
    int64 with device-side work only (no host reads, shapes fixed by the inputs').

    One graph per (padded batch :func:`bucket`, K): :meth:`run` copies the rows into that
    graph's static inputs (the tokens through a pinned host vector that the graph's first node
    reads, so staging costs no copy call) and replays it; :meth:`capture` makes them all at
    start-up (the strategy's ``capture_graphs`` hook). Read each result back with
    :func:`~speculant.drafting.split_drafts` (``graphs=`` this object) before the next run."""

    def __init__(
        self,
        device: torch.device,
        what: str,
        enforce_eager: bool,
        width: int,
        dtype: torch.dtype,
        chain: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
    ) -> None:
        super().__init__(device, what, enforce_eager)
        self.width = width
        self.dtype = dtype
        self.chain = chain

    def run(self, state: torch.Tensor, tokens: list[int], K: int) -> torch.Tensor | None:
        """state [rows, width], tokens: the last token of each row -> drafts [rows, K] int64
        on the device, from the graph of (bucket(rows), K). None when graphs are off, rows >
        256 or the capture failed: the caller then runs ``chain`` eagerly."""
        n = state.shape[0]
        if not self.enabled or n > BUCKETS[-1]:
            return None
        key, (st_buf, _tok_buf, host), fn = self._entry(bucket(n), K)
        st_buf[:n].copy_(state)
        self.writable(host)[:n] = tokens  # the graph copies it
        out = self.replay(key, fn)
        return None if out is None else out[:n]

    def capture(self, K: int, max_num_seqs: int, progress: bool = True) -> int:
        """Capture the graph of every bucket up to ``max_num_seqs`` rows (at most 256) for K
        steps, on zero states and tokens. Returns how many were captured."""
        top = bucket(min(max_num_seqs, BUCKETS[-1]))

        def zeros(host: np.ndarray, Bp: int) -> None:
            host[:] = 0

        return self.capture_all(
            [b for b in BUCKETS if b <= top],
            lambda Bp: self._entry(Bp, K),
            zeros,
            f"Capturing {self.what} graphs",
            progress,
        )

    def _entry(self, Bp: int, K: int):
        """(key, its static inputs ([Bp, width] states, [Bp] tokens, [Bp] pinned host tokens),
        the function the graph captures) of one (Bp, K) graph."""
        def make() -> tuple[torch.Tensor, ...]:
            return (
                torch.zeros(Bp, self.width, dtype=self.dtype, device=self.device),
                torch.zeros(Bp, dtype=torch.long, device=self.device),
                self.host_vector(Bp),
            )

        key = (Bp, K)
        bufs = self.buffers(key, make)  # [Bp, width], [Bp], [Bp]

        def fn(st: torch.Tensor, tok: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
            pinned_copy(host, tok)  # [Bp] pinned -> device: the graph's first node
            return self.chain(st, tok, K)  # [Bp, K]

        return key, bufs, fn


BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)  # padded batch sizes of graphs


def bucket(n: int) -> int:
    """Padded batch size of a captured draft loop (n <= 256; larger n runs eagerly)."""
    for b in BUCKETS:
        if b >= n:
            return b
    return n


__all__ = [
    "BUCKETS",
    "ChainGraphs",
    "GraphCache",
    "bucket",
    "graphs_wanted",
    "to_device_async",
]
