"""``speculant.distributed``: tensor parallelism on torch.distributed.

* :class:`TensorParallel`, :func:`tensor_parallel`: this process's rank, size and groups
  (``TensorParallel(0, 1, None, None)`` until :func:`init_tensor_parallel`);
* :func:`init_tensor_parallel` / :func:`shutdown_tensor_parallel`: join and leave the group;
* :func:`all_reduce`: the sum over the ranks after a row-parallel layer (a no-op at size 1);
* :func:`all_gather_columns`: every rank's columns side by side (the vocab-parallel LM head);
* :func:`fused_all_reduce`: the same fused with the residual add and RMSNorm that follow (CUDA,
  set up per model by :func:`setup_fused_all_reduce`); :func:`fused_gemv_all_reduce`: that
  after a row-parallel GEMV whose programs start the exchange;
* :func:`shard_range`: a rank's [start, end) of an equal split.
"""

from speculant.distributed.comm import (
    ONE_SHOT_MAX_BYTES,
    all_gather_columns,
    all_reduce,
    fused_all_reduce,
    fused_gemv_all_reduce,
    init_tensor_parallel,
    setup_fused_all_reduce,
    shutdown_tensor_parallel,
)
from speculant.distributed.parallel import (
    NO_TENSOR_PARALLEL,
    TensorParallel,
    shard_range,
    tensor_parallel,
)

__all__ = [
    "NO_TENSOR_PARALLEL",
    "ONE_SHOT_MAX_BYTES",
    "TensorParallel",
    "all_gather_columns",
    "all_reduce",
    "fused_all_reduce",
    "fused_gemv_all_reduce",
    "init_tensor_parallel",
    "setup_fused_all_reduce",
    "shard_range",
    "shutdown_tensor_parallel",
    "tensor_parallel",
]
