"""Engine configuration (pydantic, extra='forbid')."""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from speculant.envs import env_str

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def explain(e: ValidationError, what: str) -> str:
    """A pydantic error as one line a user can act on: ``field: problem; field: problem``."""
    parts = []
    for err in e.errors():
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = f"unknown option (not a {what} option)"
        parts.append(f"{'.'.join(map(str, err['loc'])) or what}: {msg}")
    return "; ".join(parts)


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    model: str | None = None
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = Field(None, ge=2)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=16)
    block_size: int = Field(16, ge=1, le=1024)
    kv_cache_memory: int | None = Field(None, ge=1 << 16, description="bytes for the KV cache")
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    num_gpu_blocks_override: int | None = Field(None, ge=1)
    device: Literal["auto", "cpu", "cuda"] | str = "auto"
    speculative_config: dict[str, Any] | None = None
    tensor_parallel_size: int = Field(
        1, description="devices the target is sharded over (vLLM's name; Megatron-style, "
        "docs/tensor_parallel.md): rank r runs on cuda:r (processes on the CPU, over gloo); "
        "LLM starts the other ranks' processes itself, or they come from torchrun")
    load_format: Literal["auto", "dummy"] = Field(
        "auto", description="'auto' reads the checkpoint's weights; 'dummy' (vLLM's name) makes "
        "random ones on the device instead (normal(0, 0.02), norms 1, from `seed`, the same "
        "model at every tensor_parallel_size; only config.json is read): benchmarks at a "
        "model's geometry without its weights")
    trust_remote_code: bool = Field(
        False, description="accepted for vLLM compatibility, no effect: speculant runs its own "
        "model implementations and never executes code from a checkpoint")
    use_v2_block_manager: bool = Field(
        False, description="accepted for vLLM compatibility (deprecated there), no effect: "
        "speculant has one paged block manager")
    enforce_eager: bool = Field(
        False, description="no CUDA graphs: every step, and the strategy's own forwards, run "
        "eagerly (debugging; the engine's torch attention, SPECULANT_DISABLE_TRITON, needs it)")
    max_prefill_graph_tokens: int | None = Field(
        None, ge=0, description="on CUDA, prefill steps of up to this many tokens (in all) replay "
        "CUDA graphs captured per token bucket; 0: prefill runs eagerly; None: 2048")
    cuda_graph_capture: Literal["startup", "lazy"] = Field(
        "startup", description="on CUDA with CUDA graphs: 'startup' captures the graphs of every "
        "decode, verification and prefill shape the engine can replay before the first request "
        "(no capture stall mid-serving; a few seconds at start-up), then the strategy's own "
        "(its one-graph proposes, a draft model's forwards: the capture_graphs hook); 'lazy' "
        "captures each on its first use")
    async_scheduling: bool | None = Field(
        None, description="overlap plain decode steps (queue step N+1 on the device-side tokens "
        "of step N before reading them back); None: on for CUDA with CUDA graphs")
    batch_invariant: bool = Field(
        False, description="on CUDA, every sequence's logits bit for bit independent of the "
        "batch: of the other sequences, of the step's row count (a decode step or k+1 "
        "verification rows) and of CUDA-graph padding (fixed-shape GEMMs, no few-row GEMVs, "
        "paged attention with fixed splits: models/batch_invariant.py), at a cost in "
        "throughput; the CPU path (fp32, C kernels) is batch-invariant always, so there it only "
        "checks that it runs on them")
    cpu_threads: int | None = Field(
        None, ge=1, description="torch's thread count for a CPU engine, set when it starts "
        "(torch.set_num_threads: process-wide, every engine and torch op of the process); "
        "None: 1, the fastest for decoding small models on a quiet or a busy machine, unless "
        "OMP_NUM_THREADS / MKL_NUM_THREADS is set or torch.set_num_threads changed the count, "
        "which is then kept (engine/cpu_threads.py). The C kernels' products also take a "
        "helper thread on a second CPU when the count is 2+, or when it is None and 2+ CPUs are "
        "available (it keeps that CPU busy while requests run); 1 keeps them on one thread. "
        "No effect on the GPU")

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        v = str(v).replace("torch.", "")
        if v != "auto" and v not in _DTYPES:
            raise ValueError(f"unknown dtype {v!r}; use auto, float32, float16 or bfloat16")
        return v

    @field_validator("cpu_threads", mode="before")
    @classmethod
    def _cpu_threads(cls, v: Any) -> Any:
        if isinstance(v, bool) or (isinstance(v, int) and v < 1):
            raise ValueError(f"cpu_threads={v!r}: a number of threads >= 1, or None to choose "
                             "automatically")
        return v

    @field_validator("tensor_parallel_size", mode="before")
    @classmethod
    def _tp(cls, v: Any) -> Any:
        if isinstance(v, bool) or (isinstance(v, int) and v < 1):
            raise ValueError(f"tensor_parallel_size={v!r}: the number of devices to shard the "
                             "model over, >= 1; use tensor_parallel_size=1 for one device")
        return v

    @model_validator(mode="after")
    def _tp_devices(self) -> EngineConfig:
        tp = self.tensor_parallel_size
        if tp > 1 and self.torch_device().type == "cuda":
            if self.torch_device().index not in (None, 0):
                raise ValueError(
                    f"device={self.device!r} with tensor_parallel_size={tp}: rank r runs on "
                    "cuda:r, starting at cuda:0; use device='cuda' and pick the GPUs with "
                    "CUDA_VISIBLE_DEVICES")
            have = torch.cuda.device_count()
            if tp > have:
                raise ValueError(
                    f"tensor_parallel_size={tp} needs {tp} CUDA devices (rank r runs on cuda:r) "
                    f"but {have} are visible (CUDA_VISIBLE_DEVICES); use tensor_parallel_size<="
                    f"{have} or make more devices visible")
        return self

    def compat_warnings(self) -> list[str]:
        """Warnings for vLLM options that are accepted but do nothing here (shown by ``LLM``)."""
        out = []
        if self.use_v2_block_manager:
            out.append("use_v2_block_manager is deprecated (as in vLLM) and has no effect: "
                       "speculant has one paged block manager; drop the argument")
        if self.trust_remote_code:
            out.append("trust_remote_code=True has no effect: speculant runs its own model "
                       "implementations and never executes code from a checkpoint")
        return out

    def torch_device(self) -> torch.device:
        """``device``; "auto" is ``SPECULANT_DEVICE`` when set (e.g. ``cpu`` to keep a GPU
        machine's engines on the CPU, as the test suite does), else CUDA when available."""
        name = self.device
        if name == "auto":
            name = env_str("SPECULANT_DEVICE") or "auto"
            if name == "auto":
                return torch.device("cuda" if torch.cuda.is_available() else "cpu")
            try:
                torch.device(name)
            except (RuntimeError, ValueError):
                raise ValueError(
                    f"SPECULANT_DEVICE={name!r} is not a device; use cpu, cuda or cuda:N, or "
                    "unset it"
                ) from None
        dev = torch.device(name)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA device is available; use device='cpu'")
        return dev

    def torch_dtype(self, device: torch.device, checkpoint_dtype: Any) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if device.type == "cpu":
            return torch.float32  # CPU: exact, and fast enough for small models
        if isinstance(checkpoint_dtype, str):
            checkpoint_dtype = _DTYPES.get(checkpoint_dtype.replace("torch.", ""), None)
        if checkpoint_dtype in (torch.float16, torch.bfloat16):
            return checkpoint_dtype
        return torch.bfloat16
