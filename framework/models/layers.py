"""Building blocks shared by the model implementations."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from speculant.models import cpu_kernels, fused
from speculant.models.attention import cpu_const


def onednn_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


class _NumpyBlas:
    """numpy's bundled OpenBLAS as a one-row GEMV backend. Its SGEMV streamed SmolLM2's Linear
    weights at ~21 GB/s on one core of this CPU where MKL's (torch's) reached ~15.5 GB/s. Used only
    when its thread count can be set (to torch's, so a 1-thread benchmark stays 1 thread) and a
    load-time timing on the model's own weights shows it faster (``choose_gemv``)."""

    def __init__(self) -> None:
        self.set_threads = None
        self.threads = -1
        try:
            import ctypes
            import glob
            import os

            import numpy as np

            libs = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
            for path in glob.glob(os.path.join(libs, "*openblas*.so*")):
                lib = ctypes.CDLL(path)
                for name in (
                    "scipy_openblas_set_num_threads64_",
                    "openblas_set_num_threads64_",
                    "scipy_openblas_set_num_threads",
                    "openblas_set_num_threads",
                ):
                    fn = getattr(lib, name, None)
                    if fn is not None:
                        fn.argtypes = [ctypes.c_int]
                        self.set_threads = fn
                        return
        except Exception:  # no numpy / no bundled OpenBLAS: torch's BLAS only
            self.set_threads = None

    @property
    def available(self) -> bool:
        return self.set_threads is not None

    def sync_threads(self) -> None:
        n = torch.get_num_threads()
        if n != self.threads:
            self.set_threads(n)
            self.threads = n


_numpy_blas: _NumpyBlas | None = None


def numpy_blas() -> _NumpyBlas:
    global _numpy_blas
    if _numpy_blas is None:
        _numpy_blas = _NumpyBlas()
    return _numpy_blas


class CpuLinear(nn.Linear):
    """CPU fp32 Linear with an extra copy of the weight laid out for the CPU products
    (loader.prepare_cpu_linears turns a loaded ``nn.Linear`` into this class in place, so modules
    shared by reference stay shared). Whichever of these ``pack`` set up, in this order:

    * ``wb``: the weight blocked for our C kernel (``models/cpu_kernels.py``), used for any number
      of rows: it reads the weight once per call whether 1 or 6 rows multiply it, where BLAS
      re-packs it for every call with few rows (the cost of a k+1 verification pass);
    * otherwise, one row (a decode step of one sequence): a GEMV on the column-major weight
      (``weight.t()`` contiguous) through numpy's OpenBLAS when ``choose_gemv`` found it faster
      (~21 GB/s on one core here), else ``F.linear`` (MKL, ~15.5 GB/s); two or more rows: oneDNN's
      GEMM on a weight pre-packed into its blocked layout (``packed``).

    Same values and shapes (up to summation order); the extra copy is built once after loading
    and must be rebuilt (``pack()``) if the weight is changed afterwards.
    """

    packed: torch.Tensor | None = None
    np_wt = None  # numpy view [in, out] of the column-major weight, when numpy GEMV is on
    wb = None  # numpy [ceil(out / 16), in, 16]: the C kernel's blocked copy, when it is on
    np_b = None  # numpy view of the bias [out], with ``wb``
    w = b = None  # plain references to weight [out, in] and bias [out] (``rows``)

    def pack(
        self,
        packed: bool = True,
        numpy_gemv: bool = False,
        kernel: bool = False,
        storage: torch.Tensor | None = None,  # uint8 [blocked_nbytes] for ``wb``, optional
    ) -> None:
        w = self.weight
        self.packed = self.np_wt = self.wb = self.np_b = None
        self.w, self.b = w.detach(), None if self.bias is None else self.bias.detach()
        if w.dtype != torch.float32 or w.device.type != "cpu":
            return
        if kernel and cpu_kernels.available():
            self.wb = cpu_kernels.block_weight(w, storage)
            self.np_b = None if self.b is None else self.b.numpy()
            return
        if packed and onednn_packing_available():
            with torch.no_grad():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 16)
        if numpy_gemv and w.t().is_contiguous() and numpy_blas().available:
            self.np_wt = w.detach().t().numpy()  # shares the weight's memory

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [rows, in] -> [rows, out]
        if x.dim() == 2 and x.dtype == torch.float32 and not x.requires_grad:
            if self.wb is not None:
                return self.rows(x)
            if x.shape[0] > 1:
                if self.packed is not None:
                    return torch.ops.mkldnn._linear_pointwise(
                        x.contiguous(), self.packed, self.bias, "none", [], ""
                    )
            elif self.np_wt is not None:
                numpy_blas().sync_threads()
                y = torch.from_numpy(x.numpy() @ self.np_wt)  # [1, out]
                return y if self.bias is None else y.add_(self.bias)
        return F.linear(x, self.weight, self.bias)

    def rows(self, x: torch.Tensor) -> torch.Tensor:  # x: [rows, in] -> [rows, out]
        """``forward`` for the CPU model loop (models/cpu_forward.py): fp32 ``x`` without grad,
        no module-call overhead; the caller syncs numpy's threads once per forward."""
        if self.wb is not None:
            if x.stride(-1) != 1:
                x = x.contiguous()
            return torch.from_numpy(
                cpu_kernels.gemm(x.numpy(), self.wb, self.out_features, self.np_b)
            )
        if x.shape[0] == 1:
            if self.np_wt is not None:
                y = torch.from_numpy(x.numpy() @ self.np_wt)  # [1, out]
                return y if self.b is None else y.add_(self.b)
        elif self.packed is not None:
            return _linear_pointwise(x.contiguous(), self.packed, self.b, "none", [], "")
        return F.linear(x, self.w, self.b)

    def np_matvec(self):
        """A function of numpy rows [T, in] -> [T, out] (bias included), for the numpy loop of
        the CPU forward (cpu_forward._forward_flat); None unless the C kernel or numpy's GEMV is on."""
        if self.wb is not None:
            wb, n, b = self.wb, self.out_features, self.np_b
            gemm = cpu_kernels.gemm

            def mm(x: np.ndarray) -> np.ndarray:
                return gemm(x, wb, n, b)

            return mm
        if self.np_wt is not None:
            wt, b = self.np_wt, None if self.b is None else self.b.numpy()
            if b is None:
                return wt.__rmatmul__
            return lambda x: np.add(x @ wt, b)
        return None


def _linear_pointwise(*args):  # oneDNN linear on a pre-packed weight, op looked up once
    global _linear_pointwise
    _linear_pointwise = torch.ops.mkldnn._linear_pointwise.default
    return _linear_pointwise(*args)


def choose_gemv(linears: list[CpuLinear], repeats: int = 3) -> bool:
    """Time one-row products over ``linears`` with torch's BLAS and with numpy's OpenBLAS
    (interleaved, best of ``repeats``); True if numpy's was faster by 5% or more."""
    import time

    if not linears or not numpy_blas().available:
        return False
    xs = {m.in_features: torch.randn(1, m.in_features) for m in linears}  # [1, in] each
    best = {"torch": float("inf"), "numpy": float("inf")}
    with torch.inference_mode():
        for _ in range(repeats):
            for name in best:
                for m in linears:
                    m.pack(packed=False, numpy_gemv=name == "numpy")
                t0 = time.perf_counter()
                for m in linears:
                    m(xs[m.in_features])
                best[name] = min(best[name], time.perf_counter() - t0)
    return best["numpy"] < 0.95 * best["torch"]


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))  # [hidden]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, hidden]
        if x.dim() == 2 and x.stride(-1) == 1 and fused.enabled(x):
            return fused.rms_norm(x, self.weight, self.eps)
        if x.device.type == "cpu" and x.dtype == torch.float32:
            return rms_norm_cpu(x, self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rms_norm_cpu(
    x: torch.Tensor,  # [num_tokens, hidden] float32, CPU
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # [num_tokens, hidden]
    """weight * (x * rsqrt(mean(x^2) + eps)), bit for bit the HF arithmetic (mean is sum / N,
    x * x == x.pow(2)) in 6 dispatches with tensor constants."""
    ms = torch.sum(x * x, -1, True)  # [num_tokens, 1]
    r = torch.addcdiv(cpu_const(eps), ms, cpu_const(float(x.shape[-1]))).rsqrt_()  # eps + ms / N
    return torch.mul(x, r).mul_(weight)


def _rope_params(config) -> dict:
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict):
        params = {**scaling, **params}
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    params.setdefault("rope_type", params.get("type", "default") or "default")
    return params


def rope_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] and the attention scaling, for the config's rope type.

    Supports default, linear, dynamic (static at max_position), and llama3 scaling.
    """
    p = _rope_params(config)
    rope_type = p.get("rope_type") or "default"
    base = float(p["rope_theta"])
    partial = float(getattr(config, "partial_rotary_factor", 1.0) or 1.0)
    dim = int(head_dim * partial)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(p["factor"]), 1.0
    if rope_type == "llama3":
        factor = float(p["factor"])
        low = float(p.get("low_freq_factor", 1.0))
        high = float(p.get("high_freq_factor", 4.0))
        old_len = float(p.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    raise NotImplementedError(
        f"rope_type {rope_type!r} is not supported yet (supported: default, linear, llama3)"
    )


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) rotary embedding with a precomputed cos/sin cache."""

    def __init__(self, config, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.register_buffer("cos_cache", torch.empty(0), persistent=False)  # [max_pos, rot_dim]
        self.register_buffer("sin_cache", torch.empty(0), persistent=False)  # [max_pos, rot_dim]
        self._cpu_pos: torch.Tensor | None = None  # positions of the last CPU forward
        self._cpu_cs: tuple | None = None  # their cos, signed sin, sin rows
        self._sin_signed: torch.Tensor | None = None  # [max_pos, rot_dim] (rotate_cpu)
        if not self.cos_cache.is_meta:
            self.reset(config, max_positions, self.cos_cache.device)

    def reset(self, config, max_positions: int, device) -> None:
        """(Re)compute the float32 cos/sin caches on ``device``."""
        inv_freq, scaling = rope_inv_freq(config, self.head_dim)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]  # [max_pos, rot_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, rot_dim]
        self.cos_cache = (emb.cos() * scaling).to(device)
        self.sin_cache = (emb.sin() * scaling).to(device)
        self._cpu_pos = self._cpu_cs = self._sin_signed = None

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if fused.enabled(q) and self.cos_cache.shape[-1] == self.head_dim:
            fused.rope_(positions, q, k, self.cos_cache, self.sin_cache)  # in place
            return q, k
        cos = self.cos_cache[positions].unsqueeze(1)  # [num_tokens, 1, rot_dim]
        sin = self.sin_cache[positions].unsqueeze(1)
        return _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)

    def rotate_cpu(
        self,
        positions: torch.Tensor,  # [num_tokens] (CPU)
        x: torch.Tensor,  # [num_tokens, heads, head_dim]: q and k heads side by side
    ) -> torch.Tensor:  # [num_tokens, heads, head_dim]
        """CPU path: the same rotation as ``forward`` applied to q and k heads in one go, with the
        cos/sin rows gathered once per forward (every layer passes the same ``positions``)."""
        cos, sin = self.cpu_tables(positions)
        if sin is None:  # partial rotary
            return _apply_rope(x, cos, self._cpu_cs[2])
        return rope_cpu(x, cos, sin)

    def cpu_tables(
        self, positions: torch.Tensor  # [num_tokens] (CPU)
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(cos [num_tokens, 1, rot_dim], signed sin [num_tokens, 1, rot_dim] for ``rope_cpu``,
        None for a partial rotary) of ``positions``, gathered once per forward."""
        if positions is not self._cpu_pos:
            self._cpu_pos = positions
            full = self.cos_cache.shape[-1] == self.head_dim
            self._cpu_cs = (
                self.cos_cache[positions].unsqueeze(1),  # [num_tokens, 1, rot_dim]
                self.cpu_sin_signed()[positions].unsqueeze(1) if full else None,
                self.sin_cache[positions].unsqueeze(1),
            )
        return self._cpu_cs[0], self._cpu_cs[1]

    def cpu_sin_signed(self) -> torch.Tensor:  # [max_pos, rot_dim]
        """sin with rotate_half's sign folded in: (-sin, sin) halves (``rope_cpu``)."""
        if self._sin_signed is None:
            half = self.sin_cache.shape[-1] // 2
            self._sin_signed = torch.cat((-self.sin_cache[:, :half], self.sin_cache[:, half:]), -1)
        return self._sin_signed


def rope_cpu(
    x: torch.Tensor,  # [num_tokens, heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim]
    sin_signed: torch.Tensor,  # [num_tokens, 1, head_dim]: (-sin, sin) halves
) -> torch.Tensor:  # [num_tokens, heads, head_dim]
    """Full rotate-half RoPE in 3 compute dispatches, bit for bit ``_apply_rope``: the halves
    swapped by a flip of a [.., 2, half] view, times the sign-folded sin, plus x * cos."""
    T, H, D = x.shape
    swapped = x.view(T, H, 2, D // 2).flip(2).view(T, H, D)  # (x2, x1), a new tensor
    return swapped.mul_(sin_signed).add_(x * cos)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    dtype = x.dtype
    xr = x[..., :rot]
    x1, x2 = xr.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    out = (xr * cos.to(dtype)) + (rotated * sin.to(dtype))
    if rot == x.shape[-1]:
        return out
    return torch.cat((out, x[..., rot:]), dim=-1)


def activation(name: str):
    name = (name or "silu").lower()
    if name in ("silu", "swish"):
        return nn.functional.silu
    if name == "relu":
        return nn.functional.relu
    if name in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
        approx = "tanh" if name != "gelu" else "none"
        return lambda x: nn.functional.gelu(x, approximate=approx)
    raise NotImplementedError(f"activation {name!r} is not supported")


def tensor_parallel_sizes(
    kv_heads: tuple[int, int] | None,  # (num_attention_heads, num_key_value_heads), or None
    widths: dict[str, int],  # config names of dimensions every rank must get an equal share of
    limit: int = 64,
) -> list[int]:
    """The tensor-parallel sizes up to ``limit`` that split ``widths`` equally and, with
    ``kv_heads``, either split the KV heads equally or are a multiple of their number (each rank
    then keeps a copy of the one KV head its query heads use, as vLLM does)."""
    out = []
    for n in range(1, limit + 1):
        if any(v % n for v in widths.values()):
            continue
        if kv_heads is not None:
            nkv = kv_heads[1]
            if (nkv >= n and nkv % n) or (nkv < n and n % nkv):
                continue
        out.append(n)
    return out


def check_tensor_parallel(
    model_type: str,
    size: int,
    kv_heads: tuple[int, int] | None,  # (num_attention_heads, num_key_value_heads), or None
    widths: dict[str, int],  # e.g. {"num_attention_heads": 32, "intermediate_size": 14336}
) -> None:
    """Raise ValueError naming the dimension that ``size`` ranks cannot split, with the sizes
    that can (:func:`tensor_parallel_sizes`)."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {size}")
    if size == 1:
        return
    bad = [f"{k}={v} is not a multiple of it" for k, v in widths.items() if v % size]
    if kv_heads is not None:
        nkv = kv_heads[1]
        if nkv >= size and nkv % size:
            bad.append(f"num_key_value_heads={nkv} is not a multiple of it")
        elif nkv < size and size % nkv:
            bad.append(f"it is not a multiple of num_key_value_heads={nkv} (with fewer KV heads "
                       "than ranks each rank keeps a copy of one)")
    if bad:
        ok = [n for n in tensor_parallel_sizes(kv_heads, widths, limit=max(8, size)) if n > 1]
        raise ValueError(
            f"tensor_parallel_size={size} cannot split this {model_type} model: "
            f"{'; '.join(bad)}; use a tensor_parallel_size that fits"
            + (f" ({', '.join(map(str, ok))})" if ok else " (only 1 fits this model)"))
