"""The default verifier: lossless rejection sampling (Leviathan et al. 2211.17192, Chen et al.
2302.01318), shared by every strategy.

Greedy rows accept drafts while they equal the argmax of the processed target logits; random rows
accept draft x with probability min(1, p(x) / q(x)) and on rejection sample from
normalize(max(p - q, 0)), so the output follows the target distribution exactly. ``p`` is the
target distribution after the request's logits processors, penalties, temperature, top-k, top-p
and min-p; penalties at draft position j count the drafts before j as generated tokens.

Random rows with point-mass drafts (no ``Proposal.probs``: n-gram) sample every position from
``p`` with the number a plain step there would use and accept drafts while they equal it: the
same acceptance probability p(x), and a seeded request's output is its plain output. A seeded
request's numbers are keyed by (seed, position, purpose) (``uniforms``), so its output does not
depend on the batch, preemption or how many drafts fit (docs/architecture.md, Seeded requests).

A batch of greedy requests without logits processing, scored with ``ScoreResult.greedy`` (each
row's argmax and its log-probability; the built-in scorer computes it inside its CUDA graph),
is verified on the host from that one read: the same rule, no kernel launch.

Token trees (``DraftTree`` entries of the proposal, docs/trees.md) are verified per sequence
with ``verify_tree_greedy`` (greedy requests) and, for sampled requests, in the same two ways as
chains: point-mass trees (``probs=None``) sample each visited row with the number a plain step at
its position would use and follow the child holding that token (so a seeded request's output is
its plain output, as with point-mass chains); trees with draft distributions use
``verify_tree_sampled``, node ``c``'s accept test keyed by (seed, its position, "accept") plus
its rank among its siblings, the last draw by (seed, step start, "residual"), or, when the path
ends at a leaf, by the plain sample of the bonus position. The chains of a mixed batch are
verified as above, bit for bit as without the trees.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from speculant import hookimpl
from speculant.drafting import (
    needs_processing,
    read_back,
    rejection_sample,
    sample_from_probs,
    target_distribution,
    to_device,
    token_logprobs,
    uniforms,
    verify_rows,
    verify_tree_greedy,
    verify_tree_sampled,
)
from speculant.hookspecs import Strategy
from speculant.spec_types import (
    DraftTree,
    Proposal,
    ScoreResult,
    SpecBatch,
    SpecSequence,
    StrategyContext,
    VerifyResult,
)

# sibling ranks shift a node's accept-test key by this much (positions stay far below it), so
# that siblings, which share a position, draw independent numbers; rank 0 is a chain's key
_SIBLING_KEY = 1 << 40


class RejectionSampler(Strategy):
    name = "rejection_sampler"
    kind = "verifier"
    lossless = True  # greedy: draft == argmax; sampled: exact rejection sampling

    def __init__(self, config: None, ctx: StrategyContext) -> None:
        super().__init__(config, ctx)
        self.engine_gen = torch.Generator().manual_seed(ctx.seed + 7919)

    @hookimpl(trylast=True)
    def verify(self, batch: SpecBatch, proposal: Proposal, scores: ScoreResult) -> VerifyResult:
        if proposal.has_trees:
            return self._verify_mixed(batch.seqs, proposal, scores)
        return self._verify_chains(batch.seqs, proposal, scores.logits, scores.greedy)

    def _verify_mixed(self, seqs: list[SpecSequence], proposal: Proposal,
                      scores: ScoreResult) -> VerifyResult:
        """A batch with trees: its chains verified together as a chain batch, each tree alone;
        a greedy batch without processing from ``scores.greedy`` in one read."""
        lengths = proposal.lengths
        if scores.logits.shape[0] != sum(n + 1 for n in lengths):
            raise ValueError(
                f"ScoreResult.logits must have sum(k_i + 1) = {sum(n + 1 for n in lengths)} "
                f"rows for proposal lengths {lengths}, got {scores.logits.shape[0]}")
        if scores.greedy is not None and all(
            s.params.is_greedy and not needs_processing(s.params) for s in seqs
        ):
            return verify_greedy_trees(proposal.token_ids, scores.greedy)
        starts = _starts(lengths)
        device = scores.logits.device
        B = len(seqs)
        tokens: list[list[int]] = [[] for _ in range(B)]
        accepted = [0] * B
        logprobs: list[list[float]] = [[] for _ in range(B)]
        chains = [i for i, d in enumerate(proposal.token_ids) if not isinstance(d, DraftTree)]
        if chains:
            sel = to_device([starts[i] + j for i in chains for j in range(lengths[i] + 1)],
                            torch.long, device)
            probs = proposal.probs
            if probs is not None:
                probs = probs[to_device(chains, torch.long, probs.device)]
            sub = Proposal([proposal.token_ids[i] for i in chains], probs, proposal.proposer)
            res = self._verify_chains([seqs[i] for i in chains], sub, scores.logits[sel],
                                      scores.greedy[sel] if scores.greedy is not None else None)
            for j, i in enumerate(chains):
                tokens[i], accepted[i] = res.token_ids[j], res.num_accepted[j]
                logprobs[i] = res.logprobs[j]
        trees = [i for i, d in enumerate(proposal.token_ids) if isinstance(d, DraftTree)]
        paths = self._verify_trees([seqs[i] for i in trees],
                                   [proposal.token_ids[i] for i in trees],
                                   [scores.logits[starts[i] : starts[i] + lengths[i] + 1]
                                    for i in trees])
        lp_rows, lp_ids = [], []
        tree_paths: list[list[int] | None] = [None] * B
        for i, (path, toks) in zip(trees, paths):
            tokens[i], accepted[i], tree_paths[i] = toks, len(path), list(path)
            lp_rows += [starts[i], *(starts[i] + c + 1 for c in path)]
            lp_ids += toks
        if lp_rows:  # the target's log-probability (raw logits) of each tree token: one read
            lp = read_back(token_logprobs(
                scores.logits.float().contiguous(), to_device(lp_ids, torch.long, device),
                to_device(lp_rows, torch.long, device))[1])
            pos = 0
            for i in trees:
                logprobs[i] = lp[pos : pos + len(tokens[i])]
                pos += len(tokens[i])
        return VerifyResult(token_ids=tokens, num_accepted=accepted, logprobs=logprobs,
                            tree_paths=tree_paths)

    def _verify_trees(self, seqs: list[SpecSequence], trees: list[DraftTree],
                      logits: list[torch.Tensor]) -> list[tuple[list[int], list[int]]]:
        """Tree sequences (module doc), ``logits[i]`` ``[n_i + 1, vocab]`` each: their accepted
        paths and tokens. The rows that need processing are processed in one call, the
        point-mass trees' rows sampled in one call."""
        out: list[tuple[list[int], list[int]] | None] = [None] * len(seqs)
        todo = []
        for j, (seq, tree, lg) in enumerate(zip(seqs, trees, logits)):
            if seq.params.is_greedy and not needs_processing(seq.params):
                res = verify_tree_greedy(tree, lg)  # raw logits: the same argmax
                out[j] = (res.path, res.token_ids)
            else:
                todo.append(j)
        if not todo:
            return out
        rows = verify_rows([seqs[j] for j in todo], [trees[j] for j in todo])
        target = target_distribution(torch.cat([logits[j] for j in todo]), rows,
                                     self.ctx.eos_token_id)  # [sum(n_j + 1), vocab]
        parts, r = {}, 0
        for j in todo:
            parts[j] = target[r : r + trees[j].num_nodes + 1]
            r += trees[j].num_nodes + 1
        points = []
        for j in todo:
            seq, tree = seqs[j], trees[j]
            if seq.params.is_greedy:
                res = verify_tree_greedy(tree, parts[j])
                out[j] = (res.path, res.token_ids)
            elif tree.probs is None:
                points.append(j)
            else:
                out[j] = self._verify_sampled_tree(seq, tree, parts[j])
        if points:
            # point masses: every row's plain sample (the number a plain step at its position
            # would use); follow the child holding it
            reps, starts = [], []
            for j in points:
                L = len(seqs[j].token_ids)  # the position row 0 decides
                reps += [seqs[j]] * (trees[j].num_nodes + 1)
                starts += [L + d for d in (0, *trees[j].depths())]
            dev = target.device
            u = uniforms(reps, [1] * len(reps), self.engine_gen, dev, purpose="sample",
                         starts=starts)
            probs = torch.cat([parts[j] for j in points]).float().contiguous()
            sampled = read_back(sample_from_probs(probs, u))
            r = 0
            for j in points:
                tree = trees[j]
                out[j] = _follow(tree, [int(x) for x in sampled[r : r + tree.num_nodes + 1]])
                r += tree.num_nodes + 1
        return out

    def _verify_sampled_tree(self, seq: SpecSequence, tree: DraftTree, target: torch.Tensor
                             ) -> tuple[list[int], list[int]]:
        """A sampled request's tree with draft distributions: ``verify_tree_sampled`` with
        numbers keyed by (seed, position + sibling rank, "accept") and (seed, step start,
        "residual"); a path that ends at a leaf takes the plain sample of the bonus position."""
        device = target.device
        L = len(seq.token_ids)
        n = tree.num_nodes
        depths = tree.depths()
        rank, seen = [], {}
        for p in tree.parents:
            rank.append(seen.get(p, 0))
            seen[p] = rank[-1] + 1
        keys = [L + depths[c] - 1 + rank[c] * _SIBLING_KEY for c in range(n)]
        u_acc = uniforms([seq] * n, [1] * n, self.engine_gen, device, purpose="accept",
                         starts=keys)  # [n]
        u_res = uniforms([seq], [1], self.engine_gen, device, purpose="residual")  # [1]
        res = verify_tree_sampled(tree, target, torch.cat([u_acc, u_res]))
        last = res.path[-1] if res.path else -1
        if res.path and last not in tree.parents:
            # a leaf reached: the bonus token is the plain sample of its position
            u_bonus = uniforms([seq], [1], self.engine_gen, device, purpose="sample",
                               starts=[L + len(res.path)])
            bonus = int(read_back(sample_from_probs(
                target[last + 1 : last + 2].float().contiguous(), u_bonus))[0])
            return res.path, [*res.token_ids[:-1], bonus]
        return res.path, res.token_ids

    def _verify_chains(self, seqs: list[SpecSequence], proposal: Proposal,
                       logits: torch.Tensor, greedy: torch.Tensor | None) -> VerifyResult:
        """A batch of chains (the rule of the module doc)."""
        if greedy is not None and all(
            s.params.is_greedy and not needs_processing(s.params) for s in seqs
        ):
            return verify_greedy(proposal.token_ids, greedy)
        rows = verify_rows(seqs, proposal.token_ids)
        if logits.shape[0] != len(rows):
            raise ValueError(
                f"ScoreResult.logits must have sum(k_i + 1) = {len(rows)} rows for proposal "
                f"lengths {proposal.lengths}, got {logits.shape[0]}"
            )
        device = logits.device
        # [sum(k_i + 1), vocab]: processed logits of greedy rows, probabilities of the others
        target = target_distribution(logits, rows, self.ctx.eos_token_id)
        greedy_seq = [s.params.is_greedy for s in seqs]
        lengths = proposal.lengths
        max_k = max(lengths, default=0)
        # every host-made input goes through pinned memory: no stream synchronisation before
        # the one read at the end (speculant.drafting.to_device)
        draft_ids = to_device(
            [t for d in proposal.token_ids for t in d], torch.long, device
        )  # [sum(k_i)]
        num_draft = to_device(lengths, torch.int32, device)  # [batch]
        draft_probs = None
        if proposal.probs is not None and not all(greedy_seq):
            mask = (
                torch.arange(proposal.probs.shape[1], device=proposal.probs.device)[None, :]
                < num_draft.to(proposal.probs.device)[:, None]
            )
            draft_probs = proposal.probs[mask].float().to(device)  # [total_draft, vocab]
        is_greedy = to_device(greedy_seq, torch.bool, device)  # [batch]
        point_mass = draft_probs is None and not all(greedy_seq)
        if point_mass:
            # point-mass drafts: every row's token is sampled from the target with the number
            # of its position (the one a plain step there would use), and a draft is accepted
            # iff it equals that sample: P(accept x) = p(x) as in the rejection rule, and the
            # output is the plain sample, whatever was drafted. The accept numbers say which
            # (0: accept, 2: reject, as u * q(x) <= p(x) reads them); the token after the last
            # accepted draft is replaced below by its row's sample.
            u_row = uniforms(seqs, [n + 1 for n in lengths], self.engine_gen, device,
                             purpose="sample")  # [sum(k_i + 1)]
            target = target.float().contiguous()
            sampled = sample_from_probs(target, u_row)  # [sum(k_i + 1)]
            draft_row = to_device([r0 + j for r0, n in zip(_starts(lengths), lengths)
                                   for j in range(n)], torch.long, device)  # [sum(k_i)]
            u_acc = (sampled[draft_row] != draft_ids).float() * 2.0  # [sum(k_i)]
            u_smp = torch.zeros(len(seqs), device=device)  # its sample is replaced
        else:
            # sampled drafts (Leviathan et al.): the accept test of the draft at position p uses
            # the number (seed, p, "accept"), a recovery token in the step starting at L
            # (seed, L, "residual"); the bonus token is replaced below by the plain sample of
            # its position
            u_acc = uniforms(seqs, lengths, self.engine_gen, device, purpose="accept")  # [sum(k_i)]
            u_smp = uniforms(seqs, [1] * len(seqs), self.engine_gen, device,
                             purpose="residual")  # [batch]
        out, n_out = rejection_sample(
            draft_ids,
            num_draft,
            draft_probs,
            target.float(),
            is_greedy,
            u_acc,
            u_smp,
            max_num_draft_tokens=max_k,
        )  # [batch, max_k + 1], [batch]
        if point_mass:  # the correction / bonus token: its row's sample
            col = (n_out.long() - 1)[:, None]  # [batch, 1]
            final = sampled[to_device(_starts(lengths), torch.long, device) + col[:, 0]]
            out.scatter_(1, col, torch.where(is_greedy, out.gather(1, col)[:, 0], final)[:, None])
        if draft_probs is not None and not all(greedy_seq):
            # every draft accepted: the bonus token at position L + k_i is the sample a plain step
            # there takes, with the number (seed, L + k_i, "sample")
            bonus_row = to_device([r0 + n for r0, n in zip(_starts(lengths), lengths)], torch.long,
                                  device)  # [batch]
            u_bonus = uniforms(seqs, [1] * len(seqs), self.engine_gen, device, purpose="sample",
                               starts=[len(s.token_ids) + n for s, n in zip(seqs, lengths)])
            bonus = sample_from_probs(target.float()[bonus_row].contiguous(), u_bonus)  # [batch]
            col = num_draft.long()[:, None]  # [batch, 1]: the bonus column
            take = (n_out.long() == num_draft.long() + 1) & ~is_greedy
            out.scatter_(1, col, torch.where(take, bonus, out.gather(1, col)[:, 0])[:, None])
        # the target's log-probability (raw logits) of every output token: row start_i + j
        rows_idx = (
            to_device(_starts(lengths), torch.long, device)[:, None]
            + torch.arange(max_k + 1, device=device)[None, :]
        ).clamp(max=len(rows) - 1)
        B, W = out.shape
        lp = token_logprobs(
            logits.float().contiguous(), out.clamp(min=0).reshape(-1), rows_idx.reshape(-1)
        )[1].view(B, W)  # [batch, max_k + 1]
        # one device-to-host read for tokens, counts and logprobs (float64 holds the ids exactly)
        flat = read_back(
            torch.cat([out.reshape(-1).double(), n_out.double(), lp.reshape(-1).double()])
        )
        out_l = [flat[i * W : (i + 1) * W] for i in range(B)]
        n_l = [int(x) for x in flat[B * W : B * W + B]]
        lp_off = B * W + B
        tokens = [[int(t) for t in row[:n]] for row, n in zip(out_l, n_l)]
        logprobs = [flat[lp_off + i * W : lp_off + i * W + n] for i, n in enumerate(n_l)]
        return VerifyResult(token_ids=tokens, num_accepted=[n - 1 for n in n_l], logprobs=logprobs)


def _follow(tree: DraftTree, sampled: list[int]) -> tuple[list[int], list[int]]:
    """Point-mass tree verification from each row's sample (``sampled[r]``: row ``r``'s token):
    from the root, move to the first child holding the current row's sample; emit it."""
    children: dict[int, list[int]] = {}
    for c, p in enumerate(tree.parents):
        children.setdefault(p, []).append(c)
    path, node = [], -1
    while True:
        want = sampled[node + 1]
        nxt = next((c for c in children.get(node, ()) if tree.token_ids[c] == want), None)
        if nxt is None:
            return path, [*(tree.token_ids[c] for c in path), want]
        path.append(nxt)
        node = nxt


def verify_greedy_trees(
    drafts: list[list[int] | DraftTree],  # each sequence's chain or tree
    greedy: torch.Tensor,  # [sum(k_i + 1), 2] float64: row argmax, its logprob (ScoreResult.greedy)
) -> VerifyResult:
    """``verify_greedy`` for a batch of chains and trees: a tree accepts the path of children
    that are each the argmax of their parent's row (``verify_tree_greedy``'s rule), then takes
    that row's argmax. One device-to-host read; every emitted token is its row's argmax, so the
    row's packed log-probability is the token's."""
    rows = sum((d.num_nodes if isinstance(d, DraftTree) else len(d)) + 1 for d in drafts)
    if greedy.dim() != 2 or greedy.shape[0] != rows or greedy.shape[1] != 2:
        raise ValueError(f"ScoreResult.greedy must have shape [sum(k_i + 1), 2] = [{rows}, 2], "
                         f"got {list(greedy.shape)}")
    packed = read_back(greedy)  # [[argmax, logprob], ...]
    tokens, accepted, logprobs, paths = [], [], [], []
    r0 = 0
    for d in drafts:
        tree = d if isinstance(d, DraftTree) else DraftTree.chain(d)
        children: dict[int, list[int]] = {}
        for c, p in enumerate(tree.parents):
            children.setdefault(p, []).append(c)
        path, node = [], -1
        while True:
            want = int(packed[r0 + node + 1][0])
            nxt = next((c for c in children.get(node, ()) if tree.token_ids[c] == want), None)
            if nxt is None:
                break
            path.append(nxt)
            node = nxt
        used = [r0, *(r0 + c + 1 for c in path)]
        tokens.append([int(packed[r][0]) for r in used])
        logprobs.append([packed[r][1] for r in used])
        accepted.append(len(path))
        paths.append(path if d is tree else None)
        r0 += tree.num_nodes + 1
    return VerifyResult(token_ids=tokens, num_accepted=accepted, logprobs=logprobs,
                        tree_paths=paths)


def _starts(lengths: list[int]) -> list[int]:
    """The first ``ScoreResult.logits`` row of each sequence (k_i + 1 rows each)."""
    starts, acc = [], 0
    for n in lengths:
        starts.append(acc)
        acc += n + 1
    return starts


def verify_greedy(
    drafts: list[list[int]],  # each sequence's draft tokens
    greedy: torch.Tensor,  # [sum(k_i + 1), 2] float64: row argmax, its logprob (ScoreResult.greedy)
) -> VerifyResult:
    """Greedy verification from the rows' argmax: sequence i accepts its drafts while each
    equals the argmax of the row before it and then takes that row's argmax (the correction,
    or the bonus token after all k_i), which is what the rejection kernels do for greedy rows
    with unprocessed logits. One device-to-host read."""
    rows = sum(len(d) + 1 for d in drafts)
    if greedy.dim() != 2 or greedy.shape[0] != rows or greedy.shape[1] != 2:
        raise ValueError(
            f"ScoreResult.greedy must have shape [sum(k_i + 1), 2] = [{rows}, 2] "
            f"for proposal lengths {[len(d) for d in drafts]}, got "
            f"{list(greedy.shape)}"
        )
    packed = read_back(greedy)  # [[argmax, logprob], ...]
    tokens, accepted, logprobs = [], [], []
    r = 0
    for d in drafts:
        n = 0
        while n < len(d) and int(packed[r + n][0]) == d[n]:
            n += 1
        rows_i = packed[r : r + n + 1]
        tokens.append([int(t) for t, _ in rows_i])
        logprobs.append([lp for _, lp in rows_i])
        accepted.append(n)
        r += len(d) + 1
    return VerifyResult(token_ids=tokens, num_accepted=accepted, logprobs=logprobs)


@hookimpl
def register_strategies(register: Callable[[type], None]) -> None:
    register(RejectionSampler)
