"""The thread count of a CPU engine (``EngineConfig.cpu_threads``).

``torch.set_num_threads`` is process-wide: the count an engine sets holds for every engine, model
and torch op of the process (numpy's OpenBLAS follows it too, ``layers.numpy_blas``).

``cpu_threads=N`` sets N threads when a CPU engine starts. ``cpu_threads=None`` (the default)
chooses: ``auto_cpu_threads()``, i.e. 1, unless the count is already the user's own, in which case
the engine leaves it alone:

* ``OMP_NUM_THREADS`` or ``MKL_NUM_THREADS`` is set in the environment (torch's own settings);
* ``torch.set_num_threads`` changed the count since speculant's engine was first imported, or
  since an engine last set it (a count set before that import cannot be told from torch's
  default: pass ``cpu_threads`` for it).

Why 1: a decode step of a small model is a chain of short products (our C kernels run a one-row
product on the calling thread, ``models/cpu_kernels.py``) and of short torch ops; extra OpenMP threads buy
nothing on a quiet machine and cost half the speed or more as soon as another process uses a
core (docs/perf.md, "CPU", has the measurements).
The C kernels' products are the exception: two cores stream a weight faster than one, and one
core does not overlap a multi-row product's FMAs with its memory reads, so they take a helper
thread on a second CPU (``cpu_kernels.set_threads``, ``kernel_threads``): 2 whenever the engine's
count is 2 or more, and also with ``cpu_threads=None`` where there are 2+ CPUs for each of the
engine's processes (its tensor-parallel ranks). The helper keeps the second CPU busy while a
request runs (it polls for the next product for 200 us) and sleeps between requests; it never
holds up its caller for more than the unit of work it is late with, so a busy machine costs the
caller nothing over one thread (docs/perf.md, "CPU").
The GPU engine leaves the count alone (its host thread only launches work).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from speculant.models import cpu_kernels

logger = logging.getLogger("speculant")

ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

# torch's count when this module was first imported (its default unless changed before), and the
# count an engine of this process set last: any other count was set by the user.
_initial = torch.get_num_threads()
_applied: int | None = None


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. under ``taskset`` or a container's
    cpuset), else the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def user_setting() -> str | None:
    """Why the current thread count is the user's own (then ``cpu_threads=None`` keeps it), or
    None when it is torch's default or an engine's."""
    for var in ENV_VARS:
        if os.environ.get(var, "").strip():
            return f"{var}={os.environ[var].strip()}"
    n = torch.get_num_threads()
    if n != (_initial if _applied is None else _applied):
        return f"torch.set_num_threads({n})"
    return None


def auto_cpu_threads() -> int:
    """The count ``cpu_threads=None`` chooses: 1 (see the module's docstring for the
    measurements), never more than the CPUs available."""
    return min(1, available_cpus())


def resolve_cpu_threads(requested: int | None) -> tuple[int | None, str]:
    """(count to set or None to leave torch's alone, why) for ``EngineConfig.cpu_threads``."""
    if requested is not None:
        return int(requested), f"cpu_threads={requested}"
    own = user_setting()
    if own is not None:
        return None, f"kept the user's {own}"
    return auto_cpu_threads(), "automatic (cpu_threads=None)"


def kernel_threads(requested: int | None, torch_count: int, processes: int = 1) -> int:
    """Threads of the C kernels' products for ``EngineConfig.cpu_threads``: 2 when torch's
    count in force is 2+, or when the choice is automatic (None) and there are 2+ CPUs for
    each of the ``processes`` that share them (the ranks of a tensor-parallel group: a helper
    polls its CPU while its request runs, so two ranks' helpers on 2 CPUs would take them from
    the other rank); else 1 (an explicit ``cpu_threads=1``, a user's one-thread setting)."""
    auto = requested is None and user_setting() is None
    return 2 if torch_count >= 2 or (auto and available_cpus() >= 2 * processes) else 1


def apply_cpu_threads(requested: int | None, processes: int = 1) -> int:
    """Set torch's thread count for a CPU engine (process-wide) and the C kernels' (2 or 1,
    ``kernel_threads``; ``processes``: the engine's processes on this machine, its tensor-
    parallel ranks); returns torch's count in force."""
    global _applied
    n, why = resolve_cpu_threads(requested)
    kernels = kernel_threads(requested, torch.get_num_threads() if n is None else n, processes)
    if n is not None and n != torch.get_num_threads():
        torch.set_num_threads(n)
    if n is not None:
        _applied = n
    if cpu_kernels.available():
        kernels = cpu_kernels.set_threads(kernels)
    logger.info("CPU threads: %d (%s); C kernels' products: %d", torch.get_num_threads(),
                why, kernels)
    return torch.get_num_threads()


@contextmanager
def torch_threads(n: int | None) -> Iterator[int]:
    """torch's thread count set to ``n`` inside the block (None: every CPU available) and
    restored after it, so an engine's own count stays in force; yields the count. For batched
    CPU work such as ``speculant train``'s hidden-state pass and training steps, which, unlike
    a decode step, gain from every core (docs/training.md)."""
    if n is not None and n < 1:
        raise ValueError(f"cpu_threads={n} must be >= 1 (or None: every available CPU)")
    old = torch.get_num_threads()
    torch.set_num_threads(n or available_cpus())
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(old)
