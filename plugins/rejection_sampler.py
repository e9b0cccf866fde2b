"""The default verifier: lossless rejection sampling (Leviathan et al. 2211.17192, Chen et al.
2302.01318), shared by every strategy.

Greedy rows accept drafts while they equal the argmax of the processed target logits; random rows
accept draft x with probability min(1, p(x) / q(x)) and on rejection sample from
normalize(max(p - q, 0)), so the output follows the target distribution exactly. ``p`` is the
target distribution after the request's logits processors, penalties, temperature, top-k, top-p
and min-p; penalties at draft position j count the drafts before j as generated tokens.
"""

from __future__ import annotations

import torch

from speculant import hookimpl
from speculant.engine.sampler import Row, process_logits, target_probs, uniforms
from speculant.kernels.rejection_sampling import rejection_sample
from speculant.spec_types import Proposal, ScoreResult, SpecBatch, StrategyContext, VerifyResult


class RejectionSampler:
    name = "rejection_sampler"
    kind = "verifier"

    def __init__(self, config, ctx: StrategyContext) -> None:
        self.ctx = ctx
        self.engine_gen = torch.Generator().manual_seed(ctx.seed + 7919)

    @hookimpl(trylast=True)
    def verify(self, batch: SpecBatch, proposal: Proposal, scores: ScoreResult) -> VerifyResult:
        seqs = batch.seqs
        rows = [Row(seq, drafts[:j]) for seq, drafts in zip(seqs, proposal.token_ids)
                for j in range(len(drafts) + 1)]
        if scores.logits.shape[0] != len(rows):
            raise ValueError(
                f"ScoreResult.logits must have sum(k_i + 1) = {len(rows)} rows for proposal "
                f"lengths {proposal.lengths}, got {scores.logits.shape[0]}")
        device = scores.logits.device
        processed = process_logits(scores.logits, rows, self.ctx.eos_token_id)  # [sum(k_i + 1), vocab]
        greedy_seq = [s.params.is_greedy for s in seqs]
        greedy_row = torch.tensor([r.seq.params.is_greedy for r in rows], device=device)
        if all(greedy_seq):
            target = processed
        else:
            probs = target_probs(processed, rows)
            target = torch.where(greedy_row[:, None], processed, probs)
        lengths = proposal.lengths
        draft_ids = torch.tensor([t for d in proposal.token_ids for t in d], dtype=torch.long,
                                 device=device)
        num_draft = torch.tensor(lengths, dtype=torch.int32, device=device)
        draft_probs = None
        if proposal.probs is not None and not all(greedy_seq):
            mask = torch.arange(proposal.probs.shape[1], device=proposal.probs.device)[None, :] < \
                num_draft.to(proposal.probs.device)[:, None]
            draft_probs = proposal.probs[mask].float().to(device)  # [total_draft, vocab]
        u_acc = uniforms(seqs, lengths, self.engine_gen, device)
        u_smp = uniforms(seqs, [1] * len(seqs), self.engine_gen, device)
        out, n_out = rejection_sample(draft_ids, num_draft, draft_probs, target.float(),
                                      torch.tensor(greedy_seq, device=device), u_acc, u_smp)
        out_l, n_l = out.tolist(), n_out.tolist()
        tokens = [row[:n] for row, n in zip(out_l, n_l)]
        return VerifyResult(token_ids=tokens, num_accepted=[n - 1 for n in n_l])


@hookimpl
def register_strategies(register) -> None:
    register(RejectionSampler)
