"""One engine loop for the server.

A background thread owns the :class:`LLMEngine` and calls ``step()`` while there is work, so all
in-flight requests are batched continuously. Request handlers run on the asyncio event loop; they
hand work to the engine thread through a thread-safe command queue and receive their events
(accepted / text deltas / finished / failed) through an ``asyncio.Queue`` fed with
``loop.call_soon_threadsafe``. Everything that touches the engine or its tokenizer runs on the
engine thread.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from speculant.engine.spec_decode import StrategyFault
from speculant.outputs import CompletionOutput, Logprob, RequestOutput, SpecMetrics
from speculant.sampling_params import SamplingParams

logger = logging.getLogger("speculant.server")


class Overloaded(Exception):
    """The bounded waiting queue is full."""


@dataclass
class PromptInput:
    """One prompt: text, token ids, or chat messages (rendered with the tokenizer's template)."""

    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    split_special_tokens: bool = False  # chat: content's control strings stay text (protocol.py)


# ----------------------------------------------------------------- events (engine -> handler)
@dataclass
class Accepted:
    prompts: list[tuple[str, list[int]]]  # per sub-request: (prompt text, prompt token ids)


@dataclass
class Delta:
    sub: int  # which prompt of the request
    index: int  # which of its n outputs
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # first delta of each output


@dataclass
class Finished:
    sub: int
    output: RequestOutput


@dataclass
class Failed:
    status: int
    message: str
    param: str | None = None


@dataclass
class Handle:
    """A server request: one engine request per prompt, events on ``queue``."""

    id: str
    rids: list[str]
    num_seqs: int
    stream: bool
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False
    closed: bool = False
    outputs: list[RequestOutput | None] = field(default_factory=list)  # streaming: set at the end


class IncrementalDetokenizer:
    """Text of a growing list of token ids, decoding only the tokens since the previous call (plus
    those of the call before, as context), so streaming costs O(new tokens) per step, not
    O(all tokens). Text ending in half a UTF-8 character is held back until it completes."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""  # the text of ids[:read_offset]
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, ids: list[int]) -> str:
        """``ids``: all tokens so far (a prefix of the next call's). Returns the text so far."""
        if len(ids) <= self.read_offset:
            return self.text
        prefix = self._decode(ids[self.prefix_offset:self.read_offset])
        new = self._decode(ids[self.prefix_offset:])
        if len(new) > len(prefix) and not new.endswith("\ufffd"):
            self.text += new[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return self.text


@dataclass
class _SeqState:
    sent_tokens: int = 0
    sent_text: str = ""
    done: bool = False
    first: bool = True  # nothing sent yet
    detok: IncrementalDetokenizer | None = None


@dataclass
class _Track:
    """Engine-thread bookkeeping of one engine request."""

    handle: Handle
    sub: int
    holdback: int  # characters held back while a stop string could still be forming
    want_prompt_logprobs: bool
    skip_special_tokens: bool
    seqs: list[_SeqState]


class AsyncEngine:
    """Runs an LLMEngine on a background thread and serves many concurrent requests.

    ``max_waiting_seqs`` bounds the queue: a request is refused (:class:`Overloaded`) when the
    sequences in flight would exceed ``max_num_seqs + max_waiting_seqs``.
    """

    def __init__(self, engine, max_waiting_seqs: int = 256, metrics=None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_num_seqs = engine.config.max_num_seqs
        self.max_inflight_seqs = self.max_num_seqs + max_waiting_seqs
        self.metrics = metrics
        self.inflight_seqs = 0  # event-loop thread only
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._tracks: dict[str, _Track] = {}  # engine thread only
        self._spec = SpecMetrics()  # copy published after every step
        self._spec_lock = threading.Lock()
        self.num_steps = 0
        self._thread = threading.Thread(target=self._run, name="speculant-engine", daemon=True)

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ----------------------------------------------------------------- handler side (event loop)
    def submit(self, prompts: list[PromptInput], params: SamplingParams, stream: bool,
               prefix: str = "req") -> Handle:
        num_seqs = len(prompts) * params.n
        if self.inflight_seqs + num_seqs > self.max_inflight_seqs:
            raise Overloaded(
                f"the server is overloaded: {self.inflight_seqs} sequences in flight, room for "
                f"{self.max_inflight_seqs} ({self.max_num_seqs} running + waiting queue); retry later"
            )
        hid = f"{prefix}-{uuid.uuid4().hex}"
        rids = [f"{hid}-{i}" for i in range(len(prompts))]
        handle = Handle(hid, rids, num_seqs, stream, asyncio.get_running_loop())
        self.inflight_seqs += num_seqs
        self._send(("add", handle, prompts, params))
        return handle

    def close(self, handle: Handle) -> None:
        """Release the handle's seats; abort what it still runs (client gone or error). Idempotent."""
        if handle.closed:
            return
        handle.closed = True
        self.inflight_seqs -= handle.num_seqs
        if not handle.finished:
            self._send(("abort", handle))

    def spec_metrics(self) -> SpecMetrics:
        with self._spec_lock:
            return copy.deepcopy(self._spec)

    def kv_blocks(self) -> tuple[int, int]:
        """(used, total) KV cache blocks."""
        bm = self.engine.block_manager
        return bm.num_blocks - bm.num_free_blocks, bm.num_blocks

    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting)

    def _send(self, cmd) -> None:
        self._cmds.put(cmd)
        self._wake.set()

    # ----------------------------------------------------------------- engine thread
    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain()
            if not self.engine.has_unfinished_requests():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                finished = self.engine.step()
                self.num_steps += 1
                self._publish(finished)
            except StrategyFault as e:  # a plugin failed the requests of one step: only those
                logger.exception("speculative decoding failed for %d request(s)",
                                 len(e.request_ids))
                self._fail_some(e.request_ids, e.public_message)
            except Exception as e:  # keep serving: fail what was in flight, free its blocks
                logger.exception("engine step failed")
                # the error's text may be about any request in flight: it goes to a client
                # only when that client's request is the only one
                detail = f": {e}" if len(self._tracks) <= 1 else " (details in the server log)"
                self._fail_all(f"engine error: {type(e).__name__}{detail}")
        self._fail_all("the server is shutting down")

    def _drain(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            try:
                if cmd[0] == "add":
                    self._add(*cmd[1:])
                elif cmd[0] == "abort":
                    self._abort(cmd[1])
            except Exception as e:
                logger.exception("server command %s failed", cmd[0])
                self._emit(cmd[1], Failed(500, f"{type(e).__name__}: {e}"))

    def _add(self, handle: Handle, prompts: list[PromptInput], params: SamplingParams) -> None:
        if handle.closed:
            return
        holdback = max((len(s) for s in params.stop_strings), default=1) - 1
        if params.include_stop_str_in_output:
            holdback = 0
        added: list[str] = []
        accepted: list[tuple[str, list[int]]] = []
        for sub, (rid, p) in enumerate(zip(handle.rids, prompts)):
            param = "messages" if p.messages is not None else "prompt"
            try:
                text, ids = self._tokenize(p)
                self.engine.add_request(rid, text, ids, params)
            except Exception as e:
                for r in added:
                    self.engine.abort_request(r)
                    self._tracks.pop(r, None)
                if isinstance(e, ValueError):  # the engine's own checks: a bad prompt
                    self._emit(handle, Failed(400, str(e), param))
                else:
                    logger.exception("adding request %s failed", rid)
                    self._emit(handle, Failed(500, f"{type(e).__name__}: {e}"))
                return
            added.append(rid)
            accepted.append((text, ids))
            self._tracks[rid] = _Track(handle, sub, holdback, params.prompt_logprobs is not None,
                                       params.skip_special_tokens,
                                       [_SeqState() for _ in range(params.n)])
        self._emit(handle, Accepted(accepted))

    def _tokenize(self, p: PromptInput) -> tuple[str, list[int]]:
        tok = self.tokenizer
        if p.messages is not None:
            if tok is None:
                raise ValueError("chat needs a tokenizer")
            try:
                if p.split_special_tokens:
                    from speculant.server.protocol import chat_prompt_ids
                    ids = chat_prompt_ids(tok, p.messages)
                else:
                    ids = tok.apply_chat_template(p.messages, add_generation_prompt=True,
                                                  tokenize=True)
            except Exception as e:
                raise ValueError(f"cannot apply the chat template: {e}") from None
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            ids = list(ids)
            return tok.decode(ids), ids
        if p.token_ids is not None:
            ids = list(p.token_ids)
            return (tok.decode(ids) if tok is not None else ""), ids
        if tok is None:
            raise ValueError("text prompts need a tokenizer; send token ids")
        return p.text or "", list(tok(p.text).input_ids)

    def _abort(self, handle: Handle) -> None:
        for rid in handle.rids:
            if self._tracks.pop(rid, None) is not None:
                self.engine.abort_request(rid)
                if self.metrics is not None:
                    self.metrics.request_aborted()

    def _fail_some(self, rids: list[str], message: str) -> None:
        """Abort the engine requests ``rids`` and fail their server requests (all of each one's
        prompts) with ``message``; the others run on."""
        handles = {id(tr.handle): tr.handle for r in rids if (tr := self._tracks.get(r))}
        for rid in rids:
            if rid not in self._tracks:
                self.engine.abort_request(rid)  # not a server request: still stop it
        for handle in handles.values():
            for rid in handle.rids:
                if self._tracks.pop(rid, None) is not None:
                    self.engine.abort_request(rid)
            self._emit(handle, Failed(500, message))

    def _fail_all(self, message: str) -> None:
        status = 503 if self._stop.is_set() else 500
        for rid, tr in list(self._tracks.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("aborting %s failed", rid)
            self._emit(tr.handle, Failed(status, message))
        self._tracks.clear()

    def _publish(self, finished: list[RequestOutput]) -> None:
        for out in finished:
            if out.error is not None:  # the engine aborted it (its logits processor failed)
                self._fail_some([out.request_id], out.error)
                continue
            tr = self._tracks.pop(out.request_id, None)
            if tr is None:
                continue  # aborted earlier
            if tr.handle.stream:
                for comp in out.outputs:
                    self._stream_delta(tr, out, comp, final_text=comp.text)
            if self.metrics is not None:
                self.metrics.request_finished(out)
            self._emit(tr.handle, Finished(tr.sub, out))
        for rid, tr in self._tracks.items():
            if not tr.handle.stream:
                continue
            snap = self.engine.snapshot(rid, detokenize=False)  # text: incrementally, below
            if snap is None:
                continue
            for comp in snap.outputs:
                final = None
                if comp.finish_reason is not None:  # one output of n finished before the others
                    final = comp.text if isinstance(comp.stop_reason, str) else self._decode(
                        comp.token_ids, tr.skip_special_tokens)
                self._stream_delta(tr, snap, comp, final_text=final)
        with self._spec_lock:
            self._spec = copy.deepcopy(self.engine.spec_metrics())

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _stream_delta(self, tr: _Track, out: RequestOutput, comp: CompletionOutput,
                      final_text: str | None) -> None:
        """Send what ``comp`` generated since the last delta. ``final_text``: its whole text,
        once it finished."""
        st = tr.seqs[comp.index]
        if st.done:
            return
        done = comp.finish_reason is not None
        if done:
            text = final_text if final_text is not None else comp.text
        else:
            if st.detok is None:
                st.detok = IncrementalDetokenizer(self.tokenizer, tr.skip_special_tokens)
            text = st.detok.update(comp.token_ids) if self.tokenizer is not None else ""
            text = text[: max(0, len(text) - tr.holdback)]
        if text.startswith(st.sent_text) or done:
            # (if detokenization changed earlier text, send what is new past what was sent)
            delta = text[len(st.sent_text):]
        else:
            delta = ""
        new_ids = comp.token_ids[st.sent_tokens:]
        if not done and (not delta or not new_ids):
            return
        lps = comp.logprobs[st.sent_tokens:] if comp.logprobs is not None else None
        plp = out.prompt_logprobs if tr.want_prompt_logprobs and st.first else None
        st.first = False
        st.sent_tokens = len(comp.token_ids)
        st.sent_text += delta
        st.done = done
        self._emit(tr.handle, Delta(tr.sub, comp.index, delta, list(new_ids), lps,
                                    comp.finish_reason, comp.stop_reason, plp))

    def _emit(self, handle: Handle, event) -> None:
        try:
            handle.loop.call_soon_threadsafe(handle.queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass
