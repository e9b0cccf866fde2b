"""The tensor-parallel state of this process: which rank of how many, and its process groups.

A model reads it once, at construction (``LlamaForCausalLM(config, max_positions)`` shards
itself for ``tensor_parallel()``), so the same ``load_model(...)`` call returns rank r's shard in
rank r's process. Without :func:`speculant.distributed.init_tensor_parallel` every process is
rank 0 of 1 (:data:`NO_TENSOR_PARALLEL`) and nothing is sharded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    """What a model or a runner needs to know of tensor parallelism.

    ``rank`` of ``size`` ranks; ``group`` the device group the all-reduces run on (NCCL on CUDA,
    gloo on the CPU); ``cpu_group`` a gloo group for host-side control messages (the runner's
    broadcasts on the CPU); ``message_group`` (CUDA only) a second NCCL group for the runner's
    per-call messages, a communicator of their own so that they may run beside the collectives
    inside a replayed CUDA graph. The groups are None at size 1."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | Any | None = None
    cpu_group: dist.ProcessGroup | Any | None = None
    message_group: dist.ProcessGroup | Any | None = None

    @property
    def enabled(self) -> bool:
        """More than one rank: the model is sharded and its layers all-reduce."""
        return self.size > 1


NO_TENSOR_PARALLEL = TensorParallel(0, 1, None, None)

_current: TensorParallel = NO_TENSOR_PARALLEL


def tensor_parallel() -> TensorParallel:
    """The current tensor-parallel state; ``TensorParallel(0, 1, None, None)`` when none was set
    up (:func:`speculant.distributed.init_tensor_parallel`)."""
    return _current


def set_tensor_parallel(tp: TensorParallel) -> None:
    """Make ``tp`` the current state (``init_tensor_parallel`` / ``shutdown_tensor_parallel``)."""
    global _current
    _current = tp


def shard_range(n: int, rank: int, size: int) -> tuple[int, int]:
    """The [start, end) of rank ``rank``'s equal share of ``n`` items split over ``size`` ranks.
    Raises ValueError when ``size`` does not divide ``n`` (a tensor-parallel shard is always an
    equal split: heads, KV heads, MLP width)."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"shard_range: rank {rank} is not one of {size} ranks")
    if n % size:
        raise ValueError(f"shard_range: {n} items cannot be split equally over {size} ranks")
    per = n // size
    return rank * per, (rank + 1) * per
