"""OpenAI request bodies (pydantic; types only, ranges are SamplingParams' job), the mapping to
SamplingParams, OpenAI error JSON, and the logprobs formats."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from speculant.outputs import Logprob
from speculant.sampling_params import SamplingParams, field_range

MAX_LOGPROBS = 20


class APIError(Exception):
    """An error answered in OpenAI's JSON shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or _TYPES.get(
            status, "invalid_request_error" if 400 <= status < 500 else "server_error")
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 503: "service_unavailable_error"}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions (vLLM extensions included)."""

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's beam-search extensions: refused by SamplingParams with a clear message unless neutral
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    early_stopping: bool | str | None = None

    def _common(self) -> dict[str, Any]:
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", "stream_options")
        names = ("n", "stop", "stop_token_ids", "seed", "temperature", "top_p", "top_k", "min_p",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                 "ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                 "use_beam_search", "length_penalty", "early_stopping")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if self.logprobs is not None and self.logprobs > MAX_LOGPROBS:
            raise APIError(400, f"logprobs must be <= {MAX_LOGPROBS}", "logprobs")
        kw = self._common()
        kw["max_tokens"] = self.max_tokens
        if self.best_of is not None:
            if self.stream and self.best_of > self.n:
                raise APIError(400, "best_of > n cannot be streamed (the n best are known only "
                               "at the end); set stream: false or best_of: n", "best_of")
            kw["best_of"] = self.best_of
        if self.logprobs is not None:
            kw["logprobs"] = self.logprobs
            if self.echo:
                kw["prompt_logprobs"] = self.logprobs
        return make_params(kw, self.param_names())

    @staticmethod
    def param_names() -> dict[str, str]:
        """SamplingParams field -> the request field it comes from, where they differ."""
        return {"prompt_logprobs": "logprobs"}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # speculant's extension: encode each message's content with split_special_tokens=True, so
    # control strings in it (e.g. "<|im_start|>system") stay text; None: the server's default
    split_special_tokens: bool | None = None

    def sampling_params(self) -> SamplingParams:
        if self.tools:
            raise APIError(400, "tools are not supported", "tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise APIError(400, "only response_format {'type': 'text'} is supported",
                           "response_format")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}]", "top_logprobs")
        kw = self._common()
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        kw["max_tokens"] = limit
        if self.logprobs:
            kw["logprobs"] = self.top_logprobs or 0
        return make_params(kw, self.param_names())

    def param_names(self) -> dict[str, str]:
        """SamplingParams field -> the request field it comes from, where they differ."""
        names = {"logprobs": "top_logprobs" if self.top_logprobs is not None else "logprobs"}
        if self.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        return names

    def chat_messages(self) -> list[dict[str, Any]]:
        out = []
        for i, m in enumerate(self.messages):
            content = m.content
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                parts = []
                for part in content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise APIError(400, f"messages[{i}].content: only text content parts "
                                       "are supported", f"messages[{i}].content")
                    parts.append(part["text"])
                content = "".join(parts)
            msg: dict[str, Any] = {"role": m.role, "content": content or ""}
            if m.name:
                msg["name"] = m.name
            out.append(msg)
        return out


def make_params(kw: dict[str, Any], names: dict[str, str] | None = None) -> SamplingParams:
    """SamplingParams(**kw), or a 400 naming the request field (``names`` maps a SamplingParams
    field to the request field it came from) and its valid range."""
    try:
        return SamplingParams(**kw)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err.get("loc", ()) if x != "__root__"]
        field = loc[0] if loc else None
        msg = err.get("msg", str(e)).removeprefix("Value error, ")
        if field is None:  # a check across fields: its message starts with the field to change
            first = re.split(r"[ (:,]", msg, maxsplit=1)[0]
            if first not in SamplingParams.model_fields:
                raise APIError(400, msg) from None
            param = (names or {}).get(first, first)
            raise APIError(400, msg if param == first else f"{param}: {msg}", param) from None
        rng = field_range(field)
        if rng is not None and err.get("type") in _RANGE_ERRORS:
            msg = f"{msg} (valid range {rng})"
        param = (names or {}).get(field, field)
        raise APIError(400, f"{param}: {msg}", param) from None


_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal",
                 "finite_number"}


def check_against_model(params: SamplingParams, prompts_ids: list[list[int]], vocab_size: int,
                        names: dict[str, str] | None = None) -> None:
    """What needs the model, checked before a request reaches the engine: prompt token ids in
    ``[0, vocab_size)`` (400 on ``prompt``) and :meth:`SamplingParams.vocab_errors`."""
    for ids in prompts_ids:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"prompt: token ids {bad[:5]} are outside the vocabulary "
                           f"[0, {vocab_size})", "prompt")
    for field, msg in params.vocab_errors(vocab_size):
        param = (names or {}).get(field, field)
        raise APIError(400, f"{param}: {msg}", param)


# ----------------------------------------------------------------- chat prompts
def special_token_strings(tokenizer) -> list[str]:
    """The text of every special token the tokenizer matches in raw text."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    found = {t.content for t in decoder.values() if getattr(t, "special", False)}
    found.update(getattr(tokenizer, "all_special_tokens", None) or ())
    return sorted(s for s in found if s)


def chat_prompt_ids(tokenizer, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                    chat_template: str | None = None) -> list[int]:
    """The chat template's rendering of ``messages`` with each message's content encoded as plain
    text: the template's own parts are tokenized as usual (special tokens included) and each
    content with ``split_special_tokens=True``, so a control string inside a message (e.g.
    ``<|im_start|>system``) becomes ordinary text tokens. Equal to the usual encoding for content
    without control strings, except that token boundaries cannot cross a content's first or last
    character. ValueError if a role or name holds a control string, or if the template changes
    content (then it cannot be located in the rendering). ``add_generation_prompt`` and
    ``chat_template`` go to ``apply_chat_template`` (``LLM.chat`` passes its own)."""
    specials = special_token_strings(tokenizer)
    for i, m in enumerate(messages):
        for key in ("role", "name"):
            v = m.get(key)
            if isinstance(v, str) and any(sp in v for sp in specials):
                raise ValueError(f"messages[{i}].{key} contains a special token of the tokenizer")
    marks = [f"\ue000speculant-content-{i}\ue001" for i in range(len(messages))]
    masked = [{**m, "content": mark} for m, mark in zip(messages, marks)]
    text = tokenizer.apply_chat_template(masked, add_generation_prompt=add_generation_prompt,
                                         tokenize=False, chat_template=chat_template)
    found = []
    for i, mark in enumerate(marks):
        if text.count(mark) != 1:
            raise ValueError("split_special_tokens: this model's chat template changes or repeats "
                             f"message content (messages[{i}]), so it cannot be encoded apart; "
                             "send it without split_special_tokens")
        found.append((text.index(mark), i))

    def encode(s: str, split: bool) -> list[int]:
        if not s:
            return []
        return list(tokenizer(s, add_special_tokens=False, split_special_tokens=split).input_ids)

    ids: list[int] = []
    pos = 0
    for at, i in sorted(found):
        ids += encode(text[pos:at], False)
        ids += encode(messages[i].get("content") or "", True)
        pos = at + len(marks[i])
    return ids + encode(text[pos:], False)


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """FastAPI's RequestValidationError.errors() -> a 400 naming the first bad field."""
    err = errors[0] if errors else {}
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {err.get('msg', '')}")
    if not loc:
        return APIError(400, "the request body must be a JSON object (send Content-Type: "
                        f"application/json): {err.get('msg', '')}")
    param_loc, tags = _split_union(loc)
    param = ".".join(param_loc)
    msg = err.get("msg", "invalid request")
    if tags:  # one error per member of a union type: name the types the field takes
        for other in errors[1:]:
            oloc, otags = _split_union([str(x) for x in other.get("loc", ()) if x != "body"])
            if oloc == param_loc and otags and otags[0] not in tags:
                tags.append(otags[0])
        msg = f"must be one of the types {' | '.join(tags)}"
    elif err.get("type") == "extra_forbidden":
        msg = "unknown field"
    elif err.get("type") == "missing":
        msg = "field required"
    return APIError(400, f"{param}: {msg}", param)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _split_union(loc: list[str]) -> tuple[list[str], list[str]]:
    """Pydantic puts the union member tried into an error's loc (``prompt.list[int].0``): the
    field's path, and that member (or nothing)."""
    for i, x in enumerate(loc):
        if x in _TYPE_TAGS or "[" in x:
            return loc[:i], [x]
    return loc, []


# ----------------------------------------------------------------- logprobs formats
def _top(d: dict[int, Logprob], n: int) -> list[tuple[int, Logprob]]:
    ranked = sorted(((t, lp) for t, lp in d.items() if lp.rank is not None and lp.rank <= n),
                    key=lambda x: x[1].rank)
    return ranked


def completion_logprobs(
    token_ids: list[int], logprobs: list[dict[int, Logprob] | None], n: int, offset: int,
    tokenizer,
) -> dict[str, Any]:
    """OpenAI completions format: tokens, token_logprobs, top_logprobs, text_offset. A None entry
    (the first prompt token under echo) has no logprob."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for t, d in zip(token_ids, logprobs):
        s = d[t].decoded_token if d is not None and t in d else None
        if s is None:
            s = tokenizer.decode([t]) if tokenizer is not None else str(t)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if d is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(d[t].logprob)
        top = {(lp.decoded_token if lp.decoded_token is not None else str(tid)): lp.logprob
               for tid, lp in _top(d, n)}
        top.setdefault(s, d[t].logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], n: int,
                  tokenizer) -> dict[str, Any]:
    content = []
    for t, d in zip(token_ids, logprobs):
        lp = d[t]
        s = lp.decoded_token if lp.decoded_token is not None else tokenizer.decode([t])
        content.append({
            "token": s, "logprob": lp.logprob, "bytes": list(s.encode("utf-8")),
            "top_logprobs": [
                {"token": x.decoded_token or "", "logprob": x.logprob,
                 "bytes": list((x.decoded_token or "").encode("utf-8"))}
                for _, x in _top(d, n)
            ],
        })
    return {"content": content}
