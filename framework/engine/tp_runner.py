"""Rank 0's target runner under tensor parallelism, and the worker side of its calls.

Every rank holds a shard of the target (``speculant.distributed``) and its own ``ModelRunner``
over that shard's KV cache (its KV heads). Rank 0 owns everything else: scheduler, block
manager, sampler, strategies, drafters. :class:`TPRunner` is the runner rank 0's engine calls:
``forward``, ``score`` and ``capture_graphs`` are first sent to the workers (one broadcast over
NCCL on CUDA, gloo on the CPU: :class:`Channel`), then run on rank 0's local runner; ``compact_tree``
runs on rank 0's runner at once and travels in the next call's message. A worker
(``speculant.distributed.worker``) runs the very same method of its own runner with the same
arguments (:func:`receive_call`, :func:`apply_call`), so every rank takes the same code path,
replays or captures the same CUDA graphs and issues the same all-reduces in the same order; the
hidden states after each row-parallel layer are all-reduced, so rank 0's ``forward`` returns
what one device would. ``logits`` (the replicated LM head) runs on rank 0 only.

The message of one call is one int64 vector (layout below), sent with one broadcast of a buffer
whose size both sides know in advance (:class:`Channel`): each message names the size of the
next one's buffer, the power of two above its own length (at least ``MIN_CAPACITY``), so steps of
a steady batch take one broadcast each, a batch-1 decode step a small one, and only a message
that outgrew its buffer (a long prompt's prefill) a second broadcast with the rest. Tokens still
on the device (``token_ids``: the overlapped decode steps of engine/async_decode.py) follow on
the device group (NCCL on CUDA).

Layout: ``[length, next capacity, op, flags, n_seqs, n_aux, max_seqs, max_query, max_prefill,
aux..., per sequence (query_len, num_cached_tokens, table_len)..., tokens..., block tables...,
trees..., compactions...]``; ``tokens`` is left out when they come on the device (flag
``_TOKENS_ON_DEVICE``). Two optional sections follow, each present only with its flag:

* ``trees`` (flag ``_TREES``, a tree step: ``ModelRunner.forward`` / ``score`` with ``trees=``,
  docs/trees.md): per sequence its tree's node count (``-1``: a chain; a tree sequence's query
  is its root and its nodes, ``query_len = nodes + 1``), then every tree's ``parents``. Every
  rank derives the same RoPE positions and ancestor bits from them (``tree_step_rows``), so
  every rank scores the same tree rows and writes the same rows' K/V to its own KV heads.
* ``compactions`` (flag ``_COMPACT``): the ``compact_tree`` calls rank 0 made since its previous
  message, applied by a worker *before* this message's call, in order:
  ``n_groups``, then per group ``n``, per sequence ``(ctx_start, path_len, table_len)``, the
  paths (in-step rows), the block tables as they were at the compaction. Rank 0 compacts its own
  cache at once; a worker's cache is only read by its next call, so it compacts there, and a
  tree step costs no broadcast of its own (the compaction rides on the next step's message).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from speculant.distributed.parallel import TensorParallel
from speculant.engine.model_runner import ModelRunner

MIN_CAPACITY = 512  # int64 entries of the smallest broadcast buffer: 4 KiB
MAX_CAPACITY = 1 << 16  # and of the largest (512 KiB); a longer message takes two broadcasts
FORWARD, SCORE, CAPTURE, SHUTDOWN = 1, 2, 3, 4
_TOKENS_ON_DEVICE, _GREEDY, _KEEP_HIDDEN, _HEAD, _TREES, _COMPACT = 1, 2, 4, 8, 16, 32
_HEADER = 9  # length, next capacity, op, flags, n_seqs, n_aux, max_seqs, max_query, max_prefill


@dataclass(slots=True)
class RemoteSeq:
    """What a runner reads of a sequence, rebuilt on a worker from rank 0's message."""

    num_cached_tokens: int
    block_table: list[int]


@dataclass
class Call:
    """One runner call as a worker receives it."""

    op: int
    flags: int = 0
    aux_layers: tuple[int, ...] = ()
    seqs: list[RemoteSeq] = field(default_factory=list)
    new_tokens: list[list[int]] = field(default_factory=list)
    token_ids: torch.Tensor | None = None  # [num_tokens] int64 on the device, or None
    max_seqs: int = 0
    max_query: int = 0
    max_prefill: int | None = None
    trees: list[list[int] | None] | None = None  # per sequence: its tree's parents, or None
    compactions: list[Compaction] = field(default_factory=list)  # to apply before the call


@dataclass
class Compaction:
    """One ``compact_tree`` call of rank 0, as a worker repeats it."""

    seqs: list[RemoteSeq]  # block tables at the compaction (num_cached_tokens unused: 0)
    ctx_starts: list[int]  # [n]: each sequence's root position
    paths: list[list[int]]  # [n][path_len]: the accepted nodes' in-step rows


def pack_call(op: int, flags: int = 0, aux_layers=(), seqs=(), new_tokens=(), max_seqs: int = 0,
              max_query: int = 0, max_prefill: int | None = None, trees=None,
              compactions=()) -> list[int]:
    """The message of one call (module docstring's layout) as a list of ints. ``trees``: per
    sequence its tree's parents or None (sets ``_TREES`` unless every entry is None);
    ``compactions``: :class:`Compaction` groups to apply first (sets ``_COMPACT``)."""
    flags &= ~(_TREES | _COMPACT)
    if trees is not None and any(t is not None for t in trees):
        flags |= _TREES
    if compactions:
        flags |= _COMPACT
    aux = [int(a) for a in aux_layers]
    msg = [0, 0, op, flags, len(seqs), len(aux), max_seqs, max_query,
           -1 if max_prefill is None else max_prefill, *aux]
    for s, toks in zip(seqs, new_tokens):
        msg += (len(toks), s.num_cached_tokens, len(s.block_table))
    if not flags & _TOKENS_ON_DEVICE:
        for toks in new_tokens:
            msg += toks
    for s in seqs:
        msg += s.block_table
    if flags & _TREES:
        if len(trees) != len(seqs):
            raise ValueError(f"a tree step of {len(seqs)} sequences with {len(trees)} trees")
        for toks, t in zip(new_tokens, trees):  # refused here, before any rank runs it
            if t is not None and len(t) + 1 != len(toks):
                raise ValueError(f"a tree step's sequence feeds {len(toks)} rows for a tree of "
                                 f"{len(t)} nodes (the root and one row per node)")
        msg += [-1 if t is None else len(t) for t in trees]
        for t in trees:
            if t is not None:
                msg += [int(p) for p in t]
    if flags & _COMPACT:
        msg.append(len(compactions))
        for c in compactions:
            msg.append(len(c.seqs))
            for s, start, path in zip(c.seqs, c.ctx_starts, c.paths, strict=True):
                msg += (start, len(path), len(s.block_table))
            for path in c.paths:
                msg += path
            for s in c.seqs:
                msg += s.block_table
    msg[0] = len(msg)
    return msg


def unpack_call(msg: list[int]) -> Call:
    """The inverse of :func:`pack_call` (``token_ids`` left None)."""
    _, _, op, flags, n, n_aux, max_seqs, max_query, max_prefill = msg[:_HEADER]
    i = _HEADER
    aux = tuple(msg[i : i + n_aux])
    i += n_aux
    meta = [msg[i + 3 * j : i + 3 * j + 3] for j in range(n)]  # (query_len, cached, table_len)
    i += 3 * n
    new_tokens = []
    for q, _, _ in meta:
        if flags & _TOKENS_ON_DEVICE:
            new_tokens.append([0] * q)  # placeholders: only the query lengths are read
        else:
            new_tokens.append(msg[i : i + q])
            i += q
    seqs = []
    for _, cached, t in meta:
        seqs.append(RemoteSeq(cached, msg[i : i + t]))
        i += t
    trees = None
    if flags & _TREES:
        sizes = msg[i : i + n]
        i += n
        trees = []
        for m in sizes:
            trees.append(None if m < 0 else msg[i : i + m])
            i += max(m, 0)
    compactions = []
    if flags & _COMPACT:
        groups = msg[i]
        i += 1
        for _ in range(groups):
            m = msg[i]
            i += 1
            cmeta = [msg[i + 3 * j : i + 3 * j + 3] for j in range(m)]  # (start, path, table)
            i += 3 * m
            paths = []
            for _, p, _ in cmeta:
                paths.append(msg[i : i + p])
                i += p
            tables = []
            for _, _, t in cmeta:
                tables.append(RemoteSeq(0, msg[i : i + t]))
                i += t
            compactions.append(Compaction(tables, [c[0] for c in cmeta], paths))
    return Call(op, flags, aux, seqs, new_tokens, None, max_seqs, max_query,
                None if max_prefill < 0 else max_prefill, trees, compactions)


def next_capacity(length: int) -> int:
    """The buffer of the message after one of ``length`` entries: the power of two above it and
    a quarter more (room for growing block tables), within [MIN_CAPACITY, MAX_CAPACITY]."""
    return min(MAX_CAPACITY, max(MIN_CAPACITY, 1 << (length + length // 4).bit_length()))


class Channel:
    """Rank 0's messages to the workers: one broadcast of ``capacity`` entries per message, both
    sides holding the same ``capacity`` (every message sets the next one's), a second broadcast
    only for what did not fit.

    On CUDA the messages travel over NCCL (``TensorParallel.message_group``, a communicator of
    their own) on a stream of their own: rank 0 writes the message into pinned memory and
    enqueues its copy and broadcast (from the second message on, one CUDA graph replay:
    :meth:`_move`) without waiting for either, and a worker polls the copy's event
    (:func:`_wait`). On the CPU they go over the gloo CPU group. Measured on H200s
    (docs/tensor_parallel.md), median from rank 0's send to a worker holding the message: gloo
    380-410 us at TP 2 and 4, NCCL 180-300 us; a synchronous step (a verification) waits for
    the last worker's message."""

    def __init__(self, tp: TensorParallel, device: torch.device | None = None) -> None:
        self.tp = tp
        self.capacity = MIN_CAPACITY
        self.on_device = tp.message_group is not None  # CUDA
        if self.on_device:
            self.stream = torch.cuda.Stream(device)
            self.dev = torch.zeros(MAX_CAPACITY, dtype=torch.int64, device=device)  # [MAX_CAPACITY]
            self.pin = torch.zeros(MAX_CAPACITY, dtype=torch.int64).pin_memory()  # [MAX_CAPACITY]
            self.pin_np = self.pin.numpy()
            self.copied = torch.cuda.Event()  # rank 0: the last message has left ``pin``
            self.copied.record(self.stream)
            self.arrived = torch.cuda.Event()  # a worker: the message is in ``pin``
            # capacity -> a CUDA graph of the message's copy and broadcast (:meth:`_move`)
            self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
            self.messages = 0  # messages moved so far (the same count on every rank)

    def _broadcast(self, msg: list[int] | None) -> list[int]:
        if self.on_device:
            return self._broadcast_device(msg)
        cap = self.capacity
        buf = torch.zeros(cap, dtype=torch.int64)  # [cap]
        if msg is not None:
            head = msg[:cap]
            buf[: len(head)] = torch.tensor(head, dtype=torch.int64)
        dist.broadcast(buf, src=0, group=self.tp.cpu_group)
        length, self.capacity = int(buf[0]), int(buf[1])
        if length <= cap:
            return buf[:length].tolist()
        rest = torch.empty(length - cap, dtype=torch.int64)  # [length - cap]
        if msg is not None:
            rest.copy_(torch.tensor(msg[cap:], dtype=torch.int64))
        dist.broadcast(rest, src=0, group=self.tp.cpu_group)
        return buf.tolist() + rest.tolist()

    def _move(self, cap: int, send: bool) -> None:
        """Enqueue on ``self.stream`` the move of a ``cap``-entry message: rank 0 (``send``)
        copies ``pin`` to ``dev`` and broadcasts it, a worker receives into ``dev`` and copies it
        to ``pin``. From the second message on, as the replay of a CUDA graph captured for the
        capacity the first time it is used (every rank captures its side at the same message):
        one launch instead of the copy and ``dist.broadcast``'s host work (~150 us a step on the
        lent H100s, docs/tensor_parallel.md). The first message initialises the communicator."""
        dev, pin, group = self.dev[:cap], self.pin[:cap], self.tp.message_group
        first = self.messages == 0
        self.messages += 1
        graph = self.graphs.get(cap)
        if graph is None and not first:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                self._move_ops(dev, pin, group, send)
            self.graphs[cap] = graph
        with torch.cuda.stream(self.stream):
            if graph is None:
                self._move_ops(dev, pin, group, send)
            else:
                graph.replay()

    @staticmethod
    def _move_ops(dev, pin, group, send: bool) -> None:
        if send:
            dev.copy_(pin, non_blocking=True)
            dist.broadcast(dev, src=0, group=group)
        else:
            dist.broadcast(dev, src=0, group=group)
            pin.copy_(dev, non_blocking=True)

    def _broadcast_device(self, msg: list[int] | None) -> list[int]:
        cap = self.capacity
        dev = self.dev[:cap]  # [cap]
        if msg is not None:  # rank 0: nothing here waits for this step's GPU work
            # the previous message has left the pinned buffer (its broadcast is done: the
            # workers posted their receive when they launched that message's call)
            self.copied.synchronize()
            head = msg[:cap]
            self.pin_np[: len(head)] = head
            self._move(cap, send=True)
            with torch.cuda.stream(self.stream):
                self.copied.record(self.stream)
                length, self.capacity = len(msg), msg[1]
                if length > cap:  # a long prefill's message: the rest from a tensor of its own
                    rest = torch.tensor(msg[cap:], dtype=torch.int64).to(dev.device)
                    dist.broadcast(rest, src=0, group=self.tp.message_group)
                    self.stream.synchronize()  # ``rest`` lives until its broadcast is done
            return msg
        self._move(cap, send=False)
        with torch.cuda.stream(self.stream):
            self.arrived.record(self.stream)
        _wait(self.arrived)
        with torch.cuda.stream(self.stream):
            length, self.capacity = int(self.pin_np[0]), int(self.pin_np[1])
            out = self.pin_np[: min(length, cap)].tolist()
            if length > cap:
                rest = torch.empty(length - cap, dtype=torch.int64, device=dev.device)
                dist.broadcast(rest, src=0, group=self.tp.message_group)
                out += rest.cpu().tolist()
            return out

    def release(self) -> None:
        """Destroy the message graphs: NCCL's communicator destruction waits forever for a
        graph that captured one of its collectives (before ``shutdown_tensor_parallel``, on
        every rank; pending replays still complete)."""
        if self.on_device:
            for graph in self.graphs.values():
                graph.reset()
            self.graphs.clear()

    def send(self, msg: list[int]) -> None:
        """Rank 0: broadcast ``msg`` (a :func:`pack_call` message)."""
        msg[1] = next_capacity(len(msg))
        self._broadcast(msg)

    def receive(self) -> list[int]:
        """A worker: the next message rank 0 sends."""
        return self._broadcast(None)

    def flush(self) -> None:
        """Rank 0: wait until every worker has the messages sent so far (before the groups
        go: a message still in flight on the device would never arrive)."""
        if self.on_device:
            self.stream.synchronize()


def _wait(event: torch.cuda.Event, spin_s: float = 0.05) -> None:
    """Wait for ``event`` on the host: spinning on it for ``spin_s`` (a message of a running
    engine comes within a step, and a thread woken from sleep comes late), then polling it
    every millisecond (an idle engine: no core kept busy)."""
    end = time.perf_counter() + spin_s
    while not event.query():
        if time.perf_counter() > end:
            time.sleep(0.001)


def receive_call(channel: Channel, device: torch.device) -> Call:
    """A worker's side of :meth:`TPRunner._send`: the next call rank 0 makes."""
    call = unpack_call(channel.receive())
    if call.flags & _TOKENS_ON_DEVICE:
        n = sum(len(t) for t in call.new_tokens)
        call.token_ids = torch.empty(n, dtype=torch.int64, device=device)  # [num_tokens]
        dist.broadcast(call.token_ids, src=0, group=channel.tp.group)
    return call


def apply_call(runner, call: Call) -> bool:
    """Run ``call`` on a worker's local ``ModelRunner`` exactly as rank 0 runs it on its own
    (the results are rank 0's to use; here they are dropped), after the tree compactions rank 0
    made since its previous call. False on shutdown."""
    if call.op == SHUTDOWN:
        return False
    for c in call.compactions:
        runner.compact_tree(c.seqs, c.ctx_starts, c.paths)
    if call.op == FORWARD:
        runner.forward(call.seqs, call.new_tokens, call.aux_layers, token_ids=call.token_ids,
                       trees=call.trees)
    elif call.op == SCORE and runner.graphs is None:
        # eager (the CPU, enforce_eager): score is forward and the LM head, which has no
        # collective and whose logits only rank 0 reads, so a worker runs the forward alone
        runner.forward(call.seqs, call.new_tokens, call.aux_layers, token_ids=call.token_ids,
                       trees=call.trees)
    elif call.op == SCORE:  # the same path as rank 0's: a head graph or forward + LM head
        runner.score(call.seqs, call.new_tokens, call.aux_layers,
                     greedy=bool(call.flags & _GREEDY), keep_hidden=bool(call.flags & _KEEP_HIDDEN),
                     trees=call.trees, token_ids=call.token_ids)
    elif call.op == CAPTURE:
        runner.capture_graphs(call.max_seqs, call.max_query, call.aux_layers, call.max_prefill,
                              progress=False, head=bool(call.flags & _HEAD))  # rank 0 shows it
    else:
        raise RuntimeError(f"tensor-parallel worker: unknown call {call.op} from rank 0 (the "
                           "ranks run different speculant versions?)")
    return True


class TPRunner:
    """Rank 0's runner: each call is sent to the workers, then run on ``local`` (this rank's
    ``ModelRunner``); everything else is ``local``'s."""

    def __init__(self, local, tp: TensorParallel, why_failed=None, workers_alive=None) -> None:
        self.local = local
        self.tp = tp
        self.channel = Channel(tp, local.device)
        self.closed = False
        self.failed: str | None = None  # why the workers cannot be reached any more
        self.pending: list[Compaction] = []  # compact_tree calls the workers have yet to repeat
        # () -> str: what became of the workers (exit codes), for the error when a send fails
        self.why_failed = why_failed
        # () -> bool: every worker process still runs (checked before each message on CUDA,
        # where a message to a dead rank would wait for NCCL's time-out); None under torchrun
        self.workers_alive = workers_alive

    def __getattr__(self, name: str):  # graphs, kv_cache, model, block_size, device, ...
        return getattr(self.local, name)

    def _send(self, op: int, seqs=(), new_tokens=(), aux_layers=(), flags: int = 0,
              token_ids: torch.Tensor | None = None, **kw) -> None:
        if self.closed:
            raise RuntimeError("this engine's tensor-parallel workers were shut down (LLM.close()"
                               "); create a new LLM")
        if self.failed is not None:
            raise RuntimeError(self.failed)
        if self.channel.on_device and self.workers_alive is not None and not self.workers_alive():
            # NCCL would wait for the dead rank until its time-out: refuse before sending
            self._fail(RuntimeError("a worker exited"))
        if token_ids is not None:
            flags |= _TOKENS_ON_DEVICE
        # a call refused by pack_call keeps the compactions for the next one
        msg = pack_call(op, flags, aux_layers, seqs, new_tokens, compactions=self.pending, **kw)
        self.pending = []
        try:
            self.channel.send(msg)
            if token_ids is not None:
                dist.broadcast(token_ids, src=0, group=self.tp.group)
        except RuntimeError as e:  # a worker is gone: gloo's connection to it closed
            self._fail(e)

    def _fail(self, e: Exception):
        why = self.why_failed() if self.why_failed is not None else str(e)
        self.failed = (f"tensor parallelism: a worker cannot be reached ({why}); this LLM "
                       "cannot run any more: close it and create a new one")
        raise RuntimeError(self.failed) from e

    def forward(self, seqs, new_tokens, aux_layers=(), token_ids=None, trees=None):
        self._send(FORWARD, seqs, new_tokens, aux_layers, token_ids=token_ids, trees=trees)
        return self.local.forward(seqs, new_tokens, aux_layers, token_ids=token_ids, trees=trees)

    def score(self, seqs, new_tokens, aux_layers=(), greedy: bool = False,
              keep_hidden: bool = True, trees=None, token_ids=None):
        flags = (_GREEDY if greedy else 0) | (_KEEP_HIDDEN if keep_hidden else 0)
        self._send(SCORE, seqs, new_tokens, aux_layers, flags, trees=trees, token_ids=token_ids)
        return self.local.score(seqs, new_tokens, aux_layers, greedy=greedy,
                                keep_hidden=keep_hidden, trees=trees, token_ids=token_ids)

    decode = ModelRunner.decode  # through this runner's forward / score: the workers follow

    def compact_tree(self, seqs, ctx_starts, paths) -> None:
        """Compact rank 0's cache now; the workers repeat it at the start of the next call (its
        message carries it: no broadcast of its own). The block tables are copied as they are
        now: the step's rollback frees the rejected nodes' slots right after."""
        self.local.compact_tree(seqs, ctx_starts, paths)
        if seqs:
            self.pending.append(Compaction([RemoteSeq(0, list(s.block_table)) for s in seqs],
                                           [int(c) for c in ctx_starts],
                                           [[int(r) for r in p] for p in paths]))

    def capture_graphs(self, max_seqs: int, max_query: int, aux_layers=(),
                       max_prefill_tokens: int | None = None, progress: bool = True,
                       head: bool = False) -> int:
        if self.local.graphs is None:
            return 0  # the workers have none either: same config, same device type
        self._send(CAPTURE, aux_layers=aux_layers, flags=_HEAD if head else 0,
                   max_seqs=max_seqs, max_query=max_query, max_prefill=max_prefill_tokens)
        return self.local.capture_graphs(max_seqs, max_query, aux_layers, max_prefill_tokens,
                                         progress, head=head)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.local.logits(hidden)  # the LM head is replicated: rank 0 alone

    def shutdown(self) -> None:
        """Tell the workers to leave their loop (they exit); later calls raise."""
        if not self.closed:
            self.closed = True
            if self.failed is None:
                self.channel.send(pack_call(SHUTDOWN))
                self.channel.flush()
