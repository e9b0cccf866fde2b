"""What the speculative decoder (engine/spec_decode.py) uses of the engine that owns it: the
target model's forwards, the KV-cache slots of a sequence, and appending tokens. ``LLMEngine``
implements it; the decoder reads nothing else of the engine."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch

from speculant.engine.sequence import Sequence
from speculant.outputs import Logprob
from speculant.spec_types import StrategyContext


class DecodeStep(NamedTuple):
    """What :meth:`TargetEngine.decode` ran."""

    seqs: list[Sequence]  # the sequences it fed (those it was given, less any that finished)
    hidden: torch.Tensor | None  # [len(seqs), hidden]: the LM head's inputs; None if no seqs
    aux: torch.Tensor | None  # [len(seqs), n_aux * hidden], or None without aux layers
    starts: list[int]  # the position each sequence was fed at


class TargetEngine(Protocol):
    """The calls the speculative decoder makes to its engine."""

    def strategy_context(self) -> StrategyContext:
        """The target model, its config, device, dtype and the engine's limits, as a strategy
        gets them at construction; the decoder reads the same limits from it."""
        ...

    def take_back(self, seqs: list[Sequence]) -> list[Sequence]:
        """Append the tokens of an overlapped plain step still in flight, if any, so that every
        token is on the host. Returns ``seqs`` less those this finished."""
        ...

    def decode(
        self,
        seqs: list[Sequence],
        aux_layers: tuple[int, ...] = (),
        overlap: bool = True,
        on_append: Callable[[Sequence], None] | None = None,
    ) -> DecodeStep:
        """One plain decode step: feed each sequence's last token, sample one token each and
        append it (stop rules applied). With ``overlap`` and an engine that overlaps plain steps
        (engine/async_decode.py) the step is launched on the device and the tokens of the step
        before it are appended; the tokens of this one come at the next call (or
        :meth:`take_back`). ``on_append(seq)`` is called before each token is appended.
        Returns what it fed, with the hidden states of those rows (and the residual stream
        entering ``aux_layers``)."""
        ...

    def score(
        self,
        seqs: list[Sequence],
        new_tokens: list[list[int]],  # per sequence: its last token, then its drafts
        aux_layers: tuple[int, ...] = (),
        greedy: bool = False,
        keep_hidden: bool = True,
        trees: list[list[int] | None] | None = None,  # per sequence: a tree's parents, or None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """The target over ``new_tokens[i]`` at the next positions of ``seqs[i]`` (their K/V
        written to the cache): (hidden ``[T, hidden]``, aux ``[T, n_aux * hidden]`` or None,
        logits ``[T, vocab]`` float32, greedy pack ``[T, 2]`` float64 or None), ``T`` the total
        token count. The greedy pack comes when ``greedy`` is set or free (inside a CUDA graph);
        the tensors may be views of a graph's buffers, valid until the next forward.
        ``trees[i]`` (a tree step): ``new_tokens[i]`` is the root and the nodes of a tree with
        these parents, scored with tree attention (row ``r`` at position ``len - 1 +
        depth(r)``, K/V at the next slots in row order)."""
        ...

    def compact_tree(self, seqs: list[Sequence], ctx_starts: list[int],
                     paths: list[list[int]]) -> None:
        """After a tree step, copy the K/V of in-step rows ``paths[i]`` (the accepted nodes'
        rows, increasing, >= 1) of ``seqs[i]`` to positions ``ctx_starts[i] + 1, + 2, ...``
        (its root at ``ctx_starts[i]``), in every layer."""
        ...

    def reserve_slots(self, seq: Sequence, num_tokens: int) -> int:
        """Give positions ``[0, num_tokens)`` of ``seq`` KV-cache slots if enough blocks are
        free (else leave it as it is). Returns how many positions ``seq`` has slots for."""
        ...

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Keep the cache of positions ``[0, num_tokens)`` of ``seq`` only: free the slots past
        them (drafts that were rejected, slots reserved for drafts that did not come)."""
        ...

    def append_token(self, seq: Sequence, token: int, logprob: float | None = None,
                     top: dict[int, Logprob] | None = None) -> bool:
        """Append one generated token (with its log-probability and top-N dict) and apply the
        stop rules. Returns True if ``seq`` finished."""
        ...
