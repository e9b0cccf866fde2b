"""MLPSpeculator (IBM, "Accelerating Production LLMs with Combined Token/Embedding Speculators",
arXiv 2404.19124): a chain of small MLP stages conditioned on the target's last hidden state.

Checkpoint format (``ibm-ai-platform/*-accelerator``, ``ibm-granite/*-accelerator``, fms-extras'
``MLPSpeculatorPreTrainedModel``): ``config.json`` with ``architectures:
["MLPSpeculatorPreTrainedModel"]`` / ``model_type: "mlp_speculator"``, ``n_predict``, ``emb_dim``
(the target's hidden size), ``inner_dim`` (0 means ``emb_dim``), ``vocab_size``, ``tie_weights``,
``scale_input``; weights (safetensors or ``pytorch_model.bin``, with or without the
``speculator.`` prefix)::

    emb.{i}.weight   [vocab, inner]         token embedding of stage i
    proj.{i}.weight  [inner, emb_dim|inner] state projection (stage 0 reads the target state)
    head.{i}.weight  [vocab, inner]         stage i's LM head
    ln.{i}.weight, ln.{i}.bias  [inner]     stage i's norm (RMS scaling, then weight and bias)

With ``tie_weights`` every stage shares ``emb``, ``head`` and ``ln`` and every stage after the
first shares ``proj.1`` (fms-extras' ``tie_wts``); the checkpoint may hold only index 0 (and
``proj.1``) or every index (each copy must then be identical).

Stage i, given the state ``s`` (the target's final-norm hidden state of the position that produced
the last token, first passed through a weightless RMS norm and divided by sqrt(2) when
``scale_input``) and the previous token ``t``::

    z = emb_i(t) * sqrt(1 - w**2) * sqrt(inner / 2)      w = 0.5 ** (0.5 / n_predict)
    s = gelu(ln_i(proj_i(s) * w + z))
    logits_i = head_i(s)

Greedy requests take the argmax of each stage; sampled requests draw from the stage's softmax
after the request's temperature / top-k / top-p / min-p and pass those probabilities as ``q`` to
the rejection sampler, so the output distribution stays exactly the target's.

With the option ``token_map`` (a file of hot token ids, ``speculant.drafting.load_token_map``)
every head keeps only the hot rows: greedy drafts are the argmax over the hot logits mapped
through the hot ids, sampled drafts use full-vocabulary rows where the other tokens get logit
-inf (q = 0 for them).

``num_speculative_tokens`` defaults to ``n_predict``. Larger values must be multiples of
``n_predict``: with ``tie_weights`` the recurrence simply continues with the shared stage (the
model is recurrent by construction, as in vLLM); without it stage ``j`` reuses head
``j % n_predict`` and feeds the last state back into ``proj.0`` (this needs ``inner_dim ==
emb_dim``; those extra stages were never trained, so expect low acceptance for them).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from speculant import hookimpl
from speculant.drafting import (
    ChainGraphs,
    CheckpointConfig,
    DraftSampler,
    StrategyError,
    ascending_ids,
    hot_argmax,
    keep_rows,
    last_hidden_rows,
    linear,
    load_into,
    load_token_map,
    read_config_json,
    resolve_draft_folder,
    row_argmax,
    scatter_hot,
    split_drafts,
    target_hidden_size,
    to_device_async,
)
from speculant.hookspecs import Strategy
from speculant.spec_types import Proposal, SpecBatch, StrategyContext

MLP_ARCHITECTURES = ("MLPSpeculatorPreTrainedModel", "MLPSpeculator")


# --------------------------------------------------------------------------------------------
# the model
# --------------------------------------------------------------------------------------------
class MLPSpeculatorNorm(nn.Module):
    """fms' LayerNormParameterized(use_mean=False): x / rms(x), then weight and bias (optional)."""

    def __init__(self, dim: int, affine: bool, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        if affine:
            self.weight = nn.Parameter(torch.ones(dim))
            self.bias = nn.Parameter(torch.zeros(dim))
        else:
            self.weight = self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [rows, dim]
        h = x.float()
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        if self.weight is not None:
            h = h * self.weight + self.bias
        return h


class MLPSpeculatorModel(nn.Module):
    def __init__(
        self,
        n_predict: int,
        emb_dim: int,
        inner_dim: int,
        vocab_size: int,
        tie_weights: bool,
        scale_input: bool,
    ) -> None:
        super().__init__()
        self.n_predict = n_predict
        self.emb_dim = emb_dim
        self.inner_dim = inner_dim
        self.tie_weights = tie_weights
        self.scale_input = scale_input
        n_shared = 1 if tie_weights else n_predict
        n_proj = min(2, n_predict) if tie_weights else n_predict
        self.emb = nn.ModuleList(nn.Embedding(vocab_size, inner_dim) for _ in range(n_shared))
        self.proj = nn.ModuleList(
            nn.Linear(emb_dim if i == 0 else inner_dim, inner_dim, bias=False)
            for i in range(n_proj)
        )
        self.head = nn.ModuleList(
            nn.Linear(inner_dim, vocab_size, bias=False) for _ in range(n_shared)
        )
        self.ln = nn.ModuleList(MLPSpeculatorNorm(inner_dim, affine=True) for _ in range(n_shared))
        self.ln0 = MLPSpeculatorNorm(emb_dim, affine=False) if scale_input else None
        self.state_weight = 0.5 ** (0.5 / n_predict)
        self.emb_scale = math.sqrt(1.0 - self.state_weight**2) * math.sqrt(inner_dim / 2)
        self.vocab_size = vocab_size
        self.hot_ids: torch.Tensor | None = None  # [N] int64: the token map (restrict_heads)

    def restrict_heads(self, ids: torch.Tensor) -> None:
        """Keep only the rows ``ids`` [N] (a token map; sorted here if not) of every stage's
        head, as contiguous copies [N, inner] that replace the full heads (which are freed);
        ``stage_head`` then gives the N hot logits, ``greedy`` maps their argmax through the hot
        ids and ``expand`` scatters them into full-vocabulary rows of -inf."""
        self.hot_ids = ascending_ids(ids, self.head[0].weight.device)  # [N]
        for head in self.head:
            keep_rows(head, self.hot_ids)  # [N, inner]

    def stage_modules(self, j: int) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
        """(emb, proj, ln, head) of draft position j (0-based)."""
        if self.tie_weights:
            return (
                self.emb[0],
                self.proj[0 if j == 0 else len(self.proj) - 1],
                self.ln[0],
                self.head[0],
            )
        i = j % self.n_predict
        return self.emb[i], self.proj[i], self.ln[i], self.head[i]

    def prepare_state(self, state: torch.Tensor) -> torch.Tensor:
        if self.ln0 is not None:
            state = self.ln0(state) / math.sqrt(2.0)
        return state

    def stage_head(
        self, j: int, state: torch.Tensor, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """state [rows, emb_dim or inner], tokens [rows] -> (new state [rows, inner], the head's
        logits fp32: [rows, vocab], or with a token map [rows, N] over the hot ids)."""
        emb, proj, ln, head = self.stage_modules(j)
        z = emb(tokens) * self.emb_scale
        state = F.gelu(ln(linear(state, proj.weight, proj.bias) * self.state_weight + z))
        return state, linear(state, head.weight, head.bias).float()  # [rows, vocab or N]

    def expand(self, logits: torch.Tensor) -> torch.Tensor:  # [rows, vocab or N] -> [rows, vocab]
        """The head's logits as full-vocabulary rows (with a token map: -inf outside the hot
        ids), for the draft probabilities of sampled requests."""
        if self.hot_ids is None:
            return logits
        return scatter_hot(logits, self.hot_ids, self.vocab_size)

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:  # [rows, vocab or N] -> [rows] int64
        """``row_argmax(expand(logits))``: with a token map the argmax over the N hot logits
        mapped through the hot ids (``hot_argmax``: no full-vocabulary row). Device-side only."""
        if self.hot_ids is None:
            return row_argmax(logits)
        return hot_argmax(logits, self.hot_ids)


_KEY = re.compile(r"^(emb|proj|head|ln)\.(\d+)\.(weight|bias)$")


def load_mlp_speculator(
    cfg: CheckpointConfig, device: torch.device, dtype: torch.dtype
) -> MLPSpeculatorModel:
    """Build the model from config.json values and load its weights (strict)."""
    n, emb_dim = cfg.field("n_predict", int, minimum=1), cfg.field("emb_dim", int)
    inner = cfg.field("inner_dim", int, 0) or emb_dim
    tie = cfg.field("tie_weights", bool, False)
    vocab = cfg.field("vocab_size", int)
    model = MLPSpeculatorModel(n, emb_dim, inner, vocab, tie, cfg.field("scale_input", bool, False))
    model = model.to(device=device, dtype=dtype)

    def rename(key: str) -> str:  # tied: every index loads the shared stage (its copies equal)
        m = _KEY.match(key)
        if m is None or not tie or int(m.group(2)) >= n:
            return key
        kind, idx = m.group(1), int(m.group(2))
        idx = (0 if idx == 0 else len(model.proj) - 1) if kind == "proj" else 0
        return f"{kind}.{idx}.{m.group(3)}"

    hint = (
        f"{cfg.file}: n_predict={n}, emb_dim={emb_dim}, inner_dim={inner}, vocab_size={vocab}, "
        f"tie_weights={tie}; tensors emb.i.weight, proj.i.weight, head.i.weight, ln.i.weight, "
        "ln.i.bias, optionally prefixed 'speculator.'"
    )
    load_into(model, cfg.file.parent, strip_prefixes=("speculator.",), rename=rename, hint=hint,
              what="MLPSpeculator checkpoint")
    return model.eval()


# --------------------------------------------------------------------------------------------
# the strategy
# --------------------------------------------------------------------------------------------
class MLPSpeculatorOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field(..., description="folder (or hub id) of the MLPSpeculator checkpoint")
    num_speculative_tokens: int | None = Field(None, ge=1, le=64)
    token_map: str | None = Field(
        None,
        description="file of hot token ids (.pt, .json, .npy or .txt; docs/drafting.md): "
        "every stage's head keeps only those rows (FR-Spec)",
    )


class MLPSpeculatorStrategy(Strategy):
    """Draft with an IBM MLPSpeculator conditioned on the target's last hidden state."""

    name = "mlp_speculator"
    aliases = ("mlp-speculator",)
    Config = MLPSpeculatorOptions
    needs_hidden_states = True

    @classmethod
    def matches_model(cls, path: Path, config: dict[str, Any]) -> bool:
        archs = config.get("architectures") or []
        return config.get("model_type") == "mlp_speculator" or any(
            a in MLP_ARCHITECTURES for a in archs
        )

    def __init__(self, config: MLPSpeculatorOptions, ctx: StrategyContext) -> None:
        super().__init__(config, ctx)
        folder = resolve_draft_folder(config.model)
        cfg = read_config_json(folder)
        if not self.matches_model(folder, cfg):
            raise StrategyError(
                f"{cfg.file}: not an MLPSpeculator checkpoint (architectures="
                f"{cfg.get('architectures')}, model_type={cfg.get('model_type')!r}; expected "
                "MLPSpeculatorPreTrainedModel / mlp_speculator)"
            )
        cfg.check_target("emb_dim", target_hidden_size(ctx), "hidden size")
        cfg.check_target("vocab_size", ctx.vocab_size, "vocabulary size")
        self.model = model = load_mlp_speculator(cfg, ctx.device, ctx.dtype)
        n = model.n_predict
        k = self.num_speculative_tokens = config.num_speculative_tokens or n
        if k > n and k % n:
            raise StrategyError(
                f"num_speculative_tokens={k} is larger than the speculator's n_predict={n} "
                f"({cfg.file}) and not a multiple of it; use k <= {n} or a multiple of {n}"
            )
        if k > n and (not model.tie_weights or n == 1) and model.inner_dim != model.emb_dim:
            raise StrategyError(
                f"num_speculative_tokens={k} > n_predict={n} reuses the heads cyclically, which "
                f"feeds the last state back into proj.0; {cfg.file} has inner_dim="
                f"{model.inner_dim} != emb_dim={model.emb_dim}, so use k <= {n}"
            )
        if config.token_map:  # the heads' hot rows, once here (the full heads are freed)
            model.restrict_heads(load_token_map(config.token_map, ctx.vocab_size))
        self.generator = torch.Generator().manual_seed(ctx.seed + 104729)
        self.graphs = ChainGraphs(  # all K greedy stages as one CUDA graph replay
            ctx.device, f"mlp_speculator {folder}", ctx.enforce_eager, model.emb_dim, ctx.dtype,
            lambda state, tokens, K: self._stages(state, tokens, K, None),
        )

    @hookimpl
    @torch.inference_mode()
    def propose(self, batch: SpecBatch) -> Proposal:
        B = len(batch.seqs)
        rows, state = last_hidden_rows(batch)  # state: [rows, emb_dim]
        if state is None:
            return Proposal(token_ids=[[] for _ in range(B)])
        dev = state.device
        # every row runs max(want) stages (the stages of a row depend on that row only)
        want = [min(batch.seqs[i].max_draft, self.num_speculative_tokens) for i in rows]
        K = max(want)
        tokens = [batch.seqs[i].token_ids[-1] for i in rows]
        sampler = DraftSampler([batch.seqs[i] for i in rows], want, self.generator, dev)
        out = self.graphs.run(state, tokens, K) if sampler.all_greedy else None  # [rows, K]
        if out is None:
            tok_t = to_device_async(tokens, torch.long, dev)  # [rows]
            choose = None if sampler.all_greedy else sampler  # all greedy: no q to keep
            out = self._stages(state, tok_t, K, choose)  # [rows, K]
        # the read-back also tells the graph cache its last replay has run (graph inputs free)
        drafts = split_drafts(out, rows, want, B, self.graphs)
        return Proposal(token_ids=drafts, probs=sampler.probs(rows, B, self.ctx.vocab_size))

    def _stages(
        self,
        state: torch.Tensor,
        tokens: torch.Tensor,
        K: int,
        sampler: DraftSampler | None,
    ) -> torch.Tensor:
        """state [rows, emb_dim] (the target's state that produced ``tokens`` [rows]) -> the
        draft tokens of K stages [rows, K]; ``sampler(j, logits [rows, vocab])`` picks stage j's
        tokens, or with no sampler (every row greedy) the model's ``greedy`` argmax, which with
        a token map needs no full-vocabulary row."""
        model = self.model
        state = model.prepare_state(state.to(self.ctx.dtype))
        out = []
        for j in range(K):
            state, logits = model.stage_head(j, state, tokens)  # [rows, vocab or N] float32
            if sampler is None:
                tokens = model.greedy(logits)  # [rows]
            else:
                tokens = sampler(j, model.expand(logits))  # [rows]
            out.append(tokens)
        return torch.stack(out, dim=1)  # [rows, K]

    @hookimpl
    @torch.inference_mode()
    def capture_graphs(self, max_num_seqs: int, progress: bool) -> int:
        """The greedy stages graph of every batch bucket up to ``max_num_seqs`` sequences (at
        most 256), K = k, captured on zero states and tokens (it writes no cache)."""
        return self.graphs.capture(self.num_speculative_tokens, max_num_seqs, progress)


@hookimpl
def register_strategies(register) -> None:
    register(MLPSpeculatorStrategy)
