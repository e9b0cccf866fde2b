"""The hook specifications of speculant: the whole plugin API in one file.

A strategy is a plugin. Plugin *modules* are discovered through the entry-point group
``speculant.strategies`` (built-ins and third-party packages alike) and implement
:func:`register_strategies`. Each registered strategy is a class; when a user picks it by name
(``speculative_config={"method": ...}``) the engine instantiates it and registers the instance
in the engine's own plugin manager, where its :func:`propose` (and optionally
:func:`on_batch_size_change`, :func:`on_requests_finished`, :func:`score`, :func:`verify`)
implementations are called every speculative step::

    propose  ->  score (target forward over k+1 tokens per sequence)  ->  verify  ->  append

``score`` and ``verify`` have built-in default implementations (the engine's target scorer and
the lossless rejection sampler plugin, both ``trylast``) so a strategy usually implements only
``propose``.

The class attributes the engine reads from a strategy class are declared once, by
:class:`Strategy` at the end of this file; :func:`strategy_info` checks a class against it.

Markers: ``from speculant import hookimpl``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    from pydantic import BaseModel

    from speculant.spec_types import (
        Proposal,
        ScoreResult,
        SpecBatch,
        StrategyContext,
        VerifyResult,
    )

PROJECT_NAME = "speculant"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def register_strategies(register: Callable[..., None]) -> None:
    """Register the speculation strategies (and verifiers) a plugin module provides.

    Called on every plugin module loaded from the ``speculant.strategies`` entry-point group (and
    on every plugin registered with ``speculant.plugin_manager.register``) whenever strategies
    are looked up: building an engine with a ``speculative_config``, ``speculant plugins``
    (collect-all: every module's implementation runs). Keep it cheap and free of side effects.

    :param register: ``register(strategy_class)``. ``strategy_class`` must have a unique
        ``name`` (str, the value users pass as ``method``, or as ``acceptance_method`` for a
        verifier), an optional ``aliases`` tuple, an optional ``Config`` (a pydantic model with
        ``extra="forbid"`` validating the strategy's own options), an optional ``kind``
        (``"proposer"``, the default, or ``"verifier"`` or ``"modifier"``), an optional
        ``num_speculative_tokens`` class attribute (the default k, which the user's
        ``num_speculative_tokens`` overrides; an instance attribute set in ``__init__`` wins over
        both), and a constructor ``__init__(self, config, ctx)`` where ``config`` is the
        validated ``Config`` instance (``None`` when the class has no ``Config``, and always
        ``None`` for a verifier) and ``ctx`` a :class:`~speculant.spec_types.StrategyContext`
        (target model config, device, dtype, vocab size, the loaded target model).
    :return: nothing.
    """


@hookspec(firstresult=True)
def propose(batch: SpecBatch) -> Proposal | None:
    """Propose draft tokens for every sequence of a decode step.

    First-result: the first non-``None`` return is used. Called by the engine at the start of
    each speculative decode step, before the target model runs.

    :param batch: the running sequences (token ids so far, prompt lengths, the maximum number of
        draft tokens ``max_draft <= k`` allowed per sequence, and, when the strategy declares
        ``needs_hidden_states = True``, the target's hidden states of the positions verified
        since the previous call: the LM head's input, after the final norm; see
        :class:`~speculant.spec_types.SpecBatch`).
    :return: a :class:`~speculant.spec_types.Proposal` holding, per sequence, a list of 0..k draft
        token ids (different lengths in one batch are fine; 0 means "no speculation for this
        sequence this step") or a :class:`~speculant.spec_types.DraftTree` of at most
        ``max_draft`` nodes (several continuations scored in one forward with tree attention
        and verified losslessly; its own ``probs`` for sampled drafts; docs/trees.md), and
        optionally the chains' draft probabilities ``[batch, max_len, vocab]`` that produced
        them (needed for lossless sampling with a non-point-mass draft).
        Return ``None`` to let a later implementation answer.
    """


@hookspec(firstresult=True)
def score(batch: SpecBatch, proposal: Proposal) -> ScoreResult | None:
    """Run the target model over each sequence's last token plus its drafts (k_i + 1 tokens).

    First-result. The engine's built-in scorer implements it (``trylast``): one forward pass of the
    target over the flat batch, writing K/V into the paged cache. Override it only to change how
    the target is evaluated (e.g. tree attention).

    :param batch: as for :func:`propose`; its sequences already own cache slots for k_i + 1 tokens.
    :param proposal: the validated proposal.
    :return: a :class:`~speculant.spec_types.ScoreResult`: target logits ``[sum(k_i + 1), vocab]``
        (rows grouped per sequence: the k_i draft positions then the bonus position; for a tree
        sequence row 0 after the root, row i + 1 after node i) and, when
        requested, the hidden states of the same rows; optionally ``greedy`` ``[sum(k_i + 1), 2]``
        (each row's argmax and its log-probability), which lets the built-in verifier check
        greedy batches on the host. The built-in scorer's tensors may be views of its CUDA
        graph's buffers: valid during the step.
    """


@hookspec(firstresult=True)
def verify(batch: SpecBatch, proposal: Proposal, scores: ScoreResult) -> VerifyResult | None:
    """Decide which draft tokens to accept, and pick the bonus or recovered token.

    First-result. The built-in ``rejection_sampler`` plugin implements it (``trylast``): greedy
    rows accept while draft == argmax of the processed target logits; random rows use rejection
    sampling (accept with min(1, p/q), on rejection sample from normalize(max(p - q, 0))), which
    makes the output distribution exactly the target's. Sampling parameters (temperature, top-k,
    top-p, min-p, penalties, logits processors) are applied to the target logits first.
    Another verifier is a strategy class with ``kind = "verifier"``, chosen with
    ``speculative_config={..., "acceptance_method": name}``; it replaces the built-in (one
    verifier is registered per engine), so it must answer every batch. A verifier declares
    whether it keeps the output the target's (:attr:`Strategy.lossless`); one that does not
    (or does not say) is named in a warning when an engine starts with it.

    :param batch: as for :func:`propose`, with ``batch.seqs[i].sampling_params``.
    :param proposal: the drafts being verified.
    :param scores: the target's output for them. A greedy batch without logits processing that
        comes with ``scores.greedy`` is verified from it with one device read and no kernel.
    :return: a :class:`~speculant.spec_types.VerifyResult`: per sequence the list of emitted
        tokens (accepted drafts followed by exactly one bonus/recovered token; for a
        :class:`~speculant.spec_types.DraftTree`, the tokens of one root path of the tree, then
        one token: ``verify_tree_greedy`` / ``verify_tree_sampled`` give them; optionally
        ``tree_paths``, the accepted nodes, which spares the engine finding the path).
    """


@hookspec
def on_batch_size_change(old_size: int, new_size: int) -> bool | None:
    """React to a change in the number of running sequences of decode steps.

    Collect-all: every implementation runs. Called before :func:`propose` whenever the decode
    batch size differs from the previous decode step (and once for the first decode step, with
    ``old_size == 0``).

    :param old_size: previous decode batch size (0 at the start).
    :param new_size: the batch size of the step about to run.
    :return: ``False`` to turn speculation off until the next change (the step runs as plain
        decoding and proposers do no work), ``True`` to turn it (back) on, ``None`` for no opinion.
        Speculation runs when no implementation returned ``False``.
    """


@hookspec
def on_requests_finished(seq_ids: list[int]) -> None:
    """Release per-sequence state (draft KV caches, statistics) of sequences that left the batch.

    Collect-all. Called after a step in which sequences finished, were aborted or were preempted
    (a preempted sequence comes back later with the same id and all its tokens).

    :param seq_ids: ids of the sequences (``SpecSequence.seq_id``).
    :return: nothing.
    """


@hookspec
def capture_graphs(max_num_seqs: int, progress: bool) -> int | None:
    """Capture the strategy's own CUDA graphs now (its one-graph propose, its draft model's
    forwards), for every batch the engine can ask it to draft for, instead of on first use.

    Collect-all. Called once by the engine at start-up, after the target's graphs, unless
    ``EngineConfig.cuda_graph_capture`` is ``"lazy"`` (also by ``LLMEngine.capture_graphs()``;
    on the CPU too, where there is nothing to capture). Capture on padding inputs that write
    nothing (cache slot -1, context length 0) and leave every per-sequence state as it was.
    Shapes not captured here are captured on first use, as before. Implementing it is optional.

    :param max_num_seqs: the engine's ``max_num_seqs``: the most sequences a propose gets.
    :param progress: whether to show a progress bar (tqdm) while capturing.
    :return: the number of graphs captured (0 when there is nothing to capture), or ``None``.
    """


HOOK_NAMES: tuple[str, ...] = (
    "register_strategies",
    "propose",
    "score",
    "verify",
    "on_batch_size_change",
    "on_requests_finished",
    "capture_graphs",
)


StrategyKind = Literal["proposer", "verifier", "modifier"]
KINDS: tuple[str, ...] = ("proposer", "verifier", "modifier")


class Strategy:
    """The contract of a strategy class: the class attributes the engine reads, with their
    defaults. Subclassing is optional (a registered class that does not subclass it is read
    with the same defaults), but it documents the contract where the class is written.

    The engine builds the chosen class as ``cls(config, ctx)`` and registers the instance with
    its hook implementations (:func:`propose`, ...). ``num_speculative_tokens``,
    ``needs_hidden_states`` and ``aux_hidden_layers`` may also be set on the instance in
    ``__init__`` (they are read after it); the others are read from the class.
    """

    name: ClassVar[str] = ""
    """Required, unique: the value users pass as ``method`` (``acceptance_method`` for a
    verifier)."""

    aliases: ClassVar[tuple[str, ...]] = ()
    """Other names users may pass for it."""

    kind: ClassVar[StrategyKind] = "proposer"
    """``"proposer"`` (chosen by ``method``), ``"verifier"`` (chosen by ``acceptance_method``;
    see :func:`verify`) or ``"modifier"`` (the engine's own ``batch_size_disable``)."""

    Config: ClassVar[type[BaseModel] | None] = None
    """A pydantic model (``extra="forbid"``) validating the strategy's options from
    ``speculative_config``. ``None``: the only option accepted is ``num_speculative_tokens``."""

    num_speculative_tokens: int | None = None
    """The default k. The engine takes k from the instance's own value (set in ``__init__``, or
    a property) if any, else from the user's ``num_speculative_tokens`` (through ``Config`` or
    ``speculative_config``), else from this class attribute; with none of them it refuses the
    configuration."""

    needs_hidden_states: bool = False
    """``True``: :func:`propose` gets the target's hidden states of the positions verified since
    the previous call (``SpecBatch.hidden_states``, the LM head's input)."""

    aux_hidden_layers: tuple[int, ...] = ()
    """Target layers whose inputs (the residual stream before the layer's norm) come in
    ``SpecBatch.aux_hidden_states``, concatenated in this order (EAGLE-3)."""

    default_for_model: ClassVar[bool] = False
    """``True``: the method of a ``speculative_config`` ``model`` that no strategy's
    :meth:`matches_model` recognises (the draft model)."""

    lossless: ClassVar[bool | None] = None
    """Whether the engine's output stays exactly the target's with this strategy: greedy output
    equal to plain greedy decoding token for token, sampled output following the target
    distribution. Only a class that decides the output can break that, so only such a class
    declares it: one with ``kind = "verifier"`` or one implementing :func:`verify` or
    :func:`score` must set ``True`` (it keeps the guarantee, e.g. the built-in
    ``rejection_sampler``) or ``False`` (it trades it for speed, e.g. "accept a draft in the
    target's top 2"); left ``None`` it is treated as lossy. A class that only proposes is
    lossless whatever it drafts (``None`` means ``True``). A lossy strategy is logged as a
    warning naming it and its plugin when an engine starts with it, marked ``LOSSY`` in
    ``speculant plugins``, and sets ``SpecMetrics.lossless = False``."""

    @classmethod
    def matches_model(cls, path: Path, config: dict[str, Any]) -> bool:
        """Whether the checkpoint folder ``path`` (with its parsed ``config.json``, ``{}`` when
        absent) is this strategy's, to infer ``method`` from a ``model`` alone. Default: no."""
        return False

    def __init__(self, config: BaseModel | None, ctx: StrategyContext) -> None:
        """``config``: the validated ``Config`` instance (``None`` without a ``Config``, and
        always ``None`` for a verifier); ``ctx``: what the strategy knows of the target and the
        engine (:class:`~speculant.spec_types.StrategyContext`)."""
        self.config = config
        self.ctx = ctx


@dataclass(frozen=True)
class StrategyInfo:
    """A strategy class's attributes as the engine reads them, checked against
    :class:`Strategy` and with its defaults filled in (:func:`strategy_info`)."""

    cls: type
    plugin: str  # the plugin (entry point) that registered it; "" when unknown
    name: str
    aliases: tuple[str, ...]
    kind: StrategyKind
    Config: type[BaseModel] | None
    # read from a class: its default k; from an instance: the k it settled on itself (None when
    # it left k to the user's value or the class default)
    num_speculative_tokens: int | None
    needs_hidden_states: bool
    aux_hidden_layers: tuple[int, ...]
    default_for_model: bool
    matches_model: Callable[[Path, dict[str, Any]], bool]
    # whether the output stays the target's (Strategy.lossless, None resolved: True for a class
    # that only proposes, False for an undeclared one that decides the output) and whether the
    # class declared it itself
    lossless: bool = True
    lossless_declared: bool = False


def strategy_info(strategy: type | object, plugin: str = "") -> StrategyInfo:
    """Check a strategy class (or an instance of it) against the :class:`Strategy` contract and
    return its attributes, the contract's defaults where it has none.

    :param strategy: a registered class, or the instance the engine built from it (then
        ``num_speculative_tokens``, ``needs_hidden_states`` and ``aux_hidden_layers`` are read
        through the instance, so values set in ``__init__`` count).
    :param plugin: the plugin that registered it, for error messages.
    :return: a :class:`StrategyInfo`.
    :raises StrategyError: an attribute has the wrong type; the message names the plugin, the
        class and the attribute.
    """
    from speculant.spec_types import StrategyError

    cls = strategy if isinstance(strategy, type) else type(strategy)
    where = f"plugin {plugin!r}: strategy class {cls.__module__}.{cls.__qualname__}"

    def fail(attr: str, want: str, value: Any) -> StrategyError:
        return StrategyError(f"{where}: `{attr}` must be {want}, got {value!r} "
                             f"({type(value).__name__}); see speculant.hookspecs.Strategy")

    def is_int(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise StrategyError(f"{where} has no `name` (a non-empty str: the `method` users pass)"
                            if name in (None, "") else fail("name", "a non-empty str", name))
    aliases = getattr(cls, "aliases", None) or ()
    if (not isinstance(aliases, (tuple, list))
            or not all(isinstance(a, str) and a for a in aliases)):
        raise fail("aliases", "a tuple of non-empty str", aliases)
    kind = getattr(cls, "kind", None) or "proposer"
    if kind not in KINDS:
        raise fail("kind", f"one of {', '.join(map(repr, KINDS))}", kind)
    config_cls = getattr(cls, "Config", None)
    if config_cls is not None:
        from pydantic import BaseModel

        if not (isinstance(config_cls, type) and issubclass(config_cls, BaseModel)):
            raise fail("Config", "a pydantic BaseModel subclass or None", config_cls)
    default_for_model = getattr(cls, "default_for_model", False)
    if not isinstance(default_for_model, bool):
        raise fail("default_for_model", "a bool", default_for_model)
    lossless = getattr(cls, "lossless", None)
    if lossless is not None and not isinstance(lossless, bool):
        raise fail("lossless", "a bool (None: not declared)", lossless)
    lossless_declared = lossless is not None
    if not lossless_declared:  # a proposer cannot change the output; a verifier must say it does not
        lossless = not decides_output(cls, kind)
    matches = getattr(cls, "matches_model", None)
    if matches is None:
        matches = Strategy.matches_model
    elif not callable(matches):
        raise fail("matches_model", "a classmethod (path, config) -> bool", matches)

    def per_instance(attr: str, default: Any) -> Any:
        """``attr`` read through the instance; on a class, a property gives the default."""
        value = getattr(strategy, attr, default)
        return default if isinstance(value, property) else value

    declared = getattr(cls, "num_speculative_tokens", None)
    if isinstance(strategy, type):  # the default k
        k = None if isinstance(declared, property) else declared
    elif isinstance(declared, property):  # the instance's own k
        k = strategy.num_speculative_tokens
    else:  # an instance: only a value it set itself
        k = getattr(strategy, "__dict__", {}).get("num_speculative_tokens")
    if k is not None and not (is_int(k) and k >= 1):
        raise fail("num_speculative_tokens", "an int >= 1 or None", k)
    needs_hidden = per_instance("needs_hidden_states", False)
    if not isinstance(needs_hidden, bool):
        raise fail("needs_hidden_states", "a bool", needs_hidden)
    aux = per_instance("aux_hidden_layers", None) or ()
    if not isinstance(aux, (tuple, list)) or not all(is_int(i) and i >= 0 for i in aux):
        raise fail("aux_hidden_layers", "a tuple of layer indices (int >= 0)", aux)
    return StrategyInfo(
        cls=cls, plugin=plugin, name=name, aliases=tuple(aliases), kind=kind, Config=config_cls,
        num_speculative_tokens=k, needs_hidden_states=needs_hidden, aux_hidden_layers=tuple(aux),
        default_for_model=default_for_model, matches_model=matches, lossless=lossless,
        lossless_declared=lossless_declared,
    )


def decides_output(cls: type, kind: str) -> bool:
    """Whether a strategy class decides which tokens are emitted (a verifier, or a class with
    its own :func:`verify` or :func:`score`), so it must declare :attr:`Strategy.lossless`."""
    return kind == "verifier" or any(
        hasattr(getattr(cls, hook, None), f"{PROJECT_NAME}_impl") for hook in ("verify", "score")
    )


__all__ = [
    "hookimpl", "hookspec", "HOOK_NAMES", "Any", "Strategy", "StrategyInfo", "StrategyKind",
    "decides_output", "strategy_info",
]
