"""Building blocks shared by the model implementations."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from speculant.models import fused


def onednn_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


class CpuLinear(nn.Linear):
    """CPU fp32 Linear with two copies of the weight, one per regime (loader.prepare_cpu_linears
    turns a loaded ``nn.Linear`` into this class in place, so modules shared by reference stay
    shared):

    * one row (a decode step of one sequence): ``F.linear`` on the column-major weight
      (``weight.t()`` contiguous), which MKL's GEMV streams at ~16 GB/s on one core;
    * two or more rows (batched decode, verification passes of k + 1 tokens, prefill): oneDNN's
      GEMM on a weight pre-packed into its blocked layout. MKL's small-M SGEMM reads the weight
      once per few rows there (4 rows took 2.3x, 11 rows 3x the one-row time on SmolLM2), oneDNN
      reads it about once (4 rows ~1.0x, 11 rows ~1.3x).

    Same values and shapes; the packed copy is built once after loading (``packed``, opaque
    mkldnn tensor) and must be rebuilt (``pack()``) if the weight is changed afterwards.
    """

    packed: torch.Tensor | None = None

    def pack(self) -> None:
        w = self.weight
        self.packed = None
        if w.dtype == torch.float32 and w.device.type == "cpu" and onednn_packing_available():
            with torch.no_grad():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [rows, in] -> [rows, out]
        p = self.packed
        if p is not None and x.dim() == 2 and x.shape[0] > 1 and x.dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), p, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))  # [hidden]
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, hidden]
        if x.dim() == 2 and x.stride(-1) == 1 and fused.enabled(x):
            return fused.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


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
