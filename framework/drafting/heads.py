"""Building blocks of draft heads made of the target's Llama layers (EAGLE, MTP layers, Hydra's
prefix layer, ...): the layers themselves, which run the target's kernels on every device and
read and write a :class:`~speculant.drafting.kv_cache.DraftKVCache` through the forward context
a :class:`~speculant.drafting.head_drafter.HeadDrafter` passes in, and the chores around them:
the head's Llama ``config.json``, building it without a random initialisation, loading its
checkpoint with clear errors, and the target's LM head restricted to a token map.

The layers (:class:`RMSNorm`, :class:`RotaryEmbedding`, :class:`LlamaAttention`,
:class:`LlamaMLP`, :class:`LlamaDecoderLayer`) take a ``transformers`` Llama ``config``, one
``rope`` shared by a head's attention layers, and in their forward the ``fctx``
(:class:`ForwardContext`) the drafter passes to the head.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from speculant.drafting.checkpoint import checkpoint_files, iter_checkpoint, target_hidden_size
from speculant.drafting.token_map import HotHead, TokenMapError, load_token_map
from speculant.kernels.gemv import gemv
from speculant.models import fused
from speculant.models import layers as _layers
from speculant.models import llama as _llama
from speculant.models.attention import ForwardContext
from speculant.models.layers import RotaryEmbedding
from speculant.models.llama import mlp_gemv
from speculant.models.loader import prepare_cpu_linears
from speculant.models.weights import WeightLoader, WeightLoadError
from speculant.spec_types import StrategyContext, StrategyError


class RMSNorm(_layers.RMSNorm):
    """RMS normalisation with a learned scale, ``RMSNorm(hidden_size, eps)``: ``x [tokens,
    hidden] -> x * rsqrt(mean(x ** 2) + eps) * weight`` (a fused kernel on CUDA)."""


class LlamaAttention(_llama.LlamaAttention):
    """Llama self-attention over a paged KV cache, ``LlamaAttention(config, layer_idx, rope,
    qkv_bias)``: ``(positions [tokens], x [tokens, hidden], fctx) -> [tokens, hidden]``. One fused
    ``qkv_proj`` (q, k, v rows: ``q_size + 2 * kv_size``; replace it for a wider input, as
    EAGLE-3 does), ``o_proj``; K/V stored in and read from cache layer ``layer_idx`` of ``fctx``'s
    ``kv_caches``; RoPE from the shared ``rope``."""


class LlamaMLP(_llama.LlamaMLP):
    """The gated Llama MLP, ``LlamaMLP(config)``: ``x [tokens, hidden] -> down(act(gate(x)) *
    up(x))``, gate and up fused in ``gate_up_proj``."""


class LlamaDecoderLayer(_llama.LlamaDecoderLayer):
    """One Llama decoder layer, ``LlamaDecoderLayer(config, layer_idx, rope, qkv_bias)``:
    ``(positions [tokens], x [tokens, hidden], fctx) -> [tokens, hidden]``, the residual stream
    in and out (``input_layernorm``, ``self_attn``, ``post_attention_layernorm``, ``mlp``). A
    one-row step on CUDA runs its MLP as GEMVs with the norm fused in."""


# checkpoint names -> the fused parameters of LlamaAttention and LlamaMLP
LLAMA_PACKED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def llama_head_dim(config: Any) -> int:
    """The attention head size of a Llama config: ``head_dim``, else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def llama_qkv_bias(config: Any) -> bool:
    """Whether q/k/v projections carry a bias: ``qkv_bias`` if set, else Qwen2 or
    ``attention_bias``."""
    if getattr(config, "qkv_bias", None) is not None:
        return bool(config.qkv_bias)
    return config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))


def residual_mlp(
    mlp: _llama.LlamaMLP,
    norm: _layers.RMSNorm,
    a: torch.Tensor,  # [tokens, hidden] the attention output
    residual: torch.Tensor,  # [tokens, hidden] the residual stream before it
) -> torch.Tensor:  # [tokens, hidden]
    """``x + mlp(norm(x))`` with ``x = residual + a``: the second half of a Llama layer. One row on
    CUDA runs as two GEMVs with the add and the norm fused in (``mlp_gemv``)."""
    if mlp.fused_act and fused.gemv_enabled(a):
        out, x = mlp_gemv(mlp, norm, a, residual)
        return x + out
    x = residual + a
    return x + mlp(norm(x))


def norm_logits(
    x: torch.Tensor,  # [rows, hidden]
    norm: _layers.RMSNorm,
    head: nn.Linear,  # weight [vocab, hidden]
) -> torch.Tensor:  # [rows, vocab] float32
    """``head(norm(x))`` in float32: a head's own final norm and LM head. One row on CUDA runs as
    one GEMV with the norm fused in."""
    if fused.gemv_enabled(x) and x.stride(-1) == 1:
        return gemv(
            x, head.weight, prologue="rmsnorm", norm_weight=norm.weight, eps=norm.eps
        ).float()
    return head(norm(x)).float()


def read_head_config(
    folder: Path,
    raw: dict[str, Any],  # the parsed config.json (read_config_json)
    vocab_size: int,  # the target's
    what: str,  # the head's kind, for errors: "EAGLE"
) -> Any:
    """The ``transformers`` config of a head's ``config.json`` in ``folder`` (a Llama config when
    ``transformers`` does not know its ``model_type``). Raises StrategyError naming the file if it
    lacks ``hidden_size``, ``num_attention_heads`` or ``intermediate_size``, or its
    ``vocab_size`` is not the target's."""
    import transformers

    from speculant.models.loader import load_config

    cfg_file = folder / "config.json"
    try:
        cfg = load_config(folder)
    except ValueError:
        d = {k: v for k, v in raw.items() if k != "model_type"}
        try:
            cfg = transformers.LlamaConfig(**d)
        except Exception as e:
            raise StrategyError(f"{cfg_file}: cannot be read as a Llama config ({e})") from None
    for key in ("hidden_size", "num_attention_heads", "intermediate_size"):
        if not getattr(cfg, key, None):
            raise StrategyError(f"{cfg_file}: missing {key}")
    if getattr(cfg, "vocab_size", None) != vocab_size:
        raise StrategyError(
            f"{cfg_file}: vocab_size={getattr(cfg, 'vocab_size', None)} but the target model's "
            f"vocabulary has {vocab_size} tokens; this {what} head was trained for a "
            f"different target model. Use the {what} checkpoint trained for this target"
        )
    return cfg


def build_head(
    make: Callable[[], nn.Module],
    config: Any,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int,
) -> nn.Module:
    """``make()`` built without initialising its weights (on the meta device, then left
    uninitialised on ``device`` in ``dtype``: load every weight next) and its rotary embeddings'
    tables computed for ``max_positions`` positions."""
    with torch.device("meta"):
        module = make()
    module = module.to_empty(device=device).to(dtype)
    for m in module.modules():
        if isinstance(m, RotaryEmbedding):
            m.reset(config, max_positions, device)
    return module


def load_head_weights(
    module: nn.Module,
    folder: Path,
    *,
    packed: dict[str, tuple[str, ...]] | None = None,
    prefixes: dict[str, str] | None = None,
    shapes: dict[str, tuple[int, ...]] | None = None,
    extra: tuple[str, ...] = (),
    hint: str = "",
) -> dict[str, tuple[Path, torch.Tensor]]:
    """Copy every tensor of the checkpoint in ``folder`` into ``module``'s parameter of the same
    name; return the tensors named in ``extra`` as ``{name: (file, tensor)}`` instead.

    A ``model.`` prefix is dropped and a name starting with a key of ``prefixes`` gets its value
    in its place (``{"layers.0.": "midlayer."}``); ``*rotary_emb.inv_freq`` buffers are skipped;
    the tensors named in ``shapes`` are only checked against their shape there and dropped (a
    frozen copy of a target weight). ``packed`` maps a fused parameter to the checkpoint's parts
    (default :data:`LLAMA_PACKED`). Raises StrategyError naming the file, the tensor and the
    shape the config implies, or the missing and unexpected tensors (``hint`` appended: where
    the expected names are listed). E.g. EAGLE-3's: ``load_head_weights(head, folder,
    prefixes={"layers.0.": "midlayer."}, extra=("d2t", "t2d"))``. On the CPU the module's
    Linears then get the target's CPU layouts (``prepare_cpu_linears``: our C kernel's blocked
    weights), so load every weight through here, not by assigning parameters afterwards.
    """
    files = checkpoint_files(folder)
    source = str(files[0]) if len(files) == 1 else f"{folder} ({', '.join(f.name for f in files)})"
    loader = WeightLoader(module, source, packed=LLAMA_PACKED if packed is None else packed)
    shapes, kept = shapes or {}, {}
    for file, name, tensor in iter_checkpoint(folder):
        key = name.removeprefix("model.")
        for old, new in (prefixes or {}).items():
            if key.startswith(old):
                key = new + key.removeprefix(old)
                break
        if key in extra:
            kept[key] = (file, tensor)
        elif key in shapes:
            if tuple(tensor.shape) != tuple(shapes[key]):
                raise StrategyError(
                    f"{file}: {key} has shape {tuple(tensor.shape)}, expected {shapes[key]}"
                )
        elif not key.endswith("rotary_emb.inv_freq"):
            try:
                loader.load(key, tensor)
            except WeightLoadError as e:
                raise StrategyError(f"{e} (checkpoint tensor {name!r} of {file})") from None
    try:
        loader.finish()
    except WeightLoadError as e:
        raise StrategyError(f"{e}{hint}") from None
    if any(p.device.type == "cpu" for p in module.parameters()):
        # the target's CPU layouts (the C kernel's blocked copies): a draft step's few-row
        # products run as the target's do (torch's one-row products are ~3x slower there)
        prepare_cpu_linears(module)
    return kept


def target_num_layers(ctx: StrategyContext) -> int:
    """The number of decoder layers of the target model."""
    n = getattr(ctx.target_model, "num_layers", 0) or ctx.target_config.num_hidden_layers
    return int(n)


class DraftVocab:
    """A head's own draft vocabulary of ``size`` tokens (EAGLE-3's ``d2t``): draft id ``d`` is
    target id ``targets[d] = d + d2t[d]``. ``d2t``: ``[size]`` integer offsets, or None when the
    draft vocabulary is the target's. Checked here: shape, dtype, range, no two draft ids on
    one target id; errors (StrategyError) name ``source``, the file ``d2t`` came from.

    ``targets`` ``[size]`` int64 on ``device``; ``identity``: the draft ids are the target ids
    (no mapping needed); ``ascending``: the target ids ascend with the draft ids, so the first
    maximum of draft logits maps to the lowest target id among the tied ones, as the argmax of
    the full-vocabulary row gives (``hot_argmax`` is exact). Decided once here: a device read
    per draft step would stall the draft loop.

    >>> DraftVocab(torch.tensor([0, 1, 1]), 3, 8, torch.device("cpu"), "x").targets.tolist()
    [0, 2, 3]
    """

    def __init__(
        self,
        d2t: torch.Tensor | None,  # [size] integer
        size: int,
        vocab_size: int,  # the target's
        device: torch.device,
        source: str | Path,
    ) -> None:
        V = vocab_size
        if d2t is None:
            if size != V:
                raise StrategyError(
                    f"{source}: no d2t tensor, but draft_vocab_size={size} differs "
                    f"from vocab_size={V} so the draft->target id map is needed"
                )
            offsets = torch.zeros(size, dtype=torch.long)
        else:
            if tuple(d2t.shape) != (size,) or d2t.dtype.is_floating_point:
                raise StrategyError(
                    f"{source}: d2t has shape {tuple(d2t.shape)} and dtype {d2t.dtype}, "
                    f"expected integer offsets of shape ({size},)"
                )
            offsets = d2t.long()
        targets = torch.arange(size) + offsets  # [size] on the CPU
        if int(targets.min()) < 0 or int(targets.max()) >= V:
            raise StrategyError(
                f"{source}: d2t maps draft ids outside the target vocabulary [0, {V})"
            )
        if len(set(targets.tolist())) != size:
            raise StrategyError(f"{source}: d2t maps two draft ids to the same target id")
        self.size, self.vocab_size = size, V
        self.targets = targets.to(device)
        self.identity = size == V and not bool(offsets.any())
        self.ascending = bool((targets[1:] > targets[:-1]).all())


def target_hot_head(ctx: StrategyContext, path: str) -> HotHead:
    """The target's LM head restricted to the token map at ``path`` (FR-Spec): a head that drafts
    through the target's LM head drafts over those rows only. Raises StrategyError if the target
    has no ``[vocab, hidden]`` ``lm_head.weight`` or the map is bad."""
    head = getattr(ctx.target_model, "lm_head", None)
    weight = getattr(head, "weight", None)
    V, H = ctx.vocab_size, target_hidden_size(ctx)
    if weight is None or weight.dim() != 2 or tuple(weight.shape) != (V, H):
        raise StrategyError(
            f"token_map: the target model's LM head (lm_head.weight "
            f"{None if weight is None else tuple(weight.shape)}) is not a [{V}, "
            f"{H}] matrix; use this target without token_map"
        )
    try:
        ids = load_token_map(path, V)
    except TokenMapError as e:
        raise StrategyError(str(e)) from None
    return HotHead(weight, ids, V, like=head)


__all__ = [
    "LLAMA_PACKED",
    "ForwardContext",
    "LlamaAttention",
    "LlamaDecoderLayer",
    "LlamaMLP",
    "RMSNorm",
    "RotaryEmbedding",
    "DraftVocab",
    "build_head",
    "llama_head_dim",
    "llama_qkv_bias",
    "load_head_weights",
    "prepare_cpu_linears",
    "norm_logits",
    "read_head_config",
    "residual_mlp",
    "target_hot_head",
    "target_num_layers",
]
