"""The tensor-parallel ranks other than 0: starting them, and what each runs.

``LLM(tensor_parallel_size=N)`` starts ranks 1..N-1 itself (:func:`start_tensor_parallel`):
each is a fresh interpreter (``python -m speculant.distributed.worker``, the spawn start
method's clean process, without re-running the user's script, so a script needs no
``if __name__ == "__main__"`` guard), rank r on ``cuda:r`` (on the CPU: processes over gloo).
Rank 0 writes the worker its :class:`WorkerSpec` on stdin; the worker reports on a status pipe
when it joins the rendezvous (``tcp://127.0.0.1:<free port>``) and when its shard is loaded, or
the error that stopped it, so a failing worker is a clear error on rank 0, not a hang. A
watchdog thread ends a worker whose parent died (a worker blocked in a collective could not
notice otherwise).

Under ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) nothing is started: every process
runs the user's script, rank 0 goes on as the engine, and a rank > 0 serves rank 0's calls
inside ``LLM(...)`` and exits the process (``sys.exit(0)``) when rank 0 shuts down.

A worker loads its shard of the target (the model reads its rank at construction), agrees with
rank 0 on the number of KV blocks (the fewest any rank fits), builds a ``ModelRunner`` and then
runs every call rank 0's :class:`speculant.engine.tp_runner.TPRunner` sends, until shutdown.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import functools
import json
import logging
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from speculant.distributed.comm import init_tensor_parallel, shutdown_tensor_parallel
from speculant.distributed.parallel import (
    NO_TENSOR_PARALLEL,
    TensorParallel,
    set_tensor_parallel,
    tensor_parallel,
)

logger = logging.getLogger("speculant")

JOIN_TIMEOUT_S = 10.0  # a worker's shutdown, before it is killed
RENDEZVOUS_TIMEOUT_S = 600.0  # a worker's start (its imports), until it joins the rendezvous


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank needs to build its shard, as rank 0 resolved it."""

    config: Any  # speculant.config.EngineConfig
    folder: Path  # the checkpoint folder (resolve_model)
    hf_config: Any  # its transformers config
    dtype: torch.dtype
    max_model_len: int
    device_type: str  # "cuda" or "cpu"


@contextlib.contextmanager
def unsharded():
    """Models built inside are whole, not this rank's shard: rank 0's drafters (draft models,
    heads), which run on rank 0 alone."""
    tp = tensor_parallel()
    set_tensor_parallel(NO_TENSOR_PARALLEL)
    try:
        yield
    finally:
        set_tensor_parallel(tp)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_world() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when this process was started by torchrun, else None."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return None
    rank = int(os.environ.get("RANK", "0"))
    return rank, world, int(os.environ.get("LOCAL_RANK", rank))


class TPGroup:
    """Rank 0's handle on the other ranks: their processes (none under torchrun), the
    start-up handshake and the shutdown."""

    def __init__(self, tp: TensorParallel, device: torch.device,
                 procs: list[subprocess.Popen] | None = None,
                 status: list[Any] | None = None) -> None:
        self.tp = tp
        self.device = device
        self.procs = procs or []
        self._status = status or []  # per worker: its status pipe (a file), rank 1 first
        self.runner = None  # the TPRunner, once built: it sends the shutdown
        self.agreed = False  # the KV block counts were exchanged (the workers passed start-up)
        self.closed = False
        self._at_exit = functools.partial(_close_at_exit, weakref.ref(self))
        atexit.register(self._at_exit)

    def describe_workers(self) -> str:
        """Each worker's state, for an error message: ``rank 1: exited with code -9, ...``."""
        if not self.procs:
            return "launched by torchrun: see their output"
        out = []
        for rank, p in enumerate(self.procs, start=1):
            code = p.poll()
            out.append(f"rank {rank}: " + ("running" if code is None
                                          else f"exited with code {code}"))
        return ", ".join(out)

    def workers_alive(self) -> bool:
        """Every worker process this rank started is still running."""
        return all(p.poll() is None for p in self.procs)

    def _read_status(self, want: str, timeout: float | None = None) -> dict[int, str]:
        """Wait until every worker wrote ``want`` (or an error) on its status pipe; returns the
        errors by rank. A worker that exits meanwhile, or that is not there in ``timeout``
        seconds, is an error raised here."""
        pending = dict(enumerate(self._status, start=1))
        errors: dict[int, str] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(
                    f"tensor-parallel rank(s) {sorted(pending)} did not start in {timeout:.0f} s "
                    f"({self.describe_workers()}); is the machine overloaded?")
            ready, _, _ = select.select(list(pending.values()), [], [], 0.5)
            for f in ready:
                rank = next(r for r, g in pending.items() if g is f)
                line = f.readline()
                if not line:
                    continue  # closed: the liveness check below says why
                msg = json.loads(line)
                if msg.get("error"):
                    errors[rank] = msg["error"]
                    del pending[rank]
                elif msg.get("state") == want:
                    del pending[rank]
            for rank in list(pending):
                code = self.procs[rank - 1].poll()
                if code is not None:
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} exited with code {code} while starting "
                        "(its output above says why: out of memory, a missing package, ...)")
        return errors

    def agree_num_blocks(self, own) -> int:
        """The KV blocks every rank allocates: the fewest any rank fits. ``own()`` is rank 0's
        count; when it raises, or a worker failed to load its shard, every rank is told (the
        exchange of the counts) and leaves, and the error is raised here."""
        error = None
        try:
            mine = int(own())
        except Exception as e:  # noqa: BLE001 - re-raised below, after the workers were told
            error, mine = e, -1
        self.agreed = True
        worker_errors = {}
        if self._status:
            try:
                worker_errors = self._read_status("loaded")
            except RuntimeError:
                self._kill()
                raise
        fits = _gather_fits(self.tp, mine)
        if error is not None or min(fits) < 0:
            self.close(shutdown_workers=False)
        if error is not None:
            raise error
        bad = [r for r, f in enumerate(fits) if f < 0]
        if bad:
            why = "; ".join(f"rank {r}: {worker_errors[r]}" for r in bad if r in worker_errors)
            raise RuntimeError(f"tensor-parallel rank(s) {bad} failed to load their shard of the "
                               f"model: {why or 'their output above says why'}")
        return min(fits)

    def close(self, shutdown_workers: bool = True) -> None:
        """Stop the workers (a shutdown call, then a join; a worker that does not exit in
        ``JOIN_TIMEOUT_S`` is killed) and leave the process group, so a new LLM can start."""
        if self.closed:
            return
        atexit.unregister(self._at_exit)
        if not self.agreed and tensor_parallel().enabled:
            # rank 0 failed before the exchange of the KV block counts, where the workers wait
            # once their shard is loaded: a count of -1 tells them to leave
            with contextlib.suppress(RuntimeError):
                self.agree_num_blocks(lambda: -1)
        self.closed = True
        if shutdown_workers and self.runner is not None:
            try:
                self.runner.shutdown()
            except Exception as e:  # noqa: BLE001 - a dead worker: the join below kills the rest
                logger.warning("tensor parallelism: the shutdown call failed (%s)", e)
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for f in self._status:
            f.close()
        if self.runner is not None:
            release_graphs(self.runner.local)
            self.runner.channel.release()
        shutdown_tensor_parallel()

    def _kill(self) -> None:
        atexit.unregister(self._at_exit)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        self.closed = True
        for f in self._status:
            f.close()
        shutdown_tensor_parallel()


def _close_at_exit(ref) -> None:
    group = ref()
    if group is not None:
        group.close()


def _gather_fits(tp: TensorParallel, mine: int) -> list[int]:
    """Every rank's KV block count (-1: it failed to load), in rank order."""
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(tp.size)]
    dist.all_gather(out, torch.tensor([mine], dtype=torch.int64), group=tp.cpu_group)
    return [int(t) for t in out]


def start_tensor_parallel(spec: WorkerSpec, device: torch.device) -> TPGroup | None:
    """Set up tensor parallelism for an engine about to load ``spec``'s model: None at size 1
    (nothing changes). Else starts ranks 1..N-1 (or, under torchrun, joins the ranks it
    started; a rank > 0 then serves rank 0 and exits the process here) and returns rank 0's
    :class:`TPGroup` once every rank joined the process group."""
    size = spec.config.tensor_parallel_size
    if size == 1:
        return None
    if tensor_parallel().enabled:
        raise RuntimeError(
            "an LLM with tensor_parallel_size > 1 already runs in this process; close it "
            "(llm.close()) before creating another one")
    world = _torchrun_world()
    if world is not None:
        rank, n, local = world
        if n != size:
            raise ValueError(
                f"torchrun started {n} processes (WORLD_SIZE) but tensor_parallel_size={size}; "
                f"start torchrun with --nproc-per-node {size} or pass tensor_parallel_size={n}")
        device = torch.device("cuda", local) if spec.device_type == "cuda" else device
        tp = init_tensor_parallel(rank, size, device)
        if rank > 0:
            serve(spec, tp, device)
            shutdown_tensor_parallel()
            sys.exit(0)
        return TPGroup(tp, device)
    device = torch.device("cuda", 0) if spec.device_type == "cuda" else device
    init = f"tcp://127.0.0.1:{_free_port()}"
    payload = pickle.dumps(spec)
    procs, status = [], []
    try:
        for rank in range(1, size):
            read_fd, write_fd = os.pipe()
            cmd = [sys.executable, "-m", "speculant.distributed.worker", str(rank), str(size),
                   init, str(write_fd), str(os.getpid())]
            p = subprocess.Popen(cmd, stdin=subprocess.PIPE, pass_fds=(write_fd,))
            os.close(write_fd)
            procs.append(p)
            status.append(os.fdopen(read_fd, "r"))
            p.stdin.write(payload)
            p.stdin.close()
        group = TPGroup(NO_TENSOR_PARALLEL, device, procs, status)
        errors = group._read_status("joining", RENDEZVOUS_TIMEOUT_S)
        if errors:
            raise RuntimeError("tensor-parallel worker(s) failed to join: " + "; ".join(
                f"rank {r}: {e}" for r, e in errors.items()))
    except BaseException:
        for p in procs:
            p.kill()
            p.wait()
        for f in status:
            f.close()
        raise
    try:
        group.tp = init_tensor_parallel(0, size, device, init)
    except BaseException:
        group._kill()
        raise
    return group


# ---------------------------------------------------------------------------------- a worker
def _fit_blocks(spec: WorkerSpec, model, device: torch.device) -> int:
    """How many KV blocks fit on this worker's device when rank 0 sizes the cache from the
    free memory; a large number otherwise (rank 0's count, the same on every rank, decides)."""
    from speculant.engine.model_runner import kv_bytes_per_block

    cfg = spec.config
    if (device.type != "cuda" or cfg.num_gpu_blocks_override or cfg.kv_cache_memory):
        return 1 << 62
    free, _ = torch.cuda.mem_get_info(device)
    budget = int(free * cfg.gpu_memory_utilization) - (1 << 30)  # as LLMEngine._num_blocks
    return max(budget, 0) // kv_bytes_per_block(model, cfg.block_size, spec.dtype)


def serve(spec: WorkerSpec, tp: TensorParallel, device: torch.device, status=None) -> None:
    """A worker's life after the rendezvous: load its shard, agree on the KV blocks, then run
    rank 0's calls on its own runner until shutdown."""
    from speculant.engine.model_runner import ModelRunner
    from speculant.engine.tp_runner import Channel, apply_call, receive_call
    from speculant.models.loader import load_model

    cfg = spec.config
    model = None
    try:
        model = load_model(spec.folder, spec.hf_config, spec.dtype, device, spec.max_model_len,
                           load_format=cfg.load_format, seed=cfg.seed, tp=tp)
        fit = _fit_blocks(spec, model, device)
        _report(status, state="loaded")
    except Exception as e:  # noqa: BLE001 - reported to rank 0, which raises it
        traceback.print_exc()
        _report(status, error=f"{type(e).__name__}: {e}")
        fit = -1
    fits = _gather_fits(tp, fit)
    if min(fits) < 0:
        return  # some rank failed: rank 0 raises, every rank leaves
    runner = ModelRunner(model, min(fits), cfg.block_size, device, spec.dtype,
                         enforce_eager=cfg.enforce_eager,
                         max_graph_prefill=cfg.max_prefill_graph_tokens)
    channel = Channel(tp, device)
    while apply_call(runner, receive_call(channel, device)):
        pass
    channel.release()
    release_graphs(runner)


def release_graphs(runner) -> None:
    """Destroy a runner's CUDA graphs (``CudaGraphRunner.release``: whoever still holds the
    runner) and wait for the device, before the process groups go."""
    graphs = getattr(runner, "graphs", None)
    if graphs is None:
        return
    import gc

    runner.graphs = None
    graphs.release()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _report(status, **msg) -> None:
    if status is not None:
        status.write(json.dumps(msg) + "\n")
        status.flush()


def _watch_parent(parent: int) -> None:
    """End this process when its parent is gone (re-parented): a worker blocked in a collective
    would otherwise wait forever."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="speculant-parent-watchdog", daemon=True).start()


def main(argv: list[str]) -> None:
    rank, size, init, status_fd, parent = argv
    _watch_parent(int(parent))
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>`: where a stuck worker is
    status = os.fdopen(int(status_fd), "w")
    spec: WorkerSpec = pickle.load(sys.stdin.buffer)
    if spec.device_type == "cuda":
        device = torch.device("cuda", int(rank))
    else:
        from speculant.engine.cpu_threads import apply_cpu_threads

        device = torch.device("cpu")
        apply_cpu_threads(spec.config.cpu_threads, spec.config.tensor_parallel_size)
    try:
        _report(status, state="joining")
        tp = init_tensor_parallel(int(rank), int(size), device, init)
    except Exception as e:  # noqa: BLE001 - reported to rank 0
        traceback.print_exc()
        _report(status, error=f"{type(e).__name__}: {e}")
        raise SystemExit(1) from None
    try:
        serve(spec, tp, device, status)
    finally:
        shutdown_tensor_parallel()


if __name__ == "__main__":
    main(sys.argv[1:])
