"""OpenAI request validation and response objects (the subset the platform serves).

Unknown fields are ignored (OpenAI clients send many); known fields are type-checked strictly so a
wrong type is a 400, never a crash or a silent coercion. A known field asking for what the engine
does not do (log-probabilities, tools, penalties, nucleus or top-k sampling, n > 1, ...) is refused
with a 400 naming it rather than answered without it. The body is parsed here too (`parse_body`):
bounded nesting, integers and text the tokenizer can take, so nothing later fails on its shape.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Number = StrictFloat | StrictInt
MAX_INT_DIGITS = 64  # no field takes more (seeds are < 2^64: 20 digits)


class APIError(Exception):
    """Becomes an OpenAI-style JSON error with this HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.status}}


# -- the body ------------------------------------------------------------------------------------

class _Refused(ValueError):
    pass


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(f"an integer literal longer than {MAX_INT_DIGITS} digits")
    return int(text)


def _parse_constant(name: str):
    raise _Refused(f"{name} is not a JSON number")


def parse_body(body: bytes, max_depth: int) -> dict:
    """The request body as a JSON object, or an APIError(400) saying what is wrong with it."""
    too_deep = APIError(400, f"request body nested deeper than {max_depth} levels")
    try:
        obj = json.loads(body, parse_int=_parse_int, parse_constant=_parse_constant)
    except RecursionError:  # the decoder's own depth bound (the interpreter's recursion limit)
        raise too_deep from None
    except _Refused as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    except json.JSONDecodeError as e:  # its message gives a position, never the text
        raise APIError(400, f"request body is not valid JSON: {e.msg} at char {e.pos}") from None
    except ValueError:  # UnicodeDecodeError: not UTF-8/16/32
        raise APIError(400, "request body is not valid JSON: not UTF-8 text") from None
    if not isinstance(obj, dict):
        raise APIError(400, "request body must be a JSON object")
    check_tree(obj, max_depth, too_deep)
    return obj


def check_tree(obj, max_depth: int, too_deep: APIError) -> None:
    """Nesting within max_depth containers, and every string encodable as UTF-8: a lone surrogate
    (`"\\ud800"` is valid JSON) would fail inside the tokenizer. Iterative: no recursion to exhaust."""
    stack: list[tuple[Any, tuple, int]] = [(obj, (), 1)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > max_depth:
                too_deep.param = field_name(path)
                raise too_deep
            items = node.items() if isinstance(node, dict) else enumerate(node)
            for k, v in items:
                if isinstance(k, str):
                    _check_text(k, path + ("<key>",))
                stack.append((v, path + (k,), depth + 1))
        elif isinstance(node, str):
            _check_text(node, path)


def _check_text(text: str, path: tuple) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        name = field_name(path)
        raise APIError(400, f"{name}: text is not valid Unicode (a lone UTF-16 surrogate)",
                       param=name) from None


def field_name(path) -> str:
    """A field location for messages: keys that are names, never keys that may be user text."""
    parts = [str(p) if isinstance(p, int) or (p.isidentifier() and len(p) <= 40) or p == "<key>"
             else "?" for p in path]
    return ".".join(parts) or "body"


# -- the request schema --------------------------------------------------------------------------

class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: StrictStr | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: Number = Field(default=0.0, ge=0.0, le=2.0)
    stop: StrictStr | list[StrictStr] | None = None
    # torch.Generator.manual_seed takes [-2^63, 2^64): anything else would fail inside the engine
    seed: StrictInt | None = Field(default=None, ge=-(1 << 63), lt=1 << 64)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = Field(default=None, ge=1)
    user: StrictStr | None = None
    # Known, range-checked, and served only at the values that change nothing (see unsupported()):
    # the engine samples the full distribution at `temperature`, without penalties or biases.
    top_p: Number | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=-1)      # vLLM / SGLang: -1 or 0 = off
    min_p: Number | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: Number | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Number | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: Number | None = Field(default=None, gt=0.0)
    logit_bias: dict[StrictStr, Number] | None = None
    response_format: dict[StrictStr, Any] | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) of the first field asking for what this server does not do, else None."""
        sampling = self.temperature > 0
        checks = [
            ("n", (self.n or 1) > 1, "n > 1 is not supported: send one request per completion"),
            ("top_p", sampling and (self.top_p or 1.0) < 1.0,
             "top_p < 1 is not supported: the server samples the full distribution"),
            ("top_k", sampling and (self.top_k or 0) > 0,
             "top_k is not supported: the server samples the full distribution"),
            ("min_p", sampling and bool(self.min_p), "min_p is not supported"),
            ("presence_penalty", bool(self.presence_penalty), "penalties are not supported"),
            ("frequency_penalty", bool(self.frequency_penalty), "penalties are not supported"),
            ("repetition_penalty", self.repetition_penalty not in (None, 1, 1.0),
             "penalties are not supported"),
            ("logit_bias", bool(self.logit_bias), "logit_bias is not supported"),
            ("response_format", self.response_format not in (None, {"type": "text"}),
             "only response_format {\"type\": \"text\"} is supported"),
        ]
        return next(((f, why) for f, bad, why in checks + self._unsupported() if bad), None)

    def _unsupported(self) -> list[tuple[str, bool, str]]:
        return []


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: StrictStr | dict[StrictStr, Any] | None = None
    functions: list[Any] | None = None
    function_call: StrictStr | dict[StrictStr, Any] | None = None

    def _unsupported(self):
        return [("logprobs", bool(self.logprobs), "logprobs are not returned by this server"),
                ("top_logprobs", bool(self.top_logprobs), "logprobs are not returned by this server"),
                ("tools", bool(self.tools), "tool calls are not supported"),
                ("tool_choice", self.tool_choice not in (None, "none"), "tool calls are not supported"),
                ("functions", bool(self.functions), "function calls are not supported"),
                ("function_call", self.function_call not in (None, "none"),
                 "function calls are not supported")]


class CompletionRequest(SamplingRequest):
    prompt: StrictStr | list[StrictStr]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=5)
    echo: StrictBool | None = None
    best_of: StrictInt | None = Field(default=None, ge=1)
    suffix: StrictStr | None = None

    def prompt_text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise APIError(400, "batched prompts are not supported: send one prompt per request",
                           param="prompt")
        return self.prompt[0]

    def _unsupported(self):
        return [("logprobs", self.logprobs is not None, "logprobs are not returned by this server"),
                ("echo", bool(self.echo), "echo is not supported"),
                ("best_of", (self.best_of or 1) > 1, "best_of > 1 is not supported"),
                ("suffix", bool(self.suffix), "suffix is not supported")]


def validate(model: type[SamplingRequest], obj: dict) -> SamplingRequest:
    """The request, or an APIError(400) naming the first field that is wrong or unsupported."""
    from pydantic import ValidationError

    try:
        req = model.model_validate(obj)
    except ValidationError as e:
        raise APIError(400, validation_message(e), param=_first_loc(e)) from None
    bad = req.unsupported()
    if bad is not None:
        raise APIError(400, f"{bad[0]}: {bad[1]}", param=bad[0])
    return req


def _first_loc(err) -> str | None:
    errors = err.errors()
    return field_name(errors[0].get("loc", ())) if errors else None


def validation_message(err) -> str:
    """Field locations and reasons only: the offending values may be user text (PII)."""
    parts = []
    for e in err.errors()[:5]:
        loc = field_name(e.get("loc", ()))
        parts.append(f"{loc}: {e.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, verify_steps: int, accepted: int) -> dict:
    # spec_* are extensions (OpenAI clients ignore unknown keys) that let a benchmark compute τ per
    # request / per workload: τ = spec_accepted_tokens / spec_verify_steps (the first token comes
    # from the prefill and is not part of any verify step).
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "spec_verify_steps": verify_steps,
            "spec_accepted_tokens": accepted}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def completion_chunk(rid: str, model: str, created: int, text: str, finish: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def usage_chunk(rid: str, model: str, created: int, obj: str, use: dict) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": use}


def chat_response(rid: str, model: str, created: int, text: str, finish: str, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish}],
            "usage": use}


def completion_response(rid: str, model: str, created: int, text: str, finish: str,
                        use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
            "usage": use}


def now() -> int:
    return int(time.time())
