"""The rows a head conditioned on the target's last hidden state drafts from
(:func:`last_hidden_rows`), draft sampling that keeps the draft distribution ``q`` the lossless
verifier needs (:class:`DraftSampler`), reading a call's drafts back to the host
(:func:`split_drafts`), and
the two public kernel launchers a draft head's step runs: :func:`linear` (the head product, the
one-row GEMV kernel on CUDA) and :func:`row_argmax` (the greedy token of each row). Both are
capturable in a CUDA graph and fall back to torch on the CPU."""

from __future__ import annotations

import itertools

import numpy as np
import torch
import torch.nn.functional as F

from speculant.drafting.graphs import GraphCache, to_device_async
from speculant.engine.sampler import PURPOSES, counter_uniforms, stream_seed
from speculant.engine.staging import read_back
from speculant.kernels.logprobs import row_argmax
from speculant.models.fused import linear
from speculant.spec_types import SpecBatch, SpecSequence


def last_hidden_rows(batch: SpecBatch) -> tuple[list[int], torch.Tensor | None]:
    """The sequences to draft for and the target state each drafts from, for a strategy with
    ``needs_hidden_states = True`` that conditions on one state per sequence (MLPSpeculator,
    Medusa): the hidden state of the position that produced the sequence's last token, the last
    of its ``batch.hidden_counts`` rows of ``batch.hidden_states``.

    Returns ``(rows, state)``: ``rows``, the batch indices of the sequences that may draft
    (``max_draft > 0``) and have hidden states this step, ascending; ``state`` [len(rows),
    hidden], row r the state of sequence ``rows[r]``; ``([], None)`` when no sequence drafts or
    the batch has no hidden states. ``rows`` is what :class:`DraftSampler` and
    :func:`split_drafts` take. Reads nothing from the device: one gather with an index copied
    asynchronously (:func:`~speculant.drafting.to_device_async`), or ``batch.hidden_states``
    itself when it already holds exactly one state per sequence, all drafting."""
    hs = batch.hidden_states  # [num_rows, hidden]
    rows = [
        i
        for i, (s, c) in enumerate(zip(batch.seqs, batch.hidden_counts))
        if c > 0 and s.max_draft > 0
    ]
    if hs is None or not rows:
        return [], None
    ends = list(itertools.accumulate(batch.hidden_counts))  # sequence i's rows end at ends[i]
    last = [ends[i] - 1 for i in rows]
    if last == list(range(hs.shape[0])):  # one state per sequence, all drafted: no gather
        return rows, hs
    return rows, hs[to_device_async(last, torch.long, hs.device)]  # [len(rows), hidden]


class DraftSampler:
    """Draft tokens of one propose call, chosen on the device: argmax for greedy requests, a
    sample of the request's sampling distribution (temperature / top-k / top-p / min-p applied
    to the draft logits) otherwise, with that distribution kept as q for the rejection sampler
    (a one-hot row for greedy rows). Nothing here reads the device.

    ``seqs``: the sequence of each row; ``steps[r]``: how many draft steps row r really uses
    (rows may run more steps than they use; those draw no random number). A seeded request's
    draft at position p is drawn with the counter-based number (seed, p, "draft")
    (``speculant.engine.sampler.uniforms``): the same draft whatever the batch, the step or a
    preemption; unseeded requests draw from ``generator``."""

    def __init__(
        self,
        seqs: list[SpecSequence],
        steps: list[int],
        generator: torch.Generator,
        device: torch.device,
    ) -> None:
        self.seqs = seqs
        self.steps = steps
        self.generator = generator
        self.device = device
        self.greedy = [s.sampling_params.is_greedy for s in seqs]
        self.all_greedy = all(self.greedy)
        self.qs: list[tuple[list[int], torch.Tensor]] = []  # per step: (rows, q [n, vocab])
        self.params = None
        if not self.all_greedy:
            from speculant.engine.sampler import Row, sampling_tensors

            self.params = sampling_tensors([Row(s, []) for s in seqs], device)
            self.g = to_device_async(self.greedy, torch.bool, device)  # [rows]

    def __call__(self, j: int, logits: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        """Step j: logits [n, vocab] float32 over the TARGET vocabulary of ``rows`` (positions
        in ``seqs``; None: all rows, n = len(seqs)) -> tokens [n] int64 on the device."""
        argmax = row_argmax(logits)  # [n]
        if self.all_greedy:
            return argmax
        from speculant.kernels.rejection_sampling import sample_from_probs
        from speculant.kernels.sampling import sampling_probs

        sub = range(len(self.seqs)) if rows is None else rows
        params, g = self.params, self.g
        if rows is not None:
            idx = to_device_async(rows, torch.long, self.device)
            params, g = tuple(t[idx] for t in params), g[idx]
        probs = sampling_probs(logits.float(), *params).contiguous()  # [n, vocab]
        u = torch.full((len(sub),), 0.5)  # rows that draw nothing keep 0.5 (not used)
        keyed: list[tuple[int, int, int]] = []  # (index in sub, seed, position of the draft)
        for i, r in enumerate(sub):
            if self.greedy[r] or j >= self.steps[r]:
                continue
            seed = stream_seed(self.seqs[r])
            if seed is None:  # unseeded (or a plain torch.Generator): a stateful draw
                u[i] = torch.rand(1, generator=self.seqs[r].generator or self.generator)[0]
            else:
                keyed.append((i, seed, len(self.seqs[r].token_ids) + j))
        if keyed:  # the draft at position p: the same number in any batch, step or preemption
            at, seeds, pos = zip(*keyed)
            u[list(at)] = counter_uniforms(np.array(seeds, dtype=np.uint64),
                                            np.array(pos, dtype=np.uint64), PURPOSES["draft"])
        u_dev = to_device_async(u, torch.float32, self.device)  # [n]
        tokens = torch.where(g, argmax, sample_from_probs(probs, u_dev))
        if any(self.greedy[r] for r in sub):
            onehot = F.one_hot(argmax, probs.shape[1]).to(probs.dtype)
            probs = torch.where(g[:, None], onehot, probs)
        self.qs.append((list(sub), probs))
        return tokens

    def probs(self, batch_rows: list[int], batch: int, vocab: int) -> torch.Tensor | None:
        """[batch, steps, vocab] float32 q of every step (None when every row is greedy);
        ``batch_rows[r]``: the batch index of row r."""
        if self.all_greedy or not self.qs:
            return None
        out = torch.zeros(batch, len(self.qs), vocab, dtype=torch.float32, device=self.device)
        for j, (sub, q) in enumerate(self.qs):
            idx = to_device_async([batch_rows[r] for r in sub], torch.long, self.device)
            out[idx, j] = q.float()
        return out


def split_drafts(
    tokens: torch.Tensor,
    rows: list[int],
    steps: list[int],
    batch: int,
    graphs: GraphCache | None = None,
) -> list[list[int]]:
    """tokens [rows, max_steps] on the device -> per batch index the first ``steps[r]`` tokens of
    its row (one device read for the whole call). ``graphs``: the strategy's graph cache, told
    that its last replay has run (its pinned inputs may be rewritten)."""
    drafts: list[list[int]] = [[] for _ in range(batch)]
    # read_back: waits by polling, not in the driver's blocking copy (the host work right after a
    # blocking wait of milliseconds runs slower; engine/staging.py)
    for r, toks in enumerate(read_back(tokens)):
        drafts[rows[r]] = toks[: steps[r]]
    if graphs is not None:
        graphs.consumed()
    return drafts


__all__ = [
    "DraftSampler",
    "last_hidden_rows",
    "linear",
    "row_argmax",
    "split_drafts",
]
