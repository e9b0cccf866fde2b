"""Draft-model speculation: a smaller causal LM with the target's vocabulary proposes ``k`` tokens
per step, and the target verifies them in one forward pass.

The draft is one of speculant's own causal LMs (``load_draft_model``) driven by a
:class:`~speculant.drafting.DraftRunner`, which owns its paged KV cache and keeps it in step with
the target: each ``propose`` rolls the draft cache back to the prefix it shares with the sequence,
feeds what it misses in one catch-up forward (which also yields the first draft) and runs
``k - 1`` batched one-token steps; on CUDA a greedy propose is one CUDA graph replay instead.
This file chooses the tokens (``draft_greedy``, ``draft_logits`` and a ``DraftSampler``).

With the option ``token_map`` (a file of hot token ids, ``speculant.drafting.load_token_map``) the draft's LM head
runs over a copy of its hot rows only, in the eager path and in the one-graph greedy propose alike:
greedy drafts are the argmax over the hot logits mapped through the hot ids (``draft_greedy``),
sampled drafts come from full-vocabulary rows with -inf outside the hot ids (``draft_logits``).

Greedy requests draft with the argmax. Sampling requests draft from the draft model's
distribution after the request's temperature / top-k / top-p / min-p (drawn with the request's
seeded generator when it has one) and return those probabilities as ``Proposal.probs``, so the
rejection sampler accepts with ``min(1, p/q)`` using the real ``q``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from speculant import hookimpl
from speculant.drafting import (
    DraftRunner,
    DraftSampler,
    HotHead,
    StrategyError,
    TokenMapError,
    load_draft_config,
    load_draft_model,
    load_draft_tokenizer,
    load_token_map,
    resolve_draft_folder,
    row_argmax,
)
from speculant.hookspecs import Strategy
from speculant.spec_types import Proposal, SpecBatch, StrategyContext

logger = logging.getLogger("speculant")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


class DraftModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field(..., description="draft checkpoint: HF folder, .gguf file or hub id")
    num_speculative_tokens: int = Field(..., ge=1, le=64)
    dtype: str | None = Field(None, description="draft dtype; default: the target's")
    kv_cache_memory: int | None = Field(
        None,
        ge=1 << 16,
        description="bytes for the draft's own KV cache; default: enough for "
        "max_num_seqs sequences of max_model_len (capped at 1 GiB on CPU, half the free memory "
        "on CUDA)",
    )
    token_map: str | None = Field(
        None,
        description="file of hot token ids (.pt, .json, .npy or .txt; plugins/token_map.py): "
        "the draft's LM head runs over those rows only (FR-Spec)",
    )

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str | None) -> str | None:
        if v is None:
            return None
        v = str(v).replace("torch.", "")
        if v != "auto" and v not in _DTYPES:
            raise ValueError(f"unknown dtype {v!r}; use auto, float32, float16 or bfloat16")
        return v


def _source(cfg) -> str:
    name = getattr(cfg, "_name_or_path", None) or getattr(cfg, "name_or_path", None)
    return str(Path(name) / "config.json") if name else "the target model"


class DraftModelStrategy(Strategy):
    name = "draft_model"
    default_for_model = True  # a bare ``model`` in speculative_config means a draft model

    Config = DraftModelConfig

    def __init__(self, config: DraftModelConfig, ctx: StrategyContext) -> None:
        super().__init__(config, ctx)
        self.num_speculative_tokens = config.num_speculative_tokens
        self.device = ctx.device
        self.dtype = ctx.dtype if config.dtype in (None, "auto") else _DTYPES[config.dtype]
        folder = resolve_draft_folder(config.model)
        self.folder = folder
        hf = load_draft_config(folder)
        self.hf_config = hf
        target_src = _source(ctx.target_config)
        draft_src = str(folder / "config.json")
        dv = getattr(hf, "vocab_size", None)
        if dv is not None and int(dv) != ctx.vocab_size:
            raise ValueError(self._vocab_msg(draft_src, int(dv), target_src, ctx.vocab_size))
        if ctx.tokenizer is not None:
            tok = load_draft_tokenizer(folder)
            if tok is not None:
                self._check_tokenizers(tok, ctx.tokenizer, folder, target_src)

        hot_ids = None
        if config.token_map:  # read before the (large) draft weights: a bad file fails fast
            try:
                hot_ids = load_token_map(config.token_map, ctx.vocab_size)
            except TokenMapError as e:
                raise StrategyError(str(e)) from None

        max_len = self._draft_max_len(hf)
        self.model = load_draft_model(folder, hf, self.dtype, self.device, max_len)
        rows = self.model.lm_head.weight.shape[0]
        if rows != ctx.vocab_size:
            raise ValueError(
                self._vocab_msg(draft_src + " (LM head)", rows, target_src, ctx.vocab_size)
            )
        # the hot rows of the draft's LM head (a copy [N, H], also when tied to the embedding)
        self.hot: HotHead | None = None
        if hot_ids is not None:
            self.hot = HotHead(
                self.model.lm_head.weight, hot_ids, ctx.vocab_size, like=self.model.lm_head
            )
        # the draft's KV cache, per-sequence state and graphs; its one-graph greedy propose
        # runs draft_greedy (a token map's hot rows), looked up at each use
        self.runner = DraftRunner(
            self.model,
            ctx,
            dtype=self.dtype,
            max_len=max_len,
            num_speculative_tokens=self.num_speculative_tokens,
            kv_cache_memory=config.kv_cache_memory,
            greedy=lambda hidden: self.draft_greedy(hidden),
        )
        self.graphs = self.runner.graphs  # the graph cache of its one-graph proposes
        self.generator = torch.Generator().manual_seed(ctx.seed + 104729)
        logger.info(
            "draft model %s (%s, %d layers) on %s: %d KV blocks of %d",
            folder,
            getattr(hf, "model_type", "?"),
            self.model.num_layers,
            self.device,
            self.runner.num_blocks,
            ctx.block_size,
        )

    # ----------------------------------------------------------------- set-up
    @staticmethod
    def _vocab_msg(draft_src: str, dv: int, target_src: str, tv: int) -> str:
        return (
            f"draft model {draft_src} has vocab_size={dv} but the target model {target_src} has "
            f"vocab_size={tv}; a draft model must share the target's vocabulary (the same "
            "tokenizer), pick a draft from the same model family"
        )

    @staticmethod
    def _check_tokenizers(draft_tok, target_tok, folder: Path, target_src: str) -> None:
        dvocab, tvocab = draft_tok.get_vocab(), target_tok.get_vocab()
        if dvocab == tvocab:
            return
        diff = [t for t in dvocab.keys() | tvocab.keys() if dvocab.get(t) != tvocab.get(t)]
        example = sorted(diff)[:3]
        raise ValueError(
            f"draft model {folder} has a different tokenizer vocabulary from the target model "
            f"{target_src}: {len(dvocab)} vs {len(tvocab)} entries, {len(diff)} token(s) differ "
            f"(e.g. {example}); a draft model must share the target's vocabulary"
        )

    def _draft_max_len(self, hf) -> int:
        limit = self.ctx.max_model_len
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
            if getattr(hf, key, None):
                limit = min(limit, int(getattr(hf, key)))
                break
        window = getattr(hf, "sliding_window", None)
        if window and getattr(hf, "use_sliding_window", True) is not False:
            limit = min(limit, int(window))
        return limit

    # ----------------------------------------------------------------- hooks
    @hookimpl
    @torch.inference_mode()
    def propose(self, batch: SpecBatch) -> Proposal:
        seqs = batch.seqs
        draft = self.runner.prepare(seqs)  # rolled back, blocks reserved, catch-ups
        if not draft.rows:
            return Proposal(token_ids=[[] for _ in seqs])
        if all(seqs[i].sampling_params.is_greedy for i in draft.rows):
            drafts = self.runner.propose_greedy(draft)  # one CUDA graph; None: off or no fit
            if drafts is not None:
                return Proposal(token_ids=drafts)
        sampler = DraftSampler([seqs[i] for i in draft.rows], draft.ks, self.generator, self.device)

        def choose(hidden: torch.Tensor, rows: list[int], step: int) -> torch.Tensor:
            """One draft token per row of ``hidden`` [len(rows), hidden]: the argmax for greedy
            requests, a sample of the processed draft distribution for the others (its q kept
            by the sampler). Returns [len(rows)] int64 on the device."""
            if sampler.all_greedy:  # no q to keep: the argmax, without full-vocabulary rows
                return self.draft_greedy(hidden)
            logits = self.draft_logits(hidden)  # [len(rows), vocab] float32
            return sampler(step, logits, None if len(rows) == len(sampler.seqs) else rows)

        drafts = self.runner.propose(draft, choose)
        probs = sampler.probs(draft.rows, len(seqs), self.ctx.vocab_size)
        return Proposal(token_ids=drafts, probs=probs)

    @hookimpl
    def on_requests_finished(self, seq_ids: list[int]) -> None:
        self.runner.free(seq_ids)

    @hookimpl
    def capture_graphs(self, max_num_seqs: int, progress: bool) -> int:
        """The draft runner's graphs: its forwards and the one-graph greedy proposes."""
        return self.runner.capture_graphs(max_num_seqs, progress)

    # ----------------------------------------------------------------- the LM head
    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The draft's logits [rows, vocab] float32 of final hidden states [rows, hidden]: the
        full LM head, or with a token map its hot rows only (-inf elsewhere). For the draft
        probabilities of sampled requests; greedy drafting uses ``draft_greedy``."""
        if self.hot is not None:
            return self.hot(hidden)
        return self.model.compute_logits(hidden)

    def draft_greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """The greedy draft tokens [rows] int64 of final hidden states [rows, hidden]:
        ``row_argmax(draft_logits(hidden))``, with a token map taken over the N hot logits and
        mapped through the hot ids (``HotHead.greedy``: no [rows, vocab] row). The eager path
        and the one-graph greedy propose both call this; nothing here reads the device, so it
        can be captured in a CUDA graph."""
        if self.hot is not None:
            return self.hot.greedy(hidden)  # [rows, N] -> [rows]
        return row_argmax(self.model.compute_logits(hidden))  # [rows, vocab] -> [rows]


@hookimpl
def register_strategies(register) -> None:
    register(DraftModelStrategy)
