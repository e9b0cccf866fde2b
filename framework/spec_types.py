"""Typed data passed through the speculation hooks (see :mod:`speculant.hookspecs`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


class StrategyError(ValueError):
    """A strategy cannot be built or used as configured: an unknown method, invalid options, a
    checkpoint that does not fit the target. The message names the problem and the fix; the
    engine shows it to the user as is."""


@dataclass
class StrategyContext:
    """What a strategy gets when it is instantiated: ``cls(config, ctx)``, where ``config`` is
    the validated instance of the class's ``Config`` (None when it has none, and always None for
    a verifier) and ``ctx`` this."""

    target_model: Any  # the target nn.Module (speculant.models.*): embed(), compute_logits(), config
    target_config: Any  # the target's transformers PretrainedConfig
    vocab_size: int  # target vocabulary size (rows of the LM head)
    device: torch.device
    dtype: torch.dtype
    block_size: int  # paged KV cache block size used by the engine
    max_model_len: int
    max_num_seqs: int
    kv_cache_memory: int | None = None  # bytes a strategy may use for its own caches (None: decide)
    tokenizer: Any = None
    eos_token_id: int | None = None
    seed: int = 0
    # the target's prefill CUDA-graph limit in tokens (0: prefill runs eagerly; None: the default)
    max_prefill_graph_tokens: int | None = None
    # EngineConfig.enforce_eager: no CUDA graphs for the strategy's own forwards either
    enforce_eager: bool = False


@dataclass
class SpecSequence:
    """One running sequence, as a proposer sees it. Treat every field as read-only."""

    seq_id: int  # stable for the sequence's life (preemption included): key per-sequence state
    token_ids: list[int]  # prompt + generated tokens so far (the last one has no KV yet)
    num_prompt_tokens: int
    max_draft: int  # propose at most this many tokens for this sequence now (<= k, may be 0)
    sampling_params: Any  # speculant.SamplingParams
    generator: torch.Generator | None = None  # the request's seeded RNG (None: the engine's)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def params(self) -> Any:
        return self.sampling_params

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass
class SpecBatch:
    """The sequences of one speculative decode step."""

    seqs: list[SpecSequence]
    # Target hidden states of the positions verified since the previous propose call (the whole
    # prompt on the first call), only when the strategy declares ``needs_hidden_states = True``.
    # A row is the input of the target's LM head: the last decoder layer's output AFTER the final
    # norm (Llama family: ``model.norm``; OPT: after ``final_layer_norm`` and ``project_out``
    # where the checkpoint has them), in the engine's dtype, so
    # ``ctx.target_model.compute_logits(row)`` gives that position's target logits back.
    # Rows of sequence i cover positions [hidden_start[i], num_tokens_i - 1): the state at position
    # p is the one that produced token p + 1.
    hidden_states: torch.Tensor | None = None  # [num_rows, hidden]
    # the same rows' inputs of the layers in the strategy's ``aux_hidden_layers`` (the residual
    # stream entering each layer, before its norm), concatenated in layer order (EAGLE-3)
    aux_hidden_states: torch.Tensor | None = None  # [num_rows, len(aux_layers) * hidden]
    hidden_counts: list[int] = field(default_factory=list)  # rows per sequence
    hidden_start: list[int] = field(default_factory=list)  # first position covered, per sequence

    def __len__(self) -> int:
        return len(self.seqs)


@dataclass
class Proposal:
    """Draft tokens for each sequence of a :class:`SpecBatch`, in the same order."""

    token_ids: list[list[int]]  # per sequence, 0..max_draft draft token ids
    # q(x) for every draft position: [batch, max_len, vocab] float32 (rows past a sequence's own
    # length are ignored). None means point-mass drafts (q = 1 for the proposed token).
    probs: torch.Tensor | None = None
    proposer: str = ""  # filled in by the engine: the strategy's name (for error messages)

    @property
    def lengths(self) -> list[int]:
        return [len(t) for t in self.token_ids]


@dataclass
class ScoreResult:
    """Target model output over each sequence's last token plus its drafts.

    The built-in scorer's tensors may be views of a CUDA graph's static buffers: read them
    during the step (``verify``), clone what you keep beyond it."""

    logits: torch.Tensor  # [sum(k_i + 1), vocab] float32
    hidden_states: torch.Tensor | None = None  # [sum(k_i + 1), hidden]
    aux_hidden_states: torch.Tensor | None = None  # [sum(k_i + 1), n_aux * hidden]
    # optional, same device: each row's argmax of ``logits`` (lowest index on ties) and its
    # log-probability (log_softmax of the raw logits), packed for one read (float64 holds every
    # token id exactly; speculant.engine.sampler.greedy_pack). The built-in scorer computes it
    # inside its CUDA graph, or when every sequence is greedy; the built-in verifier then
    # verifies greedy batches from it on the host, with no kernel launch.
    greedy: torch.Tensor | None = None  # [sum(k_i + 1), 2] float64


@dataclass
class VerifyResult:
    """Tokens to append per sequence: accepted drafts, then one bonus or recovered token."""

    token_ids: list[list[int]]
    num_accepted: list[int]  # accepted draft tokens per sequence (len(token_ids[i]) - 1)
    # optional: the target's log-probability (log_softmax of the raw score logits) of each token
    # in token_ids, same shape; when None the engine computes them (one batched gather)
    logprobs: list[list[float]] | None = None
