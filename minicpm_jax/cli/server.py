"""OpenAI-compatible HTTP server: ``python -m minicpm_jax.server --model_path DIR --port 8000``.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with ``stream`` as server-sent
events ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /health``. Requests are validated by
pydantic schemas (FastAPI); errors come back as OpenAI-style ``{"error": {...}}`` objects with 400
(invalid request), 401 (API key), 404, 413 (body too large) or 429 (queue full, with Retry-After).
Generation runs on the continuous-batching :class:`~minicpm_jax.engine.scheduler.Scheduler`: requests share the
engine's ``--max_batch_size`` slots and a finished or disconnected request frees its slot at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from typing import Annotated, Any, Literal

import uvicorn
from absl import app, flags
from fastapi import Request as HTTPRequest  # module level: FastAPI resolves the string annotations here
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from minicpm_jax.errors import MiniCPMError
from minicpm_jax.cli.flags import (
    apply_system_flags, fail, load_from_flags, sparse_description, validate_model_flags, weights_description,
)

FLAGS = flags.FLAGS
_H = "server"
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0 for every interface).", module_name=_H)
flags.DEFINE_integer("port", 8000, "TCP port.", module_name=_H)
flags.DEFINE_integer("max_batch_size", 8, "Sequences generated together (static engine slots).", module_name=_H)
flags.DEFINE_integer("max_queue", 64, "Requests that may wait for a slot; more get 429.", module_name=_H)
flags.DEFINE_string("api_key", None, "If set, requests need 'Authorization: Bearer KEY' (401 otherwise).",
                    module_name=_H)
flags.DEFINE_string("served_model_name", None, "Model id in the API (default: the model directory's name).",
                    module_name=_H)
flags.DEFINE_integer("max_body_bytes", 1 << 20, "Largest request body accepted (413 beyond).", module_name=_H)
flags.DEFINE_float("shutdown_grace_s", 25.0, "On SIGTERM / Ctrl-C: seconds running requests may take to finish "
                   "before they are ended (new and queued requests get 503 at once).", module_name=_H)
flags.DEFINE_enum("log_level", "info", ["debug", "info", "warning", "error"],
                  "Server log level; info writes an access line per request to stderr.", module_name=_H)

access_log = logging.getLogger("minicpm_jax.access")

RETRY_AFTER_S = 1
_LEVELS = ("debug", "info", "warning", "error")
OPENAI_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}  # OpenAI's defaults, top_k off


# ----------------------------------------------------------------------------- request schemas
class _Schema(BaseModel):
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


class _Sampling(_Schema):
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
    n: int = Field(1, ge=1, le=1, description="only 1 is supported")


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    # vLLM's and SGLang's extensions: variables for the chat template (MiniCPM4.1: enable_thinking)
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: bool | None = None


class CompletionRequest(_Sampling):
    prompt: Text | list[Text]


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
    tokens and latency. Routes put ``rid`` and ``usage`` (a callable) in the request's state."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not access_log.isEnabledFor(logging.DEBUG if scope["path"] == "/health"
                                                                   else logging.INFO):
            return await self.app(scope, receive, send)
        t0, status, logged = time.perf_counter(), None, False
        state = scope.setdefault("state", {})

        def log() -> None:
            nonlocal logged
            logged = True
            usage = state["usage"]() if "usage" in state else {}
            level = logging.DEBUG if scope["path"] == "/health" else logging.INFO  # probes would drown the rest
            access_log.log(level, "%s %s %s %s prompt_tokens=%s completion_tokens=%s %.3fs", scope["method"], scope["path"],
                            status or "-", state.get("rid", "-"), usage.get("prompt_tokens", "-"),
                            usage.get("completion_tokens", "-"), time.perf_counter() - t0)

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


def _is_field(part) -> bool:
    """Whether a pydantic error location part names a field or index (not "body", not a union branch tag
    such as ``str`` or ``function-after[...]``)."""
    return isinstance(part, int) or (part != "body" and part.isidentifier() and part not in ("str", "int", "float"))


# ----------------------------------------------------------------------------- the app
class Generation:
    """Bridges one scheduler request to asyncio: text deltas and the finish arrive on a queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop, tokenizer, stops: list[str]):
        from minicpm_jax.tokenizer import TextStream

        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.text = TextStream(tokenizer, stops, emit=lambda s: self._put(("text", s)))

    def _put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)

    def on_tokens(self, ids: list[int]) -> bool:
        return self.text.push(ids)

    def on_finish(self, reason: str, error: str | None) -> None:
        self.text.finish()  # flushes the last token's text
        self._put(("finish", reason, error))


def create_app(scheduler, tokenizer, *, model_name: str, stop_ids: list[int], api_key: str | None = None,
               max_body_bytes: int = 1 << 20, sampling_defaults: dict | None = None):
    """The FastAPI application serving ``scheduler`` (already started). sampling_defaults: temperature /
    top_p / top_k for requests that give none (the checkpoint's generation_config.json)."""
    sampling_defaults = dict(sampling_defaults or {})
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from minicpm_jax.engine.sampling import SamplingParams
    from minicpm_jax.engine.scheduler import Draining, QueueFull, Request
    from minicpm_jax.tokenizer import encode_prompt

    api = FastAPI(title="minicpm-jax", version="1", description=__doc__.split("\n\n")[0])
    # Tokenizing a long prompt takes up to a second: off the event loop, on one thread (a fast tokenizer
    # used from several threads at once can fail with "Already borrowed").
    tokenize = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize")

    async def off_loop(fn, *args, **kw):
        return await asyncio.get_running_loop().run_in_executor(tokenize, lambda: fn(*args, **kw))

    max_length = scheduler.engine.max_length
    created = int(time.time())

    @api.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers)

    @api.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":  # its loc is a byte offset, not a parameter
            ctx = (first.get("ctx") or {}).get("error")
            return JSONResponse(error_body(f"the request body is not valid JSON{f' ({ctx})' if ctx else ''}",
                                           "invalid_request_error"), status_code=400)
        where = ".".join(str(x) for x in first.get("loc", ()) if _is_field(x)) or None
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        if where:
            message = f"{where}: {message}"
        return JSONResponse(error_body(message, "invalid_request_error", where), status_code=400)

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        if e.status_code == 404:
            return JSONResponse(error_body(f"no route {request.url.path}", "invalid_request_error"), status_code=404)
        if e.status_code == 405:
            return JSONResponse(error_body(f"{request.method} is not allowed on {request.url.path}",
                                           "invalid_request_error"), status_code=405)
        message = str(e.detail)
        if e.status_code == 400 and "parsing the body" in message:
            # FastAPI's words for a body json.loads could not take: bytes that are not UTF-8, nesting
            # deeper than Python's recursion limit.
            message = "the request body is not valid JSON (UTF-8 text, nested at most a few hundred levels)"
        return JSONResponse(error_body(message, "invalid_request_error"), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @api.get("/health")
    async def health():
        return {"status": "ok", "active": scheduler.active, "queued": scheduler.queued,
                "completed": scheduler.completed, "finished": dict(scheduler.finished),
                "generated_tokens": scheduler.generated_tokens}

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "minicpm-jax", "max_model_len": max_length}]}

    def _prepare(body: _Sampling, ids: list[int], max_tokens: int | None):
        if len(ids) >= max_length:
            raise APIError(400, f"the prompt has {len(ids)} tokens but the context is {max_length} tokens; "
                                "shorten it", param="messages")
        room = max_length - len(ids)
        if max_tokens is not None and max_tokens > room:
            raise APIError(400, f"max_tokens {max_tokens} is above the context: the prompt has {len(ids)} tokens "
                                f"and the context is {max_length}, so at most {room} can be generated",
                           param="max_tokens")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise APIError(400, "stop takes at most 4 non-empty strings", param="stop")
        seed = body.seed if body.seed is not None else uuid.uuid4().int % (2**32)
        given = {k: getattr(body, k) for k in ("temperature", "top_p", "top_k") if getattr(body, k) is not None}
        try:
            sampling = SamplingParams(**{**OPENAI_SAMPLING, **sampling_defaults, **given}, seed=seed)
        except MiniCPMError as e:
            raise APIError(400, str(e)) from None
        return stops, sampling, max_tokens or room

    def _check_model(body: _Sampling) -> None:
        if body.model is not None and body.model != model_name:  # as OpenAI and vLLM answer
            raise APIError(404, f"The model `{body.model}` does not exist; this server serves `{model_name}` "
                                "(GET /v1/models)", param="model", code="model_not_found")

    async def _run(body: _Sampling, ids: list[int], max_tokens: int | None, http: HTTPRequest, kind: str):
        stops, sampling, budget = _prepare(body, ids, max_tokens)
        gen = Generation(asyncio.get_running_loop(), tokenizer, stops)
        req = Request(ids, sampling, budget, stop_ids, gen.on_tokens, gen.on_finish)
        try:
            scheduler.submit(req)
        except QueueFull as e:
            raise APIError(429, f"server busy: {e}; retry later", type_="rate_limit_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except Draining:
            raise shutting_down() from None
        except MiniCPMError as e:
            raise APIError(400, str(e)) from None
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        # Tokens delivered: past a stop string the rest of the decode block is generated but not billed.
        usage = lambda: {"prompt_tokens": len(ids), "completion_tokens": gen.text.tokens,
                         "total_tokens": len(ids) + gen.text.tokens}
        http.state.rid, http.state.usage = rid, usage
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_stream(gen, req, rid, kind, usage, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        text, finish = [], None
        try:
            while finish is None:
                try:
                    event = await asyncio.wait_for(gen.events.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        scheduler.cancel(req)
                        return JSONResponse({}, status_code=499)
                    continue
                if event[0] == "text":
                    text.append(event[1])
                else:
                    finish, error = event[1], event[2]
        except asyncio.CancelledError:
            scheduler.cancel(req)
            raise
        if finish == "error":
            raise APIError(500, f"generation failed: {error}", type_="server_error")
        if finish == "shutdown":
            raise shutting_down()
        content = "".join(text)
        choice = ({"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish}
                  if kind == "chat" else {"index": 0, "text": content, "finish_reason": finish, "logprobs": None})
        return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
                "created": int(time.time()), "model": model_name, "choices": [choice], "usage": usage()}

    async def _stream(gen: Generation, req, rid: str, kind: str, usage, include_usage: bool):
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(delta: str | None, finish: str | None, first: bool = False) -> str:
            if kind == "chat":
                d = {"role": "assistant", "content": ""} if first else ({"content": delta} if delta is not None else {})
                choice = {"index": 0, "delta": d, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
            payload = {"id": rid, "object": obj, "created": int(time.time()), "model": model_name, "choices": [choice]}
            if include_usage:
                payload["usage"] = None
            return f"data: {json.dumps(payload)}\n\n"

        try:
            if kind == "chat":
                yield chunk(None, None, first=True)
            while True:
                event = await gen.events.get()
                if event[0] == "text":
                    yield chunk(event[1], None)
                    continue
                reason, error = event[1], event[2]
                if reason in ("error", "shutdown"):
                    e = shutting_down() if reason == "shutdown" else None
                    body = (error_body(e.message, e.type, code=e.code) if e else
                            error_body(f"generation failed: {error}", "server_error"))
                    yield f"data: {json.dumps(body)}\n\n"
                else:
                    yield chunk(None, reason)
                    if include_usage:
                        yield f"data: {json.dumps({'id': rid, 'object': obj, 'created': int(time.time()), 'model': model_name, 'choices': [], 'usage': usage()})}\n\n"
                yield "data: [DONE]\n\n"
                return
        finally:  # the client went away mid-stream (or the stream ended): the slot is freed either way
            scheduler.cancel(req)

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: HTTPRequest):
        _check_model(body)
        messages = [{"role": "system" if m.role == "developer" else m.role,
                     "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)}
                    for m in body.messages]
        try:
            ids = await off_loop(encode_prompt, tokenizer, messages=messages, use_chat_template=True,
                                 enable_thinking=body.enable_thinking, template_kwargs=body.chat_template_kwargs)
        except MiniCPMError as e:
            raise APIError(400, str(e), param="chat_template_kwargs") from None
        except Exception as e:
            raise APIError(400, f"cannot apply the chat template to these messages: {e}", param="messages") from None
        return await _run(body, ids, body.max_completion_tokens or body.max_tokens, http, "chat")

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        _check_model(body)
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if len(prompts) != 1:
            raise APIError(400, "prompt must be one string (batched prompts are not supported)", param="prompt")
        ids = await off_loop(encode_prompt, tokenizer, prompts[0], use_chat_template=False)
        if not ids:
            raise APIError(400, "prompt is empty", param="prompt")
        return await _run(body, ids, body.max_tokens, http, "completion")

    return AccessLog(BodyLimit(APIKeyCheck(api, api_key) if api_key else api, max_body_bytes))


def main(argv) -> None:
    from absl import logging

    logging.set_verbosity(logging.WARNING)
    if len(argv) > 1:
        fail(f"unexpected arguments {' '.join(argv[1:])!r}")
    try:
        _serve()
    except MiniCPMError as e:
        fail(str(e))
    except KeyboardInterrupt:
        pass


def _serve() -> None:
    from minicpm_jax.engine.engine import Engine
    from minicpm_jax.engine.scheduler import Scheduler
    from minicpm_jax.tokenizer import sampling_defaults, stop_token_ids

    validate_model_flags()
    if FLAGS.draft_path is not None:
        raise MiniCPMError("the server does not run speculative decoding yet (its continuous batching uses plain "
                           "decode steps); drop --draft_path, or use `python -m minicpm_jax.run --draft_path ...`")
    if not FLAGS.shutdown_grace_s >= 0:
        raise MiniCPMError(f"--shutdown_grace_s must be >= 0, got {FLAGS.shutdown_grace_s}")
    for name in ("max_batch_size", "max_body_bytes"):
        if getattr(FLAGS, name) < 1:
            raise MiniCPMError(f"--{name} must be >= 1, got {getattr(FLAGS, name)}")
    if FLAGS.max_queue < 0 or not 0 < FLAGS.port < 65536:
        raise MiniCPMError("--max_queue must be >= 0 and --port in 1..65535")
    sock = listening_socket(FLAGS.host, FLAGS.port)  # before the model loads: a busy port fails at once
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    access_log.addHandler(handler)
    access_log.setLevel(FLAGS.log_level.upper())
    access_log.propagate = False
    apply_system_flags()
    import jax

    if jax.process_count() > 1:
        raise MiniCPMError("the server runs in one process (its scheduler decides every step): use --tensor_parallel "
                           "over this host's devices, or several hosts with `python -m minicpm_jax.run`")
    model_path, model, tokenizer, load_s = load_from_flags(progress=True, batch_size=FLAGS.max_batch_size)
    engine = Engine(model, batch_size=FLAGS.max_batch_size, chunk_length=FLAGS.chunk_length,
                    decode_block=FLAGS.decode_block)
    scheduler = Scheduler(engine, max_queue=FLAGS.max_queue)
    stops = stop_token_ids(model.config, tokenizer, model_path)
    t = time.perf_counter()
    _warm_up(scheduler, tokenizer, stops)
    name = FLAGS.served_model_name or os.path.basename(os.path.normpath(model_path))
    print(f"minicpm-jax: {name} loaded in {load_s:.1f} s, compiled in {time.perf_counter() - t:.1f} s; "
          f"{FLAGS.max_batch_size} slots × {model.max_length} tokens ({model.attention_impl} attention, "
          f"{weights_description(model)} weights, sparse attention {sparse_description(model)}); "
          f"serving on http://{FLAGS.host}:{FLAGS.port}", file=sys.stderr, flush=True)
    scheduler.start()
    application = create_app(scheduler, tokenizer, model_name=name, stop_ids=stops, api_key=FLAGS.api_key,
                             max_body_bytes=FLAGS.max_body_bytes, sampling_defaults=sampling_defaults(model_path))
    try:
        config = uvicorn.Config(application, log_level=max(FLAGS.log_level, "warning", key=_LEVELS.index),
                                timeout_graceful_shutdown=2)
        DrainingServer(config, scheduler, FLAGS.shutdown_grace_s).run(sockets=[sock])
    finally:
        scheduler.stop()
    print("minicpm-jax: stopped", file=sys.stderr)


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain on SIGTERM / SIGINT: new and queued requests get 503 at once, running
    ones may finish within ``grace_s``, the rest end with a 503 error (streams: an error event and
    ``[DONE]``), then the server exits with status 0. A second signal ends the running requests at once.
    (uvicorn alone waits 2 s, cancels the tasks, whose streams stop with no ``[DONE]``, and re-raises the
    signal: exit 143.)"""

    def __init__(self, config, scheduler, grace_s: float):
        super().__init__(config)
        self.scheduler, self.grace_s, self.draining = scheduler, grace_s, False

    def handle_exit(self, sig, frame) -> None:  # a signal handler: it takes no lock, a thread drains
        if self.draining:
            threading.Thread(target=self.scheduler.cancel_all, daemon=True).start()
            return
        self.draining = True
        print(f"minicpm-jax: draining (up to {self.grace_s:g} s for running requests)", file=sys.stderr, flush=True)
        threading.Thread(target=self._drain, name="drain", daemon=True).start()

    def _drain(self) -> None:
        self.scheduler.drain()
        deadline = time.monotonic() + self.grace_s
        while not self.scheduler.idle and time.monotonic() < deadline:
            time.sleep(0.05)
        if not self.scheduler.idle:
            self.scheduler.cancel_all("shutdown")
            while not self.scheduler.idle:
                time.sleep(0.05)
        self.should_exit = True  # uvicorn then closes the connections once their responses are sent


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (uvicorn listens on it); MiniCPMError when the address is taken or
    not this machine's."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise MiniCPMError(f"--host {host!r} is not an address of this machine: {e.strerror}") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart may reuse a port in TIME_WAIT
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise MiniCPMError(f"cannot listen on {host}:{port}: {e.strerror} (is another server there? choose another "
                           "--port)") from None
    return sock


def _warm_up(scheduler, tokenizer, stops: list[int]) -> None:
    """Compiles the prefill, first-token and decode steps before the first request arrives."""
    from minicpm_jax.engine.sampling import SamplingParams
    from minicpm_jax.engine.scheduler import Request
    from minicpm_jax.tokenizer import encode_prompt

    ids = encode_prompt(tokenizer, "Hello", use_chat_template=False) or [0]
    done = []
    req = Request(ids, SamplingParams(), 2, stops, lambda _: False, lambda reason, error: done.append(error))
    scheduler.submit(req)
    while not done:
        scheduler.step()
    if done[0]:
        raise MiniCPMError(f"warm-up generation failed: {done[0]}")


def run() -> None:
    app.run(main)


if __name__ == "__main__":
    run()
