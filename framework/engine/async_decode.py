"""Overlapped (asynchronous) plain decode steps: launch step N+1 on the device-side tokens of step
N, then read step N's tokens back and append them while the GPU computes step N+1.

A synchronous step leaves the GPU idle while the host reads the tokens back, appends them, applies
the stop rules, schedules and stages the next step (~0.5 ms at batch 1 on an H100: 7% of a
Llama-3-8B step). Here the next step is queued before that host work starts, so the two overlap.
Outputs do not change: step N+1 is fed the very token step N chose, only read later. The costs:
a sequence that finishes at step N has had one more row computed at step N+1 (discarded, its K/V
write lands in blocks that are free by then and rewritten before any later use, as every later
write is queued behind it), and the tokens of a step reach the caller one step later.

Only steps whose sequences need nothing from the host between steps take this path
(:func:`host_free`): no logits processors, penalties or min_tokens (they read the previous tokens
on the host) and no top-N logprobs. Any other step, a speculative step, or a batch that changed
(sequences finished, joined or were preempted) first takes the step in flight back (``drain``)
and then proceeds as usual; the engine drains before a step that would admit new sequences or
preempt (``LLMEngine.step``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from speculant.engine.sampler import Row, sample_tokens_and_logprobs
from speculant.engine.sequence import Sequence
from speculant.sampling_params import SamplingParams


def host_free(p: SamplingParams) -> bool:
    """True if sampling a token for a request with these parameters needs no host state that the
    step in flight would change."""
    return not (p.logits_processors or p.has_penalties or p.min_tokens or p.logprobs is not None)


@dataclass
class _InFlight:
    seqs: list[Sequence]
    tokens: torch.Tensor  # [n] int64 on the device: the step's tokens, fed to the next step
    host: torch.Tensor  # [2, n] float64 (pinned on CUDA): tokens and their logprobs
    done: torch.cuda.Event | None  # the copy into ``host`` has finished (None on the CPU)
    on_append: Callable[[Sequence], None] | None  # called for each token appended


class AsyncDecoder:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.pending: _InFlight | None = None

    def eligible(self, seqs: list[Sequence]) -> bool:
        return all(host_free(s.params) for s in seqs)

    def step(
        self,
        seqs: list[Sequence],
        aux_layers: tuple[int, ...] = (),
        on_append: Callable[[Sequence], None] | None = None,
    ) -> tuple[list[Sequence], torch.Tensor | None, torch.Tensor | None, list[int]]:
        """Launch one plain decode step of ``seqs`` and append the tokens of the step before it.

        Returns (the sequences launched: ``seqs`` less those the append finished, hidden
        [n, hidden], aux [n, n_aux * hidden] or None, the position each row was fed at)."""
        prev, self.pending = self.pending, None
        chained = prev is not None and prev.seqs == seqs
        if prev is not None and not chained:
            self._append(prev)
            seqs = [s for s in seqs if not s.is_finished]
        if not seqs:
            return [], None, None, []
        eng = self.engine
        starts = [s.num_cached_tokens for s in seqs]
        if chained:  # the ids are on the device; [0] placeholders give the query lengths
            hidden, aux, logits = eng.runner.decode(seqs, [[0]] * len(seqs), aux_layers,
                                                    token_ids=prev.tokens)
        else:  # logits: [n, vocab] float32
            hidden, aux, logits = eng.runner.decode(seqs, [[s.last_token] for s in seqs],
                                                    aux_layers)
        # chained: the step in flight decided position len(s), this one decides the next
        rows = [Row(s, [], ahead=int(chained)) for s in seqs]
        tokens, lps = sample_tokens_and_logprobs(logits, rows, eng.generator,
                                                 eng.eos_token_id)  # [n] int64, [n] float32
        both = torch.stack([tokens.double(), lps.double()])  # [2, n]
        done = None
        if both.is_cuda:
            host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            host.copy_(both, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            host = both
        self.pending = _InFlight(seqs, tokens, host, done, on_append)
        if chained:
            self._append(prev)
        return seqs, hidden, aux, starts

    def drain(self) -> None:
        """Append the tokens of the step in flight, if any (waits for it)."""
        prev, self.pending = self.pending, None
        if prev is not None:
            self._append(prev)

    def _append(self, f: _InFlight) -> None:
        if f.done is not None:
            f.done.synchronize()
        tokens, logprobs = f.host.tolist()
        for s, t, lp in zip(f.seqs, tokens, logprobs):
            if s.is_finished:  # finished by the step before (or aborted): a discarded row
                continue
            if f.on_append is not None:
                f.on_append(s)
            self.engine.append_token(s, int(t), lp, None)
