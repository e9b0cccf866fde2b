"""The speculative decode step: propose -> score -> verify -> append, through the hooks of a
per-engine plugin manager holding the chosen strategy, the scorer and the verifier. The decoder
uses its engine through :class:`~speculant.engine.target.TargetEngine` only."""

from __future__ import annotations

import functools
import logging
import operator
import types

import numpy as np
import pluggy
import torch
from pydantic import ValidationError

from speculant import hookspecs
from speculant.config import explain
from speculant.engine.sampler import ProcessorFault, contain_processor_faults, topn_dict
from speculant.engine.sequence import Sequence
from speculant.engine.spec_control import SpecController
from speculant.engine.staging import to_device
from speculant.engine.target import TargetEngine
from speculant.hookspecs import StrategyInfo, hookimpl, strategy_info
from speculant.kernels.logprobs import token_logprobs
from speculant.outputs import SpecMetrics
from speculant.plugin_manager import plugin_info
from speculant.spec_registry import (
    SpeculativeConfig,
    StrategyError,
    build_strategy_config,
    check_lossless,
    lookup,
)
from speculant.spec_types import (
    MAX_TREE_NODES,
    DraftTree,
    DraftTreeError,
    Proposal,
    ScoreResult,
    SpecBatch,
    SpecSequence,
    StrategyContext,
    VerifyResult,
)

logger = logging.getLogger("speculant")


class ProposalError(RuntimeError):
    """What was wrong with a proposal (the fault's text in the log: it names the plugin)."""


class StrategyFault(RuntimeError):
    """A plugin hook raised where the step cannot go on without it (``verify``): the requests
    of that step (``request_ids``) are aborted, the others run on. ``str()`` has the plugin's
    own exception text (it may quote any sequence of the step); ``public_message`` leaves it out
    and is what each aborted request's client is shown."""

    def __init__(self, message: str, public_message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.public_message = public_message
        self.request_ids = request_ids


# q rows may sum to 1 within this (float32 sums over a large vocabulary)
PROB_SUM_TOLERANCE = 1e-3


def _draft_ids(toks, vocab_size: int) -> tuple[list[int], str | None]:
    """One sequence's draft ids as Python ints, and what is wrong with them (None: nothing).
    Integers of any kind count (int, numpy integers, integer 0-d tensors; a row may be a 1-d
    tensor or array); anything else, bools included, and ids outside [0, vocab) do not."""
    if isinstance(toks, (torch.Tensor, np.ndarray)):
        toks = toks.tolist()
    try:
        toks = list(toks)
    except TypeError:
        return [], f"drafts must be a list of token ids, got {type(toks).__name__}"
    out = []
    for t in toks:
        if type(t) is not int:
            if isinstance(t, (bool, np.bool_)) or (isinstance(t, torch.Tensor) and (
                    t.dtype == torch.bool or t.is_floating_point() or t.is_complex())):
                return [], f"draft token {t!r} is not an integer"
            try:
                t = operator.index(t)
            except TypeError:
                return [], f"draft token {t!r} is not an integer"
        if not 0 <= t < vocab_size:
            return [], f"token id {t} is outside the vocabulary [0, {vocab_size})"
        out.append(t)
    return out, None


def _check_probs(probs: torch.Tensor, token_ids: list[list[int]], max_len: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Check draft distributions on their device, with no host synchronisation: (q, bad).
    ``bad`` [batch] bool: the sequences whose used rows (j < len(token_ids[i])) are not a
    distribution (a non-finite or negative entry, a sum off 1 by more than
    PROB_SUM_TOLERANCE, or q = 0 at the drafted token itself); ``q``: ``probs[:, :max_len]``
    with all rows of those sequences replaced by point masses at their drafted tokens. Rejection
    sampling with a point mass at any draft is exact (accept x with probability p(x), else
    sample from p without x), so the step stays lossless whatever the read of ``bad`` says."""
    dev, B = probs.device, probs.shape[0]
    p = probs[:, :max_len]
    lengths = [len(t) for t in token_ids]
    ids = to_device([t for toks in token_ids for t in [*toks, *[0] * (max_len - len(toks))]],
                    torch.long, dev).view(B, max_len, 1)
    used = torch.arange(max_len, device=dev)[None, :] < to_device(lengths, torch.long, dev)[:, None]
    at = p.gather(2, ids)  # [B, L, 1]: q of the drafted token
    ok = (((p.sum(-1, dtype=torch.float32) - 1).abs() <= PROB_SUM_TOLERANCE)  # NaN: not ok
          & (p.amin(-1) >= 0) & (at.squeeze(2) > 0))
    bad = (used & ~ok).any(-1)  # [B]
    mask = bad[:, None, None]
    q = p.masked_fill(mask, 0.0).scatter_(2, ids, torch.where(mask, torch.ones_like(at), at))
    return q, bad


def _tree_paths(proposal: Proposal, result: VerifyResult) -> dict[int, list[int]]:
    """Index of each tree sequence -> the root path of its tree whose tokens are the verifier's
    accepted tokens (``VerifyResult.token_ids[i][:num_accepted[i]]``; of equal siblings, the
    first that matches the whole run). ValueError when the verifier's tokens are no root path
    of the tree (a verifier's fault: nothing was appended yet)."""
    out: dict[int, list[int]] = {}
    given = result.tree_paths
    if given is not None and (not isinstance(given, list) or len(given) != len(result.token_ids)):
        raise ValueError(f"VerifyResult.tree_paths must be a list with one entry per sequence "
                         f"({len(result.token_ids)}) or None")
    for i, tree in enumerate(proposal.token_ids):
        if not isinstance(tree, DraftTree):
            continue
        toks, acc = result.token_ids[i], result.num_accepted[i]
        if not 0 <= acc < len(toks) or acc > tree.num_nodes:
            raise ValueError(f"VerifyResult of tree sequence {i}: num_accepted={acc} with "
                             f"{len(toks)} tokens for a DraftTree of {tree.num_nodes} nodes")
        path = given[i] if given is not None else None
        if path is not None and not _spells(tree, path, toks[:acc]):
            raise ValueError(f"VerifyResult.tree_paths[{i}] = {path} is not a root path of its "
                             f"DraftTree spelling the accepted tokens {toks[:acc]}")
        if path is None:
            path = _match_path(tree, toks[:acc])
        if path is None:
            raise ValueError(f"VerifyResult of tree sequence {i}: accepted tokens {toks[:acc]} "
                             "are not a root path of its DraftTree")
        out[i] = path
    return out


def _spells(tree: DraftTree, path: object, want: list[int]) -> bool:
    """Whether ``path`` is a root path of ``tree`` (each node the child of the one before, the
    first a child of the root) whose tokens are ``want``."""
    if type(path) is not list or len(path) != len(want):
        return False
    parent, n = -1, tree.num_nodes
    for node, tok in zip(path, want):
        if type(node) is not int or not 0 <= node < n or tree.parents[node] != parent or \
                tree.token_ids[node] != tok:
            return False
        parent = node
    return True


def _match_path(tree: DraftTree, want: list[int]) -> list[int] | None:
    """A root path of ``tree`` whose tokens are ``want`` (depth first, siblings in index order),
    or None."""
    kids: dict[int, list[int]] = {}
    for n, p in enumerate(tree.parents):
        kids.setdefault(p, []).append(n)
    stack = [(-1, [])]
    while stack:
        node, path = stack.pop()
        if len(path) == len(want):
            return path
        for c in reversed(kids.get(node, ())):
            if tree.token_ids[c] == want[len(path)]:
                stack.append((c, [*path, c]))
    return None


def _start_read(t: torch.Tensor):
    """Start copying a small device tensor to the host; ``_finish_read`` gives its list. On CUDA
    the copy is queued (pinned memory, an event), so it costs no wait when it is read after the
    step's own read-back."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


def _finish_read(pending) -> list:
    if isinstance(pending, torch.Tensor):
        return pending.tolist()
    host, done = pending
    done.synchronize()
    return host.tolist()


class TargetScorer:
    """Default ``score``: one target forward over [last token, drafts...] per sequence."""

    def __init__(self, decoder: SpecDecoder) -> None:
        self.d = decoder

    @hookimpl(trylast=True)
    def score(self, batch: SpecBatch, proposal: Proposal) -> ScoreResult:
        seqs = [self.d.seq_by_id[s.seq_id] for s in batch.seqs]
        new_tokens = [[s.last_token, *(d.token_ids if isinstance(d, DraftTree) else d)]
                      for s, d in zip(seqs, proposal.token_ids)]
        # the greedy pack is free inside a head graph; eagerly, only for all-greedy batches
        greedy = all(s.params.is_greedy for s in seqs)
        kw = {}
        if proposal.has_trees:  # a tree step: tree attention over each tree's root and nodes
            kw["trees"] = [d.parents if isinstance(d, DraftTree) else None
                           for d in proposal.token_ids]
        hidden, aux, logits, packed = self.d.engine.score(seqs, new_tokens, self.d.aux_layers,
                                                          greedy=greedy,
                                                          keep_hidden=self.d.needs_hidden, **kw)
        return ScoreResult(logits=logits, hidden_states=hidden, aux_hidden_states=aux,
                           greedy=packed)


def _parse(speculative_config: dict) -> SpeculativeConfig:
    try:
        return SpeculativeConfig(**speculative_config)
    except ValidationError as e:
        raise StrategyError(f"invalid speculative_config: {explain(e, 'speculative_config')}") from None
    except TypeError as e:
        raise StrategyError(f"invalid speculative_config: {e}") from None


def _build(info: StrategyInfo, config, ctx: StrategyContext):
    """``info.cls(config, ctx)``, a bad checkpoint's error turned into a StrategyError."""
    try:
        return info.cls(config, ctx)
    except StrategyError:
        raise
    except (ValueError, FileNotFoundError) as e:  # bad checkpoint, vocab mismatch, ...
        raise StrategyError(f"speculative method {info.name!r}: {e}") from e


class SpecDecoder:
    """The speculative decoder of one engine: the chosen strategy, the scorer, the verifier and
    the modifiers in its own plugin manager, and the step that runs them. It uses the engine
    only through :class:`~speculant.engine.target.TargetEngine`."""

    def __init__(self, engine: TargetEngine, speculative_config: dict) -> None:
        self.engine = engine
        self.spec_config = spec = _parse(speculative_config)
        self.ctx = ctx = engine.strategy_context()
        info = lookup(spec.method, "proposer")
        self.name = info.name
        self.strategy_config = build_strategy_config(info, spec)
        self.strategy = _build(info, self.strategy_config, ctx)
        # k: what the instance settled on (its __init__, or a property), else the user's value
        # (through the strategy's Config or speculative_config), else the class's default
        own = strategy_info(self.strategy, info.plugin)
        k = (own.num_speculative_tokens or getattr(self.strategy_config, "num_speculative_tokens", None)
             or spec.num_speculative_tokens or info.num_speculative_tokens)
        if not k:
            raise StrategyError(
                f"speculative_config for {info.name!r} needs num_speculative_tokens (or give the "
                f"strategy class a default: num_speculative_tokens = N)")
        self.k = int(k)
        self.needs_hidden = own.needs_hidden_states
        self.aux_layers = own.aux_hidden_layers

        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        # the entry-point plugin behind each name registered here (error messages name it)
        self.owners: dict[str, str] = {}
        self.pm.register(self.strategy, name=f"strategy:{info.name}")
        self.owners[f"strategy:{info.name}"] = info.plugin
        self.pm.register(TargetScorer(self), name="scorer:target")
        verifier = lookup(spec.acceptance_method, "verifier")
        # hookspecs.Strategy.lossless: a lossy verifier (or strategy) is named here, once
        self.lossless = check_lossless(own, verifier)
        self.pm.register(verifier.cls(None, ctx), name=f"verifier:{verifier.name}")
        self.owners[f"verifier:{verifier.name}"] = verifier.plugin
        if spec.disable_by_batch_size is not None:
            modifier = lookup("batch_size_disable", "modifier")
            mod_cfg = modifier.Config(disable_by_batch_size=spec.disable_by_batch_size)
            self.pm.register(modifier.cls(mod_cfg, ctx), name="modifier:batch_size_disable")
            self.owners["modifier:batch_size_disable"] = modifier.plugin
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as e:
            raise StrategyError(f"strategy {info.name!r} implements an unknown hook: {e}") from None
        self.seq_by_id: dict[int, Sequence] = {}
        # requests whose logits processors failed in a verification (request id, error), for
        # the engine to abort at the end of its step (take_failed)
        self.failed: list[tuple[str, str]] = []
        # hidden states not yet handed to the proposer, per seq id: (start_pos, [tensors], [aux])
        self.pending: dict[int, tuple[int, list[torch.Tensor], list[torch.Tensor]]] = {}
        self._new_run_state()  # enabled, control, last_batch_size, total, faults

    def reset(self) -> None:
        """Forget what earlier runs taught this decoder, as if it had just been built over the
        same strategy (whose weights, caches and CUDA graphs it keeps): the metrics, the
        auto-disable statistics and the batch-size vote. Call it between runs with no request
        in flight (benchmarks reuse one decoder across batch sizes)."""
        if self.seq_by_id or self.pending:
            raise RuntimeError("SpecDecoder.reset() with requests in flight: let them finish or "
                               "abort them first")
        self._new_run_state()

    def _new_run_state(self) -> None:
        spec = self.spec_config
        self.enabled = True  # False while a modifier (on_batch_size_change) turned speculation off
        self.control = (SpecController(spec.auto_disable_tolerance, spec.auto_disable_interval)
                        if spec.auto_disable else None)
        self.last_batch_size = 0
        self.total = SpecMetrics(lossless=self.lossless)
        # faults (engine/spec_decode.py "Faults", docs/hooks.md): sequences the strategy no
        # longer drafts for, and whether it faulted max_plugin_faults times (then: plain only)
        self.disabled: set[int] = set()
        self.num_faults = 0
        self.broken = False

    # ----------------------------------------------------------------- engine callbacks
    def max_lookahead(self) -> int:
        if self.broken:
            return 0
        if self.control is not None and not self.control.would_speculate(self.last_batch_size):
            return 0
        return self.k if self.enabled else 0

    def capture_graphs(self, progress: bool = True) -> int:
        """The plugins' ``capture_graphs`` hook (their own CUDA graphs, at start-up): how many
        they captured."""
        try:
            done = self.pm.hook.capture_graphs(max_num_seqs=self.ctx.max_num_seqs,
                                               progress=progress)
        except Exception as e:
            raise RuntimeError(f"{self._culprit(e, 'capture_graphs')} raised in capture_graphs(): "
                               f"{type(e).__name__}: {e}") from e
        return sum(int(n or 0) for n in done)

    def release(self, seq_ids: list[int]) -> None:
        for i in seq_ids:
            self.pending.pop(i, None)
            s = self.seq_by_id.pop(i, None)
            if s is None or s.is_finished:  # a preempted sequence stays disabled
                self.disabled.discard(i)
        try:
            self.pm.hook.on_requests_finished(seq_ids=list(seq_ids))
        except Exception as e:
            self._fault(f"{self._culprit(e, 'on_requests_finished')} raised in "
                        f"on_requests_finished(): {type(e).__name__}: {e}", [])

    # ----------------------------------------------------------------- faults
    def _describe(self, name: str) -> str:
        """A plugin registered here as ``name`` ("strategy:ngram"), for messages: its kind, its
        name, the entry-point plugin and distribution it came from."""
        kind, _, what = name.partition(":")
        if name == "scorer:target":
            return "the engine's target scorer"
        plugin = self.owners.get(name)
        if plugin is None:
            return f"{kind} {what!r}"
        meta = plugin_info(plugin)
        dist = (f"distribution {meta.distribution} {meta.version or ''}".rstrip()
                if meta is not None and meta.distribution else "not from an installed distribution")
        return f"{kind} {what!r} (plugin {plugin!r}, {dist})"

    def _culprit(self, e: BaseException, hook: str) -> str:
        """The plugin whose ``hook`` implementation raised ``e`` (the outermost frame of the
        traceback that is one of the hook's implementations), described for a message."""
        codes = {}
        for impl in getattr(self.pm.hook, hook).get_hookimpls():
            fn = getattr(impl.function, "__func__", impl.function)
            if isinstance(fn, types.FunctionType):
                codes[fn.__code__] = impl.plugin_name
        tb = e.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code in codes:
                return self._describe(codes[tb.tb_frame.f_code])
            tb = tb.tb_next
        return f"a plugin's {hook}()"

    def _fault(self, message: str, seqs: list[Sequence]) -> None:
        """Count and log one fault; the strategy drafts no more for ``seqs`` (the faulty
        sequences, or every sequence of the step when the fault cannot be pinned on one) and
        their requests' other sequences; after ``max_plugin_faults`` faults, for no sequence."""
        self.num_faults += 1
        self.total.num_faults += 1
        ids = {s.seq_id for s in seqs}
        rids = {s.request_id for s in seqs}
        ids |= {i for i, s in self.seq_by_id.items() if s.request_id in rids}
        for s in seqs:
            s.metrics.spec.num_faults += 1
        self.disabled |= ids
        limit = self.spec_config.max_plugin_faults
        logger.warning("speculative decoding fault %d of at most %d: %s; %s", self.num_faults,
                       limit, message,
                       f"no more drafts for request(s) {', '.join(sorted(rids))}" if rids
                       else "nothing dropped")
        if self.num_faults >= limit and not self.broken:
            self.broken = True
            self.total.num_times_disabled += 1
            logger.warning("speculative decoding off for the rest of this engine's life: %d "
                           "faults (max_plugin_faults=%d); plain decoding from now on",
                           self.num_faults, limit)

    def record_prefill(self, seqs: list[Sequence], counts: list[int], hidden: torch.Tensor,
                       aux: torch.Tensor | None) -> None:
        """A prefill step fed ``counts[i]`` tokens of ``seqs[i]`` (from position 0 on a
        recompute) and appended each one's first token: keep the hidden states for the proposer
        and count the step (``spec_token_acceptance_counts[0]`` counts prefills, as vLLM V0)."""
        self.record_hidden(seqs, counts, hidden, aux, counts, [0] * len(seqs), reset=True)
        for s in seqs:
            s.metrics.spec.num_prefill_steps += 1
            s.metrics.spec.num_speculative_tokens = self.k
        self.total.num_prefill_steps += len(seqs)

    def record_hidden(self, seqs, counts, hidden, aux, keep, starts, reset: bool = False) -> None:
        """Remember target hidden states of newly verified positions for the proposer.
        Rows [0, keep[i]) of the ``counts[i]`` rows of seqs[i] are kept; they cover positions
        starting at ``starts[i]``. ``reset`` drops what was pending (prefill / recompute)."""
        if not self.needs_hidden:
            return
        row = 0
        for s, c, kp, p0 in zip(seqs, counts, keep, starts):
            if s.seq_id in self.disabled:  # the strategy no longer drafts for it
                row += c
                continue
            if reset or s.seq_id not in self.pending:
                self.pending[s.seq_id] = (p0, [], [])
            entry = self.pending[s.seq_id]
            entry[1].append(hidden[row : row + kp])
            if aux is not None:
                entry[2].append(aux[row : row + kp])
            row += c

    # ----------------------------------------------------------------- the step
    def step(self, seqs: list[Sequence]) -> None:
        """One decode step of ``seqs``: speculative, or plain while speculation is off (a
        modifier's vote, ``auto_disable``) or nothing was proposed."""
        for s in seqs:
            self.seq_by_id[s.seq_id] = s
        if len(seqs) != self.last_batch_size:
            self._batch_size_changed(len(seqs))
        allowed = self.enabled and not self.broken
        if self.control is None:
            self._step(seqs, allowed)
            return
        emitted = self.total.num_emitted_tokens
        speculate = self.control.begin(len(seqs), allowed=allowed)
        self._step(seqs, speculate)
        switched = self.control.end(self.total.num_emitted_tokens - emitted)
        if switched == "off":
            self.total.num_times_disabled += 1
        elif switched == "on":
            self.total.num_times_enabled += 1

    def _batch_size_changed(self, size: int) -> None:
        """The ``on_batch_size_change`` vote: speculation runs unless a plugin returns False."""
        try:
            votes = self.pm.hook.on_batch_size_change(old_size=self.last_batch_size, new_size=size)
        except Exception as e:  # no vote: speculation stays as it is
            self._fault(f"{self._culprit(e, 'on_batch_size_change')} raised in "
                        f"on_batch_size_change(): {type(e).__name__}: {e}", [])
            votes = [] if self.enabled else [False]
        was = self.enabled
        self.enabled = not any(v is False for v in votes)
        if was != self.enabled:
            if self.enabled:
                self.total.num_times_enabled += 1
            else:
                self.total.num_times_disabled += 1
            logger.info("speculation %s at batch size %d", "on" if self.enabled else "off", size)
        self.last_batch_size = size

    def _step(self, seqs: list[Sequence], speculate: bool) -> None:
        if not speculate:
            # build no batch: it would hand the pending target hidden states to no proposer
            # (and drop them); kept, they let the proposer catch up when speculation returns
            self._plain_step(seqs, overlap=True)
            return
        seqs = self.engine.take_back(seqs)  # the proposer needs every token on the host
        if not seqs:
            return
        batch, sub, drafting = self._batch(seqs)
        self._bad_q = None
        proposal = self._propose(sub) if drafting else None
        bad_q, self._bad_q = self._bad_q, None
        if proposal is None or not any(proposal.token_ids):
            self._plain_step(seqs, overlap=False)
            return
        if sub is not batch:
            proposal = self._lay_out(proposal, len(seqs), drafting)
        try:
            scores = self.pm.hook.score(batch=batch, proposal=proposal)
        except Exception as e:  # nothing appended yet: the step runs plain instead
            self._fault(f"{self._culprit(e, 'score')} raised in score(): "
                        f"{type(e).__name__}: {e}", seqs)
            self._plain_step(seqs, overlap=False)
            return
        # a request's logits processor failing on a row is that request's fault, not the
        # verifier's: the row gets neutral logits and the request is cut there (_cut_at)
        with contain_processor_faults() as faults:
            try:
                result = self.pm.hook.verify(batch=batch, proposal=proposal, scores=scores)
                paths = _tree_paths(proposal, result) if proposal.has_trees else {}
            except Exception as e:
                raise self._verify_failed(seqs, e) from e
        if paths:
            self._compact(seqs, paths)
        self._apply(seqs, proposal, scores, result, self._cut_at(seqs, faults), paths)
        if bad_q is not None:  # read after the step's own read-back: no wait
            bad = [seqs[i] for i, b in zip(drafting, _finish_read(bad_q)) if b]
            if bad:
                self._fault(f"{self._who}: draft probabilities (Proposal"
                            f".probs) that are not a distribution (a non-finite or negative "
                            f"entry, a row sum off 1 by more than {PROB_SUM_TOLERANCE}, or q = 0 "
                            "at the drafted token); verified as point masses at the drafts "
                            "instead", bad)

    def take_failed(self) -> list[tuple[str, str]]:
        """(request id, error) of the requests whose logits processors failed since the last
        call: the engine aborts them at the end of its step."""
        failed, self.failed = self.failed, []
        return failed

    def _cut_at(self, seqs: list[Sequence], faults: list[ProcessorFault]
                ) -> dict[int, tuple[int, str]]:
        """Index in ``seqs`` -> (the first verification row whose logits processors failed,
        the error naming the request). Row j decides the token after j accepted drafts."""
        cut: dict[int, tuple[int, str]] = {}
        index = {s.seq_id: i for i, s in enumerate(seqs)}
        for f in faults:
            i = index.get(f.seq_id)
            if i is not None and (i not in cut or f.position < cut[i][0]):
                cut[i] = (f.position, f"request {seqs[i].request_id}: {f.error.detail}")
        return cut

    def _verify_failed(self, seqs: list[Sequence], e: Exception) -> StrategyFault:
        """``verify`` raised ``e``. It may have drawn from the sequences' random streams, so the
        step is not redone plain: its requests are to be aborted (by whoever runs the engine:
        LLM, the server), the others go on."""
        who = self._culprit(e, "verify")
        self._fault(f"{who} raised in verify(): {type(e).__name__}: {e}", seqs)
        for s in seqs:
            self.engine.rollback(s, s.num_cached_tokens)
        return StrategyFault(
            f"speculative decoding failed: {who} raised in verify(): {type(e).__name__}: {e}",
            f"speculative decoding failed: {who} raised {type(e).__name__} in verify(); the "
            "request was aborted (details in the server log)",
            list(dict.fromkeys(s.request_id for s in seqs)))

    def _room(self, s: Sequence) -> int:
        """Draft tokens ``s`` may get this step. Scoring writes K/V at positions len(s) - 1 ..
        len(s) - 1 + k, so it needs len(s) + k cache slots; the scheduler reserved k extra slots
        only if speculation was on at the previous step (``max_lookahead``). On the step that
        turns it back on, reserve them now if blocks are free, else draft fewer tokens."""
        want = min(self.k, self.ctx.max_model_len - len(s) - 1)
        if want <= 0:
            return 0
        return max(0, min(want, self.engine.reserve_slots(s, len(s) + want) - len(s)))

    def _batch(self, seqs: list[Sequence]) -> tuple[SpecBatch, SpecBatch, list[int]]:
        """The step's batch, the part of it the strategy drafts for (all but the sequences a
        fault disabled; the hidden states are theirs) and those sequences' indices."""
        drafting = [i for i, s in enumerate(seqs) if s.seq_id not in self.disabled]
        room = [0] * len(seqs)
        for i in drafting:
            room[i] = self._room(seqs[i])
        sp = [SpecSequence(s.seq_id, s.token_ids, s.num_prompt_tokens, r, s.params, s.generator)
              for s, r in zip(seqs, room)]
        batch = SpecBatch(seqs=sp)
        if self.needs_hidden:
            hs, aux, counts, starts = [], [], [], []
            for i in drafting:
                s = seqs[i]
                pos0, h, a = self.pending.pop(s.seq_id, (len(s) - 1, [], []))
                t = torch.cat(h) if h else torch.empty(0, self.ctx.target_model.hidden_size,
                                                       device=self.ctx.device, dtype=self.ctx.dtype)
                hs.append(t)
                if a:
                    aux.append(torch.cat(a))
                counts.append(t.shape[0])
                starts.append(pos0)
            batch.hidden_states = torch.cat(hs) if hs else None
            batch.aux_hidden_states = torch.cat(aux) if aux else None
            batch.hidden_counts, batch.hidden_start = counts, starts
        if len(drafting) == len(seqs):
            return batch, batch, drafting
        sub = SpecBatch(seqs=[sp[i] for i in drafting], hidden_states=batch.hidden_states,
                        aux_hidden_states=batch.aux_hidden_states,
                        hidden_counts=batch.hidden_counts, hidden_start=batch.hidden_start)
        return batch, sub, drafting

    @property
    def _strategy_key(self) -> str:
        return f"strategy:{self.name}"

    @functools.cached_property
    def _who(self) -> str:
        """The strategy, as fault messages name it (worked out once, not every step)."""
        return self._describe(self._strategy_key)

    def _propose(self, batch: SpecBatch) -> Proposal | None:
        """The strategy's proposal for ``batch``, checked (``_check``; the pending read of
        which sequences' q was not a distribution goes to ``self._bad_q``). None: no proposal
        this step (the strategy proposed nothing, or a fault that no one sequence caused)."""
        who = self._who
        seqs = [self.seq_by_id[s.seq_id] for s in batch.seqs]
        try:
            proposal = self.pm.hook.propose(batch=batch)
        except Exception as e:
            self._fault(f"{self._culprit(e, 'propose')} raised in propose(): "
                        f"{type(e).__name__}: {e}", seqs)
            return None
        if proposal is None:
            return None
        try:
            proposal, self._bad_q = self._check(batch, proposal, seqs, who)
        except ProposalError as e:  # no one sequence to blame: drop the step's proposal
            self._fault(str(e), seqs)
            return None
        return proposal

    def _lay_out(self, proposal: Proposal, size: int, drafting: list[int]) -> Proposal:
        """A proposal for the sequences ``drafting`` of a batch of ``size``, over all of it (no
        drafts for the others)."""
        ids: list[list[int]] = [[] for _ in range(size)]
        for i, toks in zip(drafting, proposal.token_ids):
            ids[i] = toks
        probs = proposal.probs
        if probs is not None:
            full = probs.new_zeros(size, *probs.shape[1:])
            full[to_device(drafting, torch.long, probs.device)] = probs
            probs = full
        return Proposal(token_ids=ids, probs=probs, proposer=self.name)

    def _check(self, batch: SpecBatch, proposal, seqs: list[Sequence], who: str
               ) -> tuple[Proposal, object | None]:
        """Check a proposal: raises ProposalError for what no one sequence caused (not a
        Proposal, wrong row count, q of the wrong shape or type); drops the drafts of a sequence
        whose own are wrong (ids that are not integers of the vocabulary, more than its
        ``max_draft``), a fault of that sequence; replaces a sequence's q that is not a
        distribution with point masses at its drafts on the device (``_check_probs``). Returns
        the proposal with plain int ids and the pending read of those sequences (or None)."""
        if not isinstance(proposal, Proposal):
            raise ProposalError(f"{who}: propose() returned {type(proposal).__name__}, expected "
                                "speculant.spec_types.Proposal")
        proposal.proposer = self.name
        rows = proposal.token_ids
        if not isinstance(rows, (list, tuple)) or len(rows) != len(batch.seqs):
            n = len(rows) if hasattr(rows, "__len__") else type(rows).__name__
            raise ProposalError(f"{who} proposed for {n} sequences but the batch has "
                                f"{len(batch.seqs)}")
        V = self.ctx.vocab_size
        ids, faulty, problems = [], [], []
        for s, seq, toks in zip(batch.seqs, seqs, rows):
            if isinstance(toks, DraftTree):
                got, problem = self._check_tree(toks, s, who)
            else:
                got, problem = _draft_ids(toks, V)
                if problem is None and len(got) > s.max_draft:
                    problem = f"{len(got)} tokens, more than its limit k={s.max_draft}"
            if problem is not None:
                faulty.append(seq)
                problems.append(f"request {seq.request_id}: {problem}")
                got = []
            ids.append(got)
        if any(isinstance(t, DraftTree) for t in ids) and max(
                (len(t) for t in ids if not isinstance(t, DraftTree)), default=0) > MAX_TREE_NODES:
            # a tree step's rows carry one int64 of tree-attention bits: chains of the same
            # step must fit too
            for i, (seq, t) in enumerate(zip(seqs, ids)):
                if isinstance(t, DraftTree):
                    faulty.append(seq)
                    problems.append(f"request {seq.request_id}: a DraftTree in a step with a "
                                    f"chain of more than {MAX_TREE_NODES} drafts")
                    ids[i] = []
        proposal.token_ids = ids
        bad = None
        if proposal.probs is not None:
            p = proposal.probs
            chains = [[] if isinstance(t, DraftTree) else t for t in ids]
            L = max((len(t) for t in chains), default=0)
            if not isinstance(p, torch.Tensor) or not p.is_floating_point():
                raise ProposalError(f"{who}: draft probs (Proposal.probs) must be a float32 "
                                    f"tensor, got {getattr(p, 'dtype', type(p).__name__)}")
            need = (len(batch.seqs), L, V)
            if p.dim() != 3 or p.shape[0] != need[0] or p.shape[1] < need[1] or p.shape[2] != V:
                raise ProposalError(f"{who}: draft probs have shape {tuple(p.shape)}, expected "
                                    f"[batch, >= max_len, vocab] = {need}")
            if L > 0:
                q, flags = _check_probs(p, chains, L)
                proposal.probs = q
                bad = _start_read(flags)
        if faulty:
            self._fault(f"{who} proposed drafts out of bounds: {'; '.join(problems)}", faulty)
        return proposal, bad

    def _check_tree(self, tree: DraftTree, s: SpecSequence, who: str
                    ) -> tuple[list[int] | DraftTree, str | None]:
        """One sequence's :class:`DraftTree`, checked (``DraftTree.validate``: node count,
        ids, probs): what to verify (the tree; an empty list for an empty tree; a list for a
        chain-shaped tree of point masses, which scores as a chain) and what is wrong (or None)."""
        try:
            # rebuilt: the structure is checked again (fields may have changed since it was made)
            tree = DraftTree(tree.token_ids, tree.parents, tree.probs)
            tree.validate(self.ctx.vocab_size, max_nodes=s.max_draft, who=who)
        except DraftTreeError as e:
            return [], str(e).removeprefix(f"{who}: ")
        if tree.num_nodes > MAX_TREE_NODES:
            return [], (f"a DraftTree of {tree.num_nodes} nodes: the engine scores at most "
                        f"{MAX_TREE_NODES} per sequence (speculant.spec_types.MAX_TREE_NODES)")
        if tree.num_nodes == 0:
            return [], None
        if tree.is_chain and tree.probs is None:
            return list(tree.token_ids), None
        return tree, None

    def _compact(self, seqs: list[Sequence], paths: dict[int, list[int]]) -> None:
        """Move the K/V of each tree sequence's accepted nodes next to its root (the sequence's
        last token, at position len - 1), so that its cache holds the accepted tokens at
        consecutive positions; the rejected nodes' slots are freed by ``_apply``'s rollback."""
        todo = [(seqs[i], [n + 1 for n in path]) for i, path in paths.items()
                if path and path != list(range(len(path)))]
        if todo:
            self.engine.compact_tree([s for s, _ in todo], [len(s) - 1 for s, _ in todo],
                                     [rows for _, rows in todo])

    def _plain_step(self, seqs: list[Sequence], overlap: bool) -> None:
        """A plain decode step; with ``overlap`` it may run overlapped with the host work of the
        one before (engine/async_decode.py), its tokens appended, and counted, at the next."""
        step = self.engine.decode(seqs, self.aux_layers, overlap=overlap, on_append=self._count_plain)
        ones = [1] * len(step.seqs)
        self.record_hidden(step.seqs, ones, step.hidden, step.aux, ones, step.starts)
        for s in step.seqs:  # drop the draft slots; keep those of the tokens in the cache
            if not s.is_finished:
                self.engine.rollback(s, s.num_cached_tokens)

    def _count_plain(self, s: Sequence) -> None:
        s.metrics.spec.num_plain_steps += 1
        s.metrics.spec.num_emitted_tokens += 1
        self.total.num_plain_steps += 1
        self.total.num_emitted_tokens += 1

    def _apply(self, seqs: list[Sequence], proposal: Proposal, scores: ScoreResult,
               result: VerifyResult, cut: dict[int, tuple[int, str]] | None = None,
               paths: dict[int, list[int]] | None = None) -> None:
        """Append each sequence's verified tokens. ``cut``: sequences whose logits processors
        failed at a row (``_cut_at``): a row after the first rejected draft decided nothing, so
        the sequence is applied as usual; otherwise it gets the accepted drafts before the row
        (the tokens a plain run appends before its processors fail at that position) and its
        request is failed. ``paths``: index in ``seqs`` -> the accepted nodes of its tree
        (``_tree_paths``): token ``j`` of a tree sequence comes from row 0 (``j = 0``) or the
        row after its ``j``-th accepted node."""
        eng = self.engine
        cut = cut or {}
        paths = paths or {}
        counts = [n + 1 for n in proposal.lengths]
        starts = [0]
        for c in counts[:-1]:
            starts.append(starts[-1] + c)  # first score row of each sequence
        # the score row (within its sequence's) of each emitted token
        token_rows = [[0, *(n + 1 for n in paths[i])] if i in paths else list(range(len(toks)))
                      for i, toks in enumerate(result.token_ids)]
        logprobs = result.logprobs
        if logprobs is None:  # a verifier that did not return them: one batched gather
            idx = [(r0 + rows[j], t) for r0, toks, rows in zip(starts, result.token_ids, token_rows)
                   for j, t in enumerate(toks)]
            dev = scores.logits.device
            logits = scores.logits.float().contiguous()  # a plugin scorer's may be strided
            flat = token_logprobs(logits, to_device([t for _, t in idx], torch.long, dev),
                                  to_device([i for i, _ in idx], torch.long, dev))[1].tolist() \
                if idx else []
            logprobs, pos = [], 0
            for toks in result.token_ids:
                logprobs.append(flat[pos : pos + len(toks)])
                pos += len(toks)
        keep, hidden_starts = [], [len(s) - 1 for s in seqs]
        total = self.total
        for i, (s, k_i, toks, lps, acc, r0) in enumerate(zip(
                seqs, proposal.lengths, result.token_ids, logprobs, result.num_accepted, starts)):
            base = len(s)  # tokens before this step; cache now holds base + k_i
            # a failed row at depth d (a tree: any node at depth d) decides the token after d
            # accepted drafts: conservative for a tree, whose failed row may be off the path
            row, error = cut.get(i, (k_i + 1, None))
            if acc >= row:  # the failed row decided a token: keep the drafts before it only
                acc, toks, lps = row, toks[:row], lps[:row]
            else:
                error = None
            m = s.metrics.spec
            tree = proposal.token_ids[i]
            if isinstance(tree, DraftTree):
                depth = max(tree.depths())
                m.record_tree(k_i, depth, acc)
                total.record_tree(k_i, depth, acc)
            else:
                m.record(k_i, acc)
                total.record(k_i, acc)
            m.num_spec_steps += 1
            keep.append(acc + 1)
            full = None
            if s.params.logprobs is not None:  # top-N dicts: this sequence's rows only
                sel = [r0 + r for r in token_rows[i][: len(toks)]]
                full = torch.log_softmax(scores.logits[sel].float(), dim=-1)
            for j, (t, lp) in enumerate(zip(toks, lps)):
                top = topn_dict(full[j], t, s.params.logprobs, self.ctx.tokenizer) if full is not None else None
                m.num_emitted_tokens += 1
                total.num_emitted_tokens += 1
                if eng.append_token(s, t, lp, top):
                    break
            if error is not None and not s.is_finished:  # aborted by the engine after the step
                self.failed.append((s.request_id, error))
                eng.rollback(s, len(s) - 1)
            # the cache is valid for the last token and the accepted drafts only
            elif not s.is_finished:
                eng.rollback(s, base + acc)
        total.num_spec_steps += len(seqs)
        hidden, aux = scores.hidden_states, scores.aux_hidden_states
        if paths and self.needs_hidden and hidden is not None:
            # the kept rows (the root's and the accepted nodes') first, sequence by sequence
            sel = [r0 + r for r0, rows, kp in zip(starts, token_rows, keep) for r in rows[:kp]]
            sel_t = to_device(sel, torch.long, hidden.device)
            hidden = hidden[sel_t]
            aux = aux[sel_t] if aux is not None else None
            counts = list(keep)
        self.record_hidden(seqs, counts, hidden, aux, keep, hidden_starts)
