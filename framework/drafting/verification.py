"""Building blocks of a verifier: a strategy class with ``kind = "verifier"`` that implements the
``verify`` hook (docs/hooks.md). The built-in lossless ``rejection_sampler`` plugin is written
on these names alone.

A verifier sees ``ScoreResult.logits`` ``[sum(k_i + 1), vocab]``: per sequence, one row per draft
position then the bonus row (:func:`verify_rows` names them). The request's sampling parameters
turn each row into the distribution the request samples from (:func:`target_distribution`);
:func:`rejection_sample` (the kernel launcher of ``speculant.kernels.rejection_sampling``)
accepts or rejects every draft on the device, from per-request random numbers
(:func:`uniforms`); :func:`sample_from_probs` draws one token per row by inverse CDF;
:func:`token_logprobs` (``speculant.kernels.logprobs``) gives the target
log-probability of each emitted token; :func:`read_back` brings the result to the host in one
read. Host-made inputs go to the device through :func:`to_device`, which does not synchronise
the stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speculant.engine import sampler
from speculant.engine.staging import read_back, to_device
from speculant.kernels.logprobs import token_logprobs
from speculant.kernels.rejection_sampling import rejection_sample, sample_from_probs
from speculant.sampling_params import SamplingParams
from speculant.spec_types import DraftTree, SpecSequence


@dataclass
class Row:
    """One row of ``ScoreResult.logits``: the sequence it belongs to, and the drafts before it in
    the verification window (for penalties and ``min_tokens`` they count as generated tokens)."""

    seq: SpecSequence
    extra: list[int]


def verify_rows(seqs: list[SpecSequence], drafts: list[list[int] | DraftTree]) -> list[Row]:
    """The rows of a verification step in ``ScoreResult.logits`` order: for sequence ``i``,
    ``len(drafts[i]) + 1`` rows, row ``j`` predicting the token after ``drafts[i][:j]``; for a
    :class:`DraftTree` of ``n`` nodes, ``n + 1`` rows: row 0 after the root, row ``i + 1``
    after node ``i`` (the tokens of its root path are its ``extra``).

    :param seqs: the batch's sequences (``SpecBatch.seqs``).
    :param drafts: each sequence's draft tokens or tree (``Proposal.token_ids``).
    :return: ``sum(k_i + 1)`` rows.
    """
    rows: list[Row] = []
    for seq, d in zip(seqs, drafts):
        if isinstance(d, DraftTree):
            rows.append(Row(seq, []))
            rows.extend(Row(seq, [d.token_ids[j] for j in d.path(i)]) for i in range(d.num_nodes))
        else:
            rows.extend(Row(seq, d[:j]) for j in range(len(d) + 1))
    return rows


def needs_processing(params: SamplingParams) -> bool:
    """Whether a request's logits processors, penalties or ``min_tokens`` may change its logits.
    A greedy request without them takes the argmax of the raw logits (``ScoreResult.greedy``)."""
    return sampler.params_need_processing(params)


def target_distribution(
    logits: torch.Tensor,  # [rows, vocab] float32: ScoreResult.logits
    rows: list[Row],
    eos_token_id: int | None,
) -> torch.Tensor:  # [rows, vocab] float32
    """What each row's request samples from, in the form :func:`rejection_sample` takes.

    First the request's logits processors, repetition / presence / frequency penalties and the
    ``min_tokens`` EOS mask (vLLM semantics; the drafts before a row count as generated). Then,
    for a greedy request, those processed logits (their argmax is its choice); for the others,
    the probabilities after temperature, top-k, top-p and min-p.

    :param logits: the target's raw logits, one row per entry of ``rows``.
    :param rows: :func:`verify_rows` of the batch.
    :param eos_token_id: the target's EOS token (``StrategyContext.eos_token_id``), masked
        while a request has fewer than ``min_tokens`` output tokens.
    :return: a new tensor (or ``logits`` itself when no row needs processing and every request
        is greedy).
    """
    processed = sampler.process_logits(logits, rows, eos_token_id)  # [rows, vocab]
    greedy = [r.seq.params.is_greedy for r in rows]
    if all(greedy):
        return processed
    probs = sampler.target_probs(processed, rows)  # [rows, vocab]
    greedy_row = to_device(greedy, torch.bool, logits.device)  # [rows]
    return torch.where(greedy_row[:, None], processed, probs)


def uniforms(
    seqs: list[SpecSequence],
    counts: list[int],
    generator: torch.Generator,
    device: torch.device,
    *,
    purpose: str | None = None,
    starts: list[int] | None = None,
) -> torch.Tensor:  # [sum(counts)] float32
    """``counts[i]`` uniform numbers in [0, 1) for sequence ``i``, made on the host.

    With ``purpose`` (``"sample"``: the token at a position drawn from the target; ``"accept"``:
    the accept test of a draft; ``"draft"``: a sampled draft; ``"residual"``: the recovery /
    bonus token of a step), a seeded request's j-th number is a counter-based function of
    (its seed, position ``starts[i] + j``, purpose); ``starts[i]`` defaults to the sequence's
    length (the position of its next token). It depends on nothing else: not on preemption, the
    batch, or how many drafts fit, so a seeded request's output is reproducible. Draw each
    (position, purpose) at most once per verification: a number reused for two decisions makes
    them dependent. Without ``purpose``: the next numbers of the request's seeded generator
    (``SpecSequence.generator``), reproducible only while the draws per step are. Unseeded
    requests draw from ``generator`` either way.

    :return: the numbers on ``device``, sequence after sequence.
    """
    return sampler.uniforms(seqs, counts, generator, device, purpose=purpose, starts=starts)


__all__ = [
    "Row",
    "needs_processing",
    "read_back",
    "rejection_sample",
    "sample_from_probs",
    "target_distribution",
    "to_device",
    "token_logprobs",
    "uniforms",
    "verify_rows",
]
