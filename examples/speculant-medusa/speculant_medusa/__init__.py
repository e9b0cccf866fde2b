"""Medusa-1 heads (Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple
Decoding Heads", arXiv 2401.10774) as a third-party speculant strategy, written only against
speculant's public API (``speculant``, ``speculant.hookspecs``, ``speculant.spec_types``,
``speculant.drafting``).

Head i reads the target's hidden state ``h`` of the position that produced the last token (the
LM head's input) and predicts the token i + 1 positions after it::

    x = h;  for each residual block j:  x = x + silu(W1[i, j] @ x + b1[i, j])
    logits_i = W2[i] @ x                                     # [vocab]

so one propose call drafts ``[pick(logits_0), ..., pick(logits_{k-1})]`` from one state: a top-1
chain. ``pick`` is the argmax for greedy requests and a sample of the request's sampling
distribution otherwise, kept as ``q`` for the lossless rejection sampler
(``speculant.drafting.DraftSampler``).

With tree choices (``medusa_choices``, or vLLM's ``speculative_token_tree``: paths of sibling
ranks from the root, ``speculant.drafting.TokenTreeShape``) it drafts the paper's candidate tree
instead: the node at path ``(r_0, ..., r_{d-1})`` holds head ``d - 1``'s rank-``r_{d-1}`` token
(``fill_static_tree``), for every request: deterministic top-k tokens are point masses, which
the engine's tree verification keeps lossless for sampled requests too (docs/trees.md).

On CUDA the tree proposal replays a CUDA graph (``GraphCache``), one per padded batch bucket
(``bucket(rows)``), captured at start-up (the ``capture_graphs`` hook): the state rows are
copied into the graph's static ``[Bp, hidden]`` input, the graph runs the heads and their top-k,
and the host reads the ranked tokens back once. On the CPU, with ``enforce_eager``, beyond the
largest bucket or if a capture fails, the same function runs eagerly on the unpadded rows. The
chain runs eagerly.

Checkpoints, as published by FasterDecoding (``medusa/model/medusa_model.py``): ``config.json``
with ``medusa_num_heads`` and ``medusa_num_layers``, and ``medusa_lm_head.safetensors`` or
``medusa_lm_head.pt``, the state dict of the heads' ``nn.ModuleList`` (optionally prefixed
``medusa_head.``)::

    {i}.{j}.linear.weight  [hidden, hidden]    residual block j < medusa_num_layers of head i
    {i}.{j}.linear.bias    [hidden]
    {i}.{L}.weight         [vocab, hidden]     head i's output layer, L = medusa_num_layers

vLLM's converted layout loads too: ``config.json`` with ``num_heads``, ``num_hidden_layers``
(``medusa_fc_bias``, ``original_lm_head``: one output layer shared by every head) and tensors
``blocks.{i}.layers.{j}.weight`` / ``.bias``, ``lm_heads.{i}.weight`` (optionally prefixed
``medusa_heads.``), in ``model.safetensors`` or ``pytorch_model.bin``.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator

from speculant import hookimpl
from speculant.drafting import (
    BUCKETS,
    CheckpointConfig,
    DraftSampler,
    GraphCache,
    StrategyError,
    TokenTreeShape,
    bucket,
    fill_static_tree,
    last_hidden_rows,
    read_back,
    read_config_json,
    read_tensors,
    resolve_draft_folder,
    split_drafts,
    target_hidden_size,
)
from speculant.hookspecs import Strategy
from speculant.spec_types import Proposal, SpecBatch, StrategyContext

__version__ = "0.1.0"

HEAD_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")  # FasterDecoding's file names


class MedusaHeads:
    """The heads' weights, stacked: ``w1t`` [heads, layers, hidden, hidden] (transposed),
    ``b1`` [heads, layers, hidden], ``w2t`` [heads or 1, hidden, vocab] (transposed)."""

    def __init__(self, w1t: torch.Tensor, b1: torch.Tensor, w2t: torch.Tensor) -> None:
        self.w1t, self.b1, self.w2t = w1t, b1, w2t

    def logits(self, h: torch.Tensor, k: int) -> torch.Tensor:
        """h [rows, hidden] -> logits of heads 0..k-1, [k, rows, vocab] float32."""
        x = h.to(self.w2t.dtype).unsqueeze(0).expand(k, -1, -1)  # [k, rows, hidden]
        for j in range(self.w1t.shape[1]):
            x = x + F.silu(torch.baddbmm(self.b1[:k, j, None], x, self.w1t[:k, j]))
        w2t = self.w2t[:k] if self.w2t.shape[0] > 1 else self.w2t.expand(k, -1, -1)
        return torch.bmm(x, w2t).float()  # [k, rows, vocab]


def load_heads(
    folder: Path,
    cfg: CheckpointConfig,
    hidden: int,
    vocab: int,
    device: torch.device,
    dtype: torch.dtype,
) -> MedusaHeads:
    """Read every head of the checkpoint (strict: each tensor present once, of the shape the
    target implies; nothing else), as ``dtype`` on ``device``."""
    faster = "medusa_num_heads" in cfg
    if not faster and "num_heads" not in cfg:
        raise StrategyError(
            f"{cfg.file}: not a Medusa head (no medusa_num_heads, nor vLLM's num_heads)"
        )
    heads = cfg.field("medusa_num_heads" if faster else "num_heads", int, minimum=1)
    layers = cfg.field("medusa_num_layers" if faster else "num_hidden_layers", int, 1, minimum=0)
    for name, value, what in (
        ("hidden_size", hidden, "hidden size"),
        ("vocab_size", vocab, "vocabulary size"),
    ):
        if name in cfg:  # vLLM's layout has them; FasterDecoding's names the base model only
            cfg.check_target(name, value, what)
    bias = faster or cfg.field("medusa_fc_bias", bool, False)
    shared = not faster and cfg.field("original_lm_head", bool, False)
    slots: dict[str, tuple[str, tuple[int, ...]]] = {}  # checkpoint key -> (tensor, index)
    for i in range(1 if shared else heads):  # head i's output layer
        slots[f"{i}.{layers}.weight" if faster else f"lm_heads.{i}.weight"] = ("w2", (i,))
    for i, j in itertools.product(range(heads), range(layers)):  # residual block j of head i
        block = f"{i}.{j}.linear." if faster else f"blocks.{i}.layers.{j}."
        slots[block + "weight"] = ("w1", (i, j))
        if bias:
            slots[block + "bias"] = ("b1", (i, j))
    shape = {"w1": (hidden, hidden), "b1": (hidden,), "w2": (vocab, hidden)}
    stacked = {  # filled tensor by tensor as read; w1 and w2 transposed
        "w1": torch.zeros(heads, layers, hidden, hidden, device=device, dtype=dtype),
        "b1": torch.zeros(heads, layers, hidden, device=device, dtype=dtype),
        "w2": torch.zeros(1 if shared else heads, hidden, vocab, device=device, dtype=dtype),
    }

    def into(key: str, t: torch.Tensor) -> None:
        kind, idx = slots[key]
        stacked[kind][idx].copy_(t if kind == "b1" else t.t())

    # a Medusa-2 folder also holds the fine-tuned base model: the head file is what loads
    head = next((folder / n for n in HEAD_FILES if (folder / n).exists()), folder)
    read_tensors(
        head,
        {key: shape[kind] for key, (kind, _) in slots.items()},
        into=into,
        strip_prefixes=("medusa_head.", "medusa_heads."),
        what="Medusa head",
        hint=f"{cfg.file} describes {heads} heads of {layers} residual blocks; shapes "
        f"from the target model: hidden size {hidden}, vocabulary {vocab}",
    )
    return MedusaHeads(stacked["w1"], stacked["b1"], stacked["w2"])


class MedusaConfig(BaseModel):
    """``speculative_config`` options of ``method="medusa"`` (vLLM's names)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field(..., description="folder (or hub id) of the Medusa heads")
    num_speculative_tokens: int | None = Field(
        None,
        ge=1,
        le=64,
        description="tokens drafted per step (default: every head; with a tree: its node count)",
    )
    medusa_choices: str | list[tuple[int, ...]] | None = Field(
        None,
        description="candidate tree (Medusa's medusa_choices): paths of sibling ranks from "
        "the root, e.g. [(0,), (1,), (0, 0)]; node (r_0..r_{d-1}) = head d-1's rank r_{d-1} token",
    )
    speculative_token_tree: str | list[tuple[int, ...]] | None = Field(
        None, description="vLLM's name for the same tree (give one of the two)"
    )

    @model_validator(mode="after")
    def _tree(self) -> MedusaConfig:
        self.tree_shape()
        return self

    def tree_shape(self) -> TokenTreeShape | None:
        """The candidate tree, or None for a chain; ValueError for a bad one."""
        choices = self.medusa_choices, self.speculative_token_tree
        if None not in choices:
            raise ValueError(
                "medusa_choices and speculative_token_tree are two names of one option: give one"
            )
        paths = choices[0] if choices[0] is not None else choices[1]
        if paths is None:
            return None
        tree = TokenTreeShape(paths, "medusa_choices")
        k = self.num_speculative_tokens
        if k is not None and k != tree.num_nodes:
            raise ValueError(
                f"num_speculative_tokens={k} but the tree has {tree.num_nodes} "
                "nodes: with a tree it is the node count; leave it out"
            )
        return tree


class MedusaStrategy(Strategy):
    """Draft a top-1 chain with Medusa heads on the target's last hidden state."""

    name = "medusa"
    Config = MedusaConfig
    needs_hidden_states = True

    @classmethod
    def matches_model(cls, path: Path, config: dict[str, Any]) -> bool:
        return "medusa_num_heads" in config or config.get("model_type") == "medusa"

    def __init__(self, config: MedusaConfig, ctx: StrategyContext) -> None:
        super().__init__(config, ctx)
        folder = resolve_draft_folder(config.model)
        hidden = target_hidden_size(ctx)
        self.heads = load_heads(
            folder, read_config_json(folder), hidden, ctx.vocab_size, ctx.device, ctx.dtype
        )
        n = self.heads.w1t.shape[0]
        self.tree = tree = config.tree_shape()  # TokenTreeShape or None (a chain)
        if tree is not None and tree.depth > n:
            raise StrategyError(
                f"the Medusa tree is {tree.depth} deep, but {folder / 'config.json'} has {n} "
                f"heads: head i drafts depth i + 1, so use paths of at most {n} ranks"
            )
        k = tree.num_nodes if tree is not None else config.num_speculative_tokens or n
        if k > n and tree is None:
            raise StrategyError(
                f"num_speculative_tokens={k}, but {folder / 'config.json'} has {n} Medusa heads: "
                f"head i drafts the token i + 1 positions ahead, so k <= {n}"
            )
        self.num_speculative_tokens = k  # read by the engine: no sequence drafts more
        self.generator = torch.Generator().manual_seed(ctx.seed + 7919)
        self.hidden = hidden
        self.graphs = GraphCache(ctx.device, f"medusa tree {folder}", ctx.enforce_eager)

    @hookimpl
    @torch.inference_mode()
    def propose(self, batch: SpecBatch) -> Proposal:
        B = len(batch.seqs)
        rows, state = last_hidden_rows(batch)  # state: [rows, hidden]
        if state is None:
            return Proposal(token_ids=[[] for _ in range(B)])
        want = [min(batch.seqs[i].max_draft, self.num_speculative_tokens) for i in rows]
        if self.tree is not None:
            return self._propose_trees(B, rows, want, state)
        logits = self.heads.logits(state, max(want))  # [k, rows, vocab]
        sampler = DraftSampler([batch.seqs[i] for i in rows], want, self.generator, state.device)
        tokens = torch.stack([sampler(j, logits[j]) for j in range(len(logits))], dim=1)
        return Proposal(
            token_ids=split_drafts(tokens, rows, want, B),  # tokens: [rows, k]
            probs=sampler.probs(rows, B, self.ctx.vocab_size),
        )

    def _propose_trees(
        self, B: int, rows: list[int], want: list[int], state: torch.Tensor
    ) -> Proposal:
        """The tree of ``self.tree`` for each drafting sequence (``want``: its node budget):
        each depth's ranked tokens, the top ``width`` of its head, read back at once: from the
        graph of the rows' batch bucket where graphs are on, else eagerly."""
        n, ranked = len(rows), None
        if self.graphs.enabled and n <= BUCKETS[-1]:
            key, (buf,) = self._tree_inputs(bucket(n))
            buf[:n].copy_(state)  # rows n.. are padding: their results are not read
            ranked = self.graphs.replay(key, self._ranked)  # None: the capture failed
        if ranked is None:
            ranked = self._ranked(state)
        ranked = read_back(ranked[:n])  # [rows][depth][w]
        self.graphs.consumed()  # the replay has run: its outputs may be overwritten
        out: list = [[] for _ in range(B)]
        for r, i in enumerate(rows):
            out[i] = fill_static_tree(self.tree, ranked[r], want[r])
        return Proposal(token_ids=out)

    def _ranked(self, state: torch.Tensor) -> torch.Tensor:
        """state [rows, hidden] -> the top ``width`` tokens of head d at depth d + 1, [rows,
        depth, width] int64 (device-side work only: what the tree graphs capture)."""
        t = self.tree
        w = max(t.width(d) for d in range(1, t.depth + 1))
        return self.heads.logits(state, t.depth).topk(w, dim=-1).indices.transpose(0, 1)

    def _tree_inputs(self, Bp: int) -> tuple[tuple[str, int], tuple[torch.Tensor]]:
        """The key of the tree graph of batch bucket ``Bp`` and its static input: the states
        [Bp, hidden], zeros when made (the padding that start-up capture runs on)."""
        key = ("tree", Bp)
        ctx = self.ctx
        return key, self.graphs.buffers(
            key, lambda: (torch.zeros(Bp, self.hidden, dtype=ctx.dtype, device=ctx.device),)
        )

    @hookimpl
    @torch.inference_mode()
    def capture_graphs(self, max_num_seqs: int, progress: bool) -> int:
        """Tree mode on CUDA: capture the tree graph of every batch bucket up to
        ``max_num_seqs`` rows (at most 256) not captured yet, on zero states (the graphs write
        nothing outside their outputs). Returns how many were captured."""
        if self.tree is None or not self.graphs.enabled:
            return 0
        done = 0
        for Bp in (b for b in BUCKETS if b <= bucket(min(max_num_seqs, BUCKETS[-1]))):
            key, _ = self._tree_inputs(Bp)
            if key in self.graphs.graphs:
                continue
            if self.graphs.replay(key, self._ranked) is None:  # failed: graphs are off
                break
            done += 1
        return done


@hookimpl
def register_strategies(register) -> None:
    register(MedusaStrategy)
