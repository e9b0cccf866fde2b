"""Prompt lookup: the tokens that followed an earlier occurrence of a sequence's last n tokens.

What the ``ngram`` strategy proposes, and what a :class:`~speculant.drafting.HeadStrategy`
proposes instead of its head's drafts when its options set ``prompt_lookup_min`` (a learned
head is weakest exactly where a reply copies its prompt: a name, a quoted sentence, a code line).

:class:`NgramIndex` is the per-sequence index (a few dictionary probes per lookup whatever the
sequence length); :func:`find_draft` rescans the whole history and is the reference the index
is tested against.
"""

from __future__ import annotations

import torch


def find_draft(tokens: torch.Tensor, n_min: int, n_max: int, k: int) -> list[int]:
    """tokens: [L] int64. Longest n in [n_min, n_max] whose suffix n-gram occurs earlier; the up
    to ``k`` tokens after its most recent earlier occurrence."""
    L = tokens.shape[0]
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        windows = tokens[: L - 1].unfold(
            0, n, 1
        )  # [L - n, n]: n-grams that end before the last token
        hits = (windows == tokens[L - n :]).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n  # token after the most recent match
            return tokens[start : start + k].tolist()
    return []


class NgramIndex:
    """Incremental prompt-lookup index of one sequence: the same answers as :func:`find_draft`.

    ``last[n][ngram]`` is the position right after the most recent occurrence of ``ngram`` (a
    tuple of n tokens) among the windows that end before the sequence's last token. Appending
    tokens indexes the new windows only (O(new tokens x number of n) dictionary writes)."""

    def __init__(self, n_min: int, n_max: int, keep_all: bool = False) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.keep_all = keep_all
        self.last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        # keep_all (tree mode): every occurrence's end, oldest first
        self.all: dict[int, dict[tuple[int, ...], list[int]]] = {
            n: {} for n in range(n_min, n_max + 1)}
        self.tokens: list[int] = []  # the tokens indexed so far (a copy: never aliased)
        self.indexed_end = 0  # windows ending at positions < indexed_end are in ``last``

    def update(self, tokens: list[int]) -> None:
        """Index ``tokens`` (the sequence so far; it extends what was seen before)."""
        n0 = len(self.tokens)
        if len(tokens) < n0 or (n0 and tokens[n0 - 1] != self.tokens[-1]):
            self.__init__(self.n_min, self.n_max, self.keep_all)  # not an extension: start over
        self.tokens.extend(tokens[len(self.tokens) :])
        t = self.tokens
        for e in range(max(self.indexed_end, 1), len(t)):  # windows t[e - n : e], e < len(t)
            for n, table in self.last.items():
                if e >= n:
                    key = tuple(t[e - n : e])
                    table[key] = e
                    if self.keep_all:
                        self.all[n].setdefault(key, []).append(e)
        self.indexed_end = max(self.indexed_end, len(t))

    def find(self, k: int) -> list[int]:
        """Up to ``k`` tokens after the most recent earlier occurrence of the longest suffix
        n-gram (the windows searched end before the last token, as in :func:`find_draft`)."""
        t = self.tokens
        L = len(t)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            e = self.last[n].get(tuple(t[L - n :]))
            # windows ending at L - 1 or earlier only: the suffix itself ends at L
            if e is not None and e <= L - 1:
                return t[e : e + k]
        return []

    def find_branches(self, k: int, branches: int) -> list[list[int]]:
        """Up to ``branches`` continuations of up to ``k`` tokens each, after earlier
        occurrences of the sequence's suffix n-grams (longest n first, most recent first), each
        with a different first token; the first is :meth:`find`'s (needs ``keep_all``)."""
        t = self.tokens
        L = len(t)
        out: list[list[int]] = []
        firsts: set[int] = set()
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            for e in reversed(self.all[n].get(tuple(t[L - n :]), ())):
                if e > L - 1 or t[e] in firsts:
                    continue
                firsts.add(t[e])
                out.append(t[e : e + k])
                if len(out) == branches:
                    return out
        return out


def check_lookup_range(n_min: int | None, n_max: int) -> None:
    """The options' check (``ngram``'s and :class:`~speculant.drafting.HeadOptions`'):
    ``ValueError`` naming the fix when ``prompt_lookup_min`` > ``prompt_lookup_max``."""
    if n_min is not None and n_min > n_max:
        raise ValueError(
            f"prompt_lookup_min ({n_min}) must be <= prompt_lookup_max ({n_max}); raise "
            f"prompt_lookup_max or lower prompt_lookup_min"
        )


__all__ = ["NgramIndex", "check_lookup_range", "find_draft"]
