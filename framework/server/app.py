"""The OpenAI-compatible HTTP API: /v1/models, /v1/completions, /v1/chat/completions (both with
SSE streaming), /health and /metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from speculant.outputs import RequestOutput
from speculant.server.async_engine import (
    Accepted,
    AsyncEngine,
    Delta,
    Failed,
    Finished,
    Handle,
    Overloaded,
    PromptInput,
)
from speculant.server.metrics import ServerMetrics
from speculant.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprobs,
    check_against_model,
    completion_logprobs,
    validation_error,
)

logger = logging.getLogger("speculant.server")

_POLL_S = 0.25  # how often a non-streaming handler checks whether its client is still there


class ClientGone(Exception):
    pass


def _error(e: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 503 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class OpenAIServer:
    def __init__(self, aengine: AsyncEngine, served_model_names: list[str],
                 api_key: str | None = None, metrics: ServerMetrics | None = None,
                 model_root: str | None = None, split_special_tokens: bool = False) -> None:
        """``split_special_tokens``: the default of chat requests' field of that name (encode each
        message's content as plain text, so control strings in it stay text)."""
        self.a = aengine
        self.names = list(served_model_names)
        self.api_key = api_key
        self.metrics = metrics or ServerMetrics(self.names[0])
        self.model_root = model_root
        self.created = int(time.time())
        self.tokenizer = aengine.tokenizer
        self.split_special_tokens = split_special_tokens
        self.app = self._build()

    # ----------------------------------------------------------------- app
    def _build(self) -> FastAPI:
        app = FastAPI(title="speculant", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(RequestValidationError)
        async def _bad_request(request: Request, exc: RequestValidationError):
            return _error(validation_error(list(exc.errors())))

        @app.exception_handler(APIError)
        async def _api_error(request: Request, exc: APIError):
            return _error(exc)

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(request: Request, exc: StarletteHTTPException):
            # unknown routes (404) and wrong methods (405): OpenAI's shape, not {"detail": ...}
            where = f"{request.method} {request.url.path}"
            if exc.status_code == 404:
                msg = f"Invalid URL ({where}): no such endpoint"
            elif exc.status_code == 405:
                allow = (exc.headers or {}).get("Allow") or (exc.headers or {}).get("allow")
                msg = f"Method not allowed ({where})" + (f"; use {allow}" if allow else "")
            else:
                msg = str(exc.detail)
            e = APIError(exc.status_code, msg)
            return JSONResponse(e.body(), status_code=exc.status_code, headers=exc.headers)

        @app.exception_handler(Exception)
        async def _unexpected(request: Request, exc: Exception):  # Starlette logs it
            return _error(APIError(500, f"internal error: {type(exc).__name__}"))

        app.add_middleware(_AuthAndCount, server=self)

        @app.get("/health")
        async def health():
            used, total = self.a.kv_blocks()
            ok = self.a.alive
            body = {"status": "ok" if ok else "engine thread stopped", "kv_blocks_used": used,
                    "kv_blocks_total": total, "num_running": self.a.num_running(),
                    "num_waiting": self.a.num_waiting(), "inflight_seqs": self.a.inflight_seqs,
                    "engine_steps": self.a.num_steps}
            return JSONResponse(body, status_code=200 if ok else 503)

        @app.get("/metrics")
        async def metrics():
            return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models():
            data = [{"id": n, "object": "model", "created": self.created, "owned_by": "speculant",
                     "root": self.model_root, "max_model_len": self.a.engine.max_model_len}
                    for n in self.names]
            return {"object": "list", "data": data}

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, request: Request):
            return await self._completions(body, request)

        @app.post("/v1/chat/completions")
        async def chat(body: ChatCompletionRequest, request: Request):
            return await self._chat(body, request)

        return app

    def _authorized(self, headers: Headers) -> bool:
        auth = headers.get("authorization", "")
        scheme, _, key = auth.partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(key.strip().encode(),
                                                                      self.api_key.encode())

    def _model(self, name: str | None) -> str:
        if name is None or name == "":
            return self.names[0]
        if name not in self.names:
            raise APIError(404, f"The model `{name}` does not exist; this server serves "
                           f"{', '.join(self.names)}", "model", code="model_not_found")
        return name

    # ----------------------------------------------------------------- shared machinery
    def _submit(self, prompts: list[PromptInput], params, stream: bool, prefix: str) -> Handle:
        if len(prompts) * params.n > self.a.max_inflight_seqs:
            raise APIError(400, f"n x prompts = {len(prompts) * params.n} sequences is more than "
                           f"this server ever holds ({self.a.max_inflight_seqs})", "n")
        if not self.a.alive:
            raise APIError(503, "the engine loop is not running")
        try:
            return self.a.submit(prompts, params, stream, prefix)
        except Overloaded as e:
            raise APIError(503, str(e)) from None

    async def _next(self, handle: Handle, request: Request):
        """The handle's next event, checking now and then that the client is still there."""
        while True:
            try:
                return await asyncio.wait_for(handle.queue.get(), _POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    raise ClientGone() from None

    async def _accepted(self, handle: Handle, request: Request) -> Accepted:
        ev = await self._next(handle, request)
        if isinstance(ev, Failed):
            handle.finished = True
            raise APIError(ev.status, ev.message, ev.param)
        assert isinstance(ev, Accepted), ev
        return ev

    async def _collect(self, handle: Handle, request: Request) -> list[RequestOutput]:
        outs: list[RequestOutput | None] = [None] * len(handle.rids)
        while any(o is None for o in outs):
            ev = await self._next(handle, request)
            if isinstance(ev, Failed):
                raise APIError(ev.status, ev.message, ev.param)
            if isinstance(ev, Finished):
                outs[ev.sub] = ev.output
        handle.finished = True
        return outs  # type: ignore[return-value]

    async def _run_unary(self, handle: Handle, request: Request, endpoint: str, build):
        t0 = time.perf_counter()
        try:
            acc = await self._accepted(handle, request)
            outs = await self._collect(handle, request)
            return build(acc, outs)
        except ClientGone:
            return Response(status_code=499)
        finally:
            self.a.close(handle)
            self.metrics.http_latency.labels(endpoint).observe(time.perf_counter() - t0)

    async def _stream_start(self, handle: Handle, request: Request) -> Accepted | Response:
        """Wait until the engine took the request, so that a bad prompt still gets a 400."""
        try:
            return await self._accepted(handle, request)
        except ClientGone:
            self.a.close(handle)
            return Response(status_code=499)
        except BaseException:
            self.a.close(handle)
            raise

    def _stream_response(self, handle: Handle, request: Request, endpoint: str,
                         chunks: AsyncIterator[str]) -> StreamingResponse:
        t0 = time.perf_counter()

        async def body():
            try:
                async for c in chunks:
                    yield c
                yield "data: [DONE]\n\n"
            finally:  # also when the client disconnected (this generator is cancelled)
                self.a.close(handle)

        def done():
            self.a.close(handle)
            self.metrics.http_latency.labels(endpoint).observe(time.perf_counter() - t0)

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"},
                                 background=BackgroundTask(done))

    async def _deltas(self, handle: Handle, request: Request) -> AsyncIterator[Delta]:
        """Yield Delta events until every sub-request finished; the finished outputs are left in
        ``handle.outputs``."""
        remaining = len(handle.rids)
        handle.outputs = [None] * remaining
        while remaining:
            ev = await handle.queue.get()
            if isinstance(ev, Failed):
                raise APIError(ev.status, ev.message, ev.param)
            if isinstance(ev, Delta):
                yield ev
            elif isinstance(ev, Finished):
                handle.outputs[ev.sub] = ev.output
                remaining -= 1
        handle.finished = True

    @staticmethod
    def _usage(outs: list[RequestOutput]) -> dict[str, int]:
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    # ----------------------------------------------------------------- /v1/completions
    async def _completions(self, body: CompletionRequest, request: Request):
        model = self._model(body.model)
        params = body.sampling_params()
        prompts = self._completion_prompts(body.prompt)
        check_against_model(params, [p.token_ids for p in prompts if p.token_ids is not None],
                            self.a.engine.vocab_size, body.param_names())
        handle = self._submit(prompts, params, body.stream, "cmpl")
        rid, created, n = handle.id, int(time.time()), params.n
        lp_n = body.logprobs

        def logprobs_of(out: RequestOutput, comp, prompt_text: str):
            if lp_n is None:
                return None
            if body.echo:
                plp = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
                return completion_logprobs(out.prompt_token_ids + comp.token_ids,
                                           list(plp) + list(comp.logprobs or []), lp_n, 0,
                                           self.tokenizer)
            return completion_logprobs(comp.token_ids, comp.logprobs or [], lp_n, 0, self.tokenizer)

        if not body.stream:
            def build(acc: Accepted, outs: list[RequestOutput]):
                choices = []
                for sub, out in enumerate(outs):
                    ptext = acc.prompts[sub][0]
                    for comp in out.outputs:
                        choices.append({
                            "index": sub * n + comp.index,
                            "text": (ptext if body.echo else "") + comp.text,
                            "logprobs": logprobs_of(out, comp, ptext),
                            "finish_reason": comp.finish_reason,
                            "stop_reason": comp.stop_reason,
                        })
                return {"id": rid, "object": "text_completion", "created": created,
                        "model": model, "choices": choices, "usage": self._usage(outs)}

            return await self._run_unary(handle, request, "/v1/completions", build)

        acc = await self._stream_start(handle, request)
        if not isinstance(acc, Accepted):
            return acc
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(choices, usage=None):
            return {"id": rid, "object": "text_completion", "created": created, "model": model,
                    "choices": choices, "usage": usage}

        async def gen():
            echoed: set[int] = set()
            offsets: dict[int, int] = {}
            async for d in self._deltas(handle, request):
                idx = d.sub * n + d.index
                ptext, pids = acc.prompts[d.sub]
                if body.echo and idx not in echoed:
                    echoed.add(idx)
                    lp = None
                    if lp_n is not None:
                        plp = d.prompt_logprobs or [None] * len(pids)
                        lp = completion_logprobs(pids, list(plp), lp_n, 0, self.tokenizer)
                        offsets[idx] = len("".join(lp["tokens"]))
                    yield _sse(chunk([{"index": idx, "text": ptext, "logprobs": lp,
                                       "finish_reason": None, "stop_reason": None}]))
                lp = None
                if lp_n is not None and d.logprobs is not None:
                    lp = completion_logprobs(d.token_ids, d.logprobs, lp_n, offsets.get(idx, 0),
                                             self.tokenizer)
                    offsets[idx] = offsets.get(idx, 0) + len("".join(lp["tokens"]))
                yield _sse(chunk([{"index": idx, "text": d.text, "logprobs": lp,
                                   "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}]))
            if include_usage:
                yield _sse(chunk([], self._usage(handle.outputs)))

        return self._stream_response(handle, request, "/v1/completions", _guard(gen()))

    @staticmethod
    def _completion_prompts(prompt) -> list[PromptInput]:
        if isinstance(prompt, str):
            return [PromptInput(text=prompt)]
        if not prompt:
            raise APIError(400, "prompt must not be empty", "prompt")
        if all(isinstance(p, int) for p in prompt):
            return [PromptInput(token_ids=list(prompt))]
        if all(isinstance(p, str) for p in prompt):
            return [PromptInput(text=p) for p in prompt]
        if all(isinstance(p, list) for p in prompt):
            if any(not p for p in prompt):
                raise APIError(400, "prompt token lists must not be empty", "prompt")
            return [PromptInput(token_ids=list(p)) for p in prompt]
        raise APIError(400, "prompt must be a string, a list of strings, a list of token ids or "
                       "a list of token-id lists", "prompt")

    # ----------------------------------------------------------------- /v1/chat/completions
    async def _chat(self, body: ChatCompletionRequest, request: Request):
        model = self._model(body.model)
        params = body.sampling_params()
        messages = body.chat_messages()
        check_against_model(params, [], self.a.engine.vocab_size, body.param_names())
        split = (body.split_special_tokens if body.split_special_tokens is not None
                 else self.split_special_tokens)
        handle = self._submit([PromptInput(messages=messages, split_special_tokens=split)], params,
                              body.stream, "chatcmpl")
        rid, created = handle.id, int(time.time())
        top_n = body.top_logprobs or 0

        if not body.stream:
            def build(acc: Accepted, outs: list[RequestOutput]):
                out = outs[0]
                choices = []
                for comp in out.outputs:
                    lp = None
                    if body.logprobs:
                        lp = chat_logprobs(comp.token_ids, comp.logprobs or [], top_n, self.tokenizer)
                    choices.append({
                        "index": comp.index,
                        "message": {"role": "assistant", "content": comp.text},
                        "logprobs": lp, "finish_reason": comp.finish_reason,
                        "stop_reason": comp.stop_reason,
                    })
                return {"id": rid, "object": "chat.completion", "created": created,
                        "model": model, "choices": choices, "usage": self._usage(outs)}

            return await self._run_unary(handle, request, "/v1/chat/completions", build)

        acc = await self._stream_start(handle, request)
        if not isinstance(acc, Accepted):
            return acc
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(choices, usage=None):
            return {"id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": model, "choices": choices, "usage": usage}

        async def gen():
            for i in range(params.n):
                yield _sse(chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None}]))
            async for d in self._deltas(handle, request):
                lp = None
                if body.logprobs and d.logprobs is not None:
                    lp = chat_logprobs(d.token_ids, d.logprobs, top_n, self.tokenizer)
                if d.text or lp is not None:
                    yield _sse(chunk([{"index": d.index, "delta": {"content": d.text},
                                       "logprobs": lp, "finish_reason": None}]))
                if d.finish_reason is not None:
                    yield _sse(chunk([{"index": d.index, "delta": {}, "logprobs": None,
                                       "finish_reason": d.finish_reason,
                                       "stop_reason": d.stop_reason}]))
            if include_usage:
                yield _sse(chunk([], self._usage(handle.outputs)))

        return self._stream_response(handle, request, "/v1/chat/completions", _guard(gen()))


_ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")


class _AuthAndCount:
    """Pure ASGI middleware (BaseHTTPMiddleware would hide client disconnects from handlers):
    the API key check on /v1/*, and request counts by endpoint and status."""

    def __init__(self, app, server: OpenAIServer) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in _ENDPOINTS else "other"
        started = []
        count = self.server.metrics.http_requests

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start" and not started:
                started.append(True)
                count.labels(endpoint, str(message["status"])).inc()
            await send(message)

        srv = self.server
        try:
            if (path.startswith("/v1/") and srv.api_key is not None
                    and not srv._authorized(Headers(scope=scope))):
                resp = _error(APIError(401, "missing or incorrect API key; send "
                                       "'Authorization: Bearer <key>'", code="invalid_api_key"))
                await resp(scope, receive, counting_send)
            else:
                await self.app(scope, receive, counting_send)
        finally:
            if not started:  # failed before answering
                count.labels(endpoint, "500").inc()


async def _guard(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Once a stream has started, errors can only be reported inside it (OpenAI's shape)."""
    try:
        async for c in chunks:
            yield c
    except APIError as e:
        yield _sse(e.body())
    except Exception as e:  # noqa: BLE001 - report, do not drop the connection silently
        logger.exception("stream failed")
        yield _sse(APIError(500, f"{type(e).__name__}: {e}").body())
