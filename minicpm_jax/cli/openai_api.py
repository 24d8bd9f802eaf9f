"""The OpenAI API's shapes for the server: request schemas (pydantic), error bodies, and the ASGI middleware
in front of the app (API key, body limit, access log)."""

from __future__ import annotations

import json
import logging
import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

access_log = logging.getLogger("minicpm_jax.access")


# ----------------------------------------------------------------------------- request schemas
class Schema(BaseModel):
    model_config = ConfigDict(extra="allow")  # clients send many optional OpenAI fields; unknown ones are ignored


def _encodable(text: str) -> str:
    """JSON may carry a lone UTF-16 surrogate (``"\\ud800"``), which no tokenizer can encode: refused as
    invalid input instead of reaching the tokenizer (whose exception text leaked into the reply)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("contains an unpaired UTF-16 surrogate; send valid Unicode text") from None
    return text


Text = Annotated[str, AfterValidator(_encodable)]


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class Message(BaseModel):
    # "developer" is OpenAI's newer name for "system" (o1 and later); it reaches the template as "system"
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(Schema):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, description="default: the rest of the context")
    # None: the checkpoint's generation_config.json recommendation, else OpenAI's defaults (1.0, 1.0, off)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=1 << 20, description="extension: sample among the k most likely "
                              "tokens; 0 = off")
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: Text | list[Text] | None = Field(None, description="up to 4 strings, matched on the text")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=128, description="choices to generate (at most the server's --max_batch_size)")
    ignore_eos: bool = Field(False, description="extension (vLLM's): generate past the model's stop tokens, to "
                             "max_tokens (benchmarks)")


class ChatCompletionRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    # vLLM's and SGLang's extensions: variables for the chat template (MiniCPM4.1: enable_thinking)
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: bool | None = None
    logprobs: bool | None = Field(False, description="return each token's log-probability")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="with logprobs: that many most likely "
                                     "alternatives per token")


class CompletionRequest(SamplingFields):
    prompt: Text | list[Text]
    logprobs: int | None = Field(None, ge=0, le=20, description="each token's log-probability and that many "
                                 "most likely alternatives")
    echo: bool = Field(False, description="the prompt's text before the completion's (not with logprobs)")


# ----------------------------------------------------------------------------- errors
class APIError(Exception):
    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers
        self.code = code


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down; retry elsewhere or later", type_="server_error",
                    code="server_shutting_down")


def error_body(message: str, type_: str, param: str | None = None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class BodyLimit:
    """ASGI middleware: 413 for bodies over ``limit`` bytes, by Content-Length or, for a chunked body,
    counted while it is read here in full. (Raised from inside the app's own body read, the error was
    turned into FastAPI's generic 400 "There was an error parsing the body".) The app then gets the
    buffered body, and later ``receive`` calls go to the client (disconnects stay visible)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._reject(send)
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending its body
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                return await self._reject(send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(self, send):
        body = json.dumps(error_body(f"request body is larger than {self.limit} bytes", "invalid_request_error")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class APIKeyCheck:
    """ASGI middleware: 401 for ``/v1/`` requests without ``Authorization: Bearer KEY``.

    Plain ASGI on purpose: behind Starlette's ``BaseHTTPMiddleware`` (``@app.middleware("http")``) the
    route's ``Request.is_disconnected()`` never turns true, so an abandoned non-streaming request ran to
    its end in a slot nobody read."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            if dict(scope.get("headers") or []).get(b"authorization", b"") != self.expected:
                body = json.dumps(error_body("missing or wrong API key (Authorization: Bearer KEY)",
                                             "authentication_error")).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


class AccessLog:
    """ASGI middleware: one line per request on :data:`access_log` once its response has ended (a stream
    at its last chunk, or when the client left): method, path, status, request id, prompt / completion
    tokens, latency and, for a generation, the time to its first token (arrival to the first token handed
    to the request, server side) split into its parts: ``in`` (arrival to the scheduler's queue: the body,
    validation, tokenising), ``queue`` (waiting for a slot and memory) and ``prefill`` (the prompt's
    uncached part and the first token). Routes put ``rid``, ``usage``, ``first_token`` and ``phases``
    (callables; ``phases`` gives the perf_counter times queued and admitted, or None) in the request's
    state; ``t0`` is the arrival."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not access_log.isEnabledFor(logging.DEBUG if scope["path"] == "/health"
                                                                   else logging.INFO):
            return await self.app(scope, receive, send)
        t0, status, logged = time.perf_counter(), None, False
        state = scope.setdefault("state", {})
        state["t0"] = t0  # the request's arrival: routes measure their time to first token from it

        def log() -> None:
            nonlocal logged
            logged = True
            usage = state["usage"]() if "usage" in state else {}
            level = logging.DEBUG if scope["path"] == "/health" else logging.INFO  # probes would drown the rest
            first = state["first_token"]() if "first_token" in state else None
            access_log.log(level, "%s %s %s %s prompt_tokens=%s completion_tokens=%s %.3fs%s", scope["method"],
                           scope["path"], status or "-", state.get("rid", "-"), usage.get("prompt_tokens", "-"),
                           usage.get("completion_tokens", "-"), time.perf_counter() - t0,
                           "" if first is None else f" ttft={first - t0:.3f}s{phases(first)}")

        def phases(first: float) -> str:
            queued, admitted = state["phases"]() if "phases" in state else (None, None)
            if queued is None or admitted is None:
                return ""
            return f" (in {queued - t0:.3f}s, queue {admitted - queued:.3f}s, prefill {first - admitted:.3f}s)"

        async def logged_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False) and not logged:
                log()

        try:
            await self.app(scope, receive, logged_send)
        finally:
            if not logged:  # the client went away before the response ended
                status = status or 499
                log()


def is_field(part) -> bool:
    """Whether a pydantic error location part names a field or index (not "body", not a union branch tag
    such as ``str`` or ``function-after[...]``)."""
    return isinstance(part, int) or (part != "body" and part.isidentifier() and part not in ("str", "int", "float"))
