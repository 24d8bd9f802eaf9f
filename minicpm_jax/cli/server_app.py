"""The server's FastAPI application: the OpenAI routes over a :class:`~minicpm_jax.engine.scheduler.Scheduler`
(see :mod:`minicpm_jax.cli.server` for the process around it and docs/serving.md for the API)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import json
import threading
import time
import uuid

from fastapi import Request as HTTPRequest  # module level: FastAPI resolves the string annotations here

from minicpm_jax.cli.openai_api import (
    AccessLog, APIError, APIKeyCheck, BodyLimit, ChatCompletionRequest, CompletionRequest, SamplingFields, error_body,
    is_field, shutting_down,
)
from minicpm_jax.errors import MiniCPMError

RETRY_AFTER_S = 1
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there
OPENAI_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}  # OpenAI's defaults, top_k off


class EventBridge:
    """Hands events from the scheduler's thread to asyncio queues of one event loop, with one wake-up of the
    loop per batch: the scheduler delivers a step's tokens to every running stream at once, and a wake-up
    per token and stream (``call_soon_threadsafe``: a lock, a write to the loop's self-pipe, a loop
    iteration) made the HTTP side's per-token work grow with the streams while the scheduler's thread
    waited for the interpreter lock."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.lock = loop, threading.Lock()
        self.pending: list[tuple[asyncio.Queue, tuple]] = []
        self.scheduled = False

    def put(self, queue: asyncio.Queue, item: tuple) -> None:
        """Queues ``item`` on ``queue`` (from any thread), in order with every earlier ``put``."""
        with self.lock:
            self.pending.append((queue, item))
            if self.scheduled:
                return
            self.scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop is closed (shutdown): nothing will read the queues
            with self.lock:
                self.scheduled = False
            raise

    def _flush(self) -> None:
        with self.lock:
            items, self.pending, self.scheduled = self.pending, [], False
        for queue, item in items:
            queue.put_nowait(item)


def coalesced(events: list[tuple]) -> list[tuple]:
    """``events`` with each run of consecutive ``("text", index, text, entries)`` of one choice merged into
    one (texts and entries joined): a stream that fell behind the scheduler sends what arrived as one chunk
    instead of one chunk (a JSON body, an event, a socket write) per token."""
    out: list[tuple] = []
    for event in events:
        last = out[-1] if out else None
        if event[0] == "text" and last is not None and last[0] == "text" and last[1] == event[1]:
            out[-1] = ("text", event[1], last[2] + event[2], last[3] + event[3])
        else:
            out.append(event)
    return out


class Generation:
    """One choice of a request, bridged from the scheduler's thread to asyncio: its text deltas (with the
    log-probability entries of the tokens they complete) and its finish arrive on ``events``, shared by the
    request's choices, as ``("text", index, text, entries)`` and ``("finish", index, reason, error,
    entries)``. Entries are ``(token id, logprob, [(id, logprob), ...])``; past a stop string none."""

    def __init__(self, bridge: EventBridge, tokenizer, stops: list[str], events: asyncio.Queue, index: int = 0):
        from minicpm_jax.tokenizer import TextStream

        self.bridge, self.events, self.index = bridge, events, index
        self.text = TextStream(tokenizer, stops, emit=lambda s: self._put(("text", index, s, self._take())))
        self.entries: list[tuple] = []
        self.sent = 0
        self.incoming = None
        self.first_token_at: float | None = None  # time.perf_counter() when the first token arrived

    def _put(self, item) -> None:
        self.bridge.put(self.events, item)

    def _take(self) -> list[tuple]:
        """Entries of the tokens counted so far (up to a stop string's) not yet sent."""
        upto = min(self.text.tokens, len(self.entries))
        out, self.sent = self.entries[self.sent : upto], max(self.sent, upto)
        return out

    def on_logprobs(self, entries) -> None:
        self.incoming = entries  # for the ids of the next on_tokens

    def on_tokens(self, ids: list[int]) -> bool:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if self.incoming is not None:
            self.entries += [(i, lp, top) for i, (lp, top) in zip(ids, self.incoming)]
            self.incoming = None
        return self.text.push(ids)

    def on_finish(self, reason: str, error: str | None) -> None:
        self.text.finish()  # flushes the last token's text
        self._put(("finish", self.index, reason, error, self._take()))


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request with ``seed`` (n > 1): the seed itself for the first, then
    steps of 2**64 / golden ratio (splitmix64's increment), so choices draw different tokens, reproducibly."""
    return (seed + index * 0x9E3779B97F4A7C15) % 2**64


def create_app(scheduler, tokenizer, *, model_name: str, stop_ids: list[int], api_key: str | None = None,
               max_body_bytes: int = 1 << 20, sampling_defaults: dict | None = None):
    """The FastAPI application serving ``scheduler`` (already started). sampling_defaults: temperature /
    top_p / top_k for requests that give none (the checkpoint's generation_config.json)."""
    sampling_defaults = dict(sampling_defaults or {})
    bridges: dict[asyncio.AbstractEventLoop, EventBridge] = {}  # one per event loop serving the app
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from minicpm_jax.engine.sampling import SamplingParams
    from minicpm_jax.engine.scheduler import Draining, QueueFull, Request
    from minicpm_jax.engine.speculative.engine import SpeculativeEngine
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
        where = ".".join(str(x) for x in first.get("loc", ()) if is_field(x)) or None
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

    speculative = isinstance(scheduler.engine, SpeculativeEngine)

    @api.get("/health")
    async def health():
        out = {"status": "ok", "active": scheduler.active, "queued": scheduler.queued,
               "completed": scheduler.completed, "finished": dict(scheduler.finished),
               "generated_tokens": scheduler.generated_tokens, "speculative": speculative,
               "steps": scheduler.stats.as_dict()}
        engine = scheduler.engine
        if engine.paged:  # the pool: pages in use, cached, free; prefix-cache hits; preemptions
            out["kv_cache"] = {"kind": "paged", **engine.page_stats(), "preempted": scheduler.preempted}
        else:
            out["kv_cache"] = {"kind": "contiguous", "slots": engine.batch_size, "max_length": engine.max_length}
        counts = scheduler.accept_counts
        if counts is not None:  # rounds by tokens emitted, since the start
            rounds = sum(counts)
            out["spec_rounds"] = rounds
            out["spec_mean_accept_length"] = sum(k * c for k, c in enumerate(counts)) / rounds if rounds else 0.0
        return out

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "minicpm-jax", "max_model_len": max_length}]}

    def _prepare(body: SamplingFields, ids: list[int], max_tokens: int | None):
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

    def _check_model(body: SamplingFields) -> None:
        if body.model is not None and body.model != model_name:  # as OpenAI and vLLM answer
            raise APIError(404, f"The model `{body.model}` does not exist; this server serves `{model_name}` "
                                "(GET /v1/models)", param="model", code="model_not_found")

    @functools.lru_cache(maxsize=1 << 16)
    def token_text(i: int) -> str:
        return tokenizer.decode([i])

    def chat_logprobs(entries) -> dict:
        def one(i, lp):
            t = token_text(i)
            return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
        return {"content": [{**one(i, lp), "top_logprobs": [one(j, v) for j, v in top]} for i, lp, top in entries],
                "refusal": None}

    def completion_logprobs(entries, offset: int) -> dict:
        """OpenAI's legacy shape; text_offset counts characters of the choice's text from ``offset``."""
        tokens = [token_text(i) for i, _, _ in entries]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [{token_text(j): v for j, v in top} | {token_text(i): lp} for i, lp, top in entries],
                "text_offset": offsets}

    def _options(body, kind: str) -> tuple[int | None, str]:
        """(the alternatives per token the request wants log-probabilities with, or None; the echoed text)."""
        if kind == "chat":
            if body.top_logprobs is not None and not body.logprobs:
                raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            return ((body.top_logprobs or 0) if body.logprobs else None), ""
        if body.echo and body.logprobs is not None:
            raise APIError(400, "echo with logprobs would need the prompt's log-probabilities, which are not "
                                "computed; drop one of them", param="echo")
        prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]  # one (the caller checks)
        return body.logprobs, (prompt if body.echo else "")

    async def _run(body: SamplingFields, ids: list[int], max_tokens: int | None, http: HTTPRequest, kind: str):
        stops, sampling, budget = _prepare(body, ids, max_tokens)
        logprobs, echo = _options(body, kind)
        n = body.n
        if n > scheduler.engine.batch_size:
            raise APIError(400, f"n is {n} but this server generates at most {scheduler.engine.batch_size} "
                                "sequences together (--max_batch_size)", param="n")
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        bridge = bridges.get(loop) or bridges.setdefault(loop, EventBridge(loop))
        gens = [Generation(bridge, tokenizer, stops, events, i) for i in range(n)]
        reqs = [Request(ids, dataclasses.replace(sampling, seed=choice_seed(sampling.seed, i)), budget,
                        [] if body.ignore_eos else stop_ids, g.on_tokens, g.on_finish, logprobs=logprobs,
                        on_logprobs=g.on_logprobs) for i, g in enumerate(gens)]
        try:
            for req in reqs:
                scheduler.submit(req)
        except (QueueFull, Draining, MiniCPMError) as e:
            for req in reqs:
                scheduler.cancel(req)
            if isinstance(e, QueueFull):
                raise APIError(429, f"server busy: {e}; retry later", type_="rate_limit_error",
                               headers={"Retry-After": str(RETRY_AFTER_S)}) from None
            raise shutting_down() if isinstance(e, Draining) else APIError(400, str(e)) from None
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        # Tokens delivered: past a stop string the rest of the decode block is generated but not billed.
        done = lambda: sum(g.text.tokens for g in gens)
        usage = lambda: {"prompt_tokens": len(ids), "completion_tokens": done(), "total_tokens": len(ids) + done(),
                         # prompt tokens served from the prefix cache (the prompt is computed once for n > 1)
                         "prompt_tokens_details": {"cached_tokens": min(r.cached_tokens for r in reqs)}}
        http.state.rid, http.state.usage = rid, usage
        http.state.first_token = lambda: min((g.first_token_at for g in gens if g.first_token_at), default=None)
        http.state.phases = lambda: (min(r.submitted_at for r in reqs),
                                     min((r.admitted_at for r in reqs if r.admitted_at), default=None))
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_stream(events, reqs, rid, kind, usage, include_usage, logprobs is not None, echo),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        texts, entries, finish = [[echo] for _ in range(n)], [[] for _ in range(n)], [None] * n
        checked = time.monotonic()
        try:
            while None in finish:
                event = None
                try:
                    event = await asyncio.wait_for(events.get(), timeout=DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    pass
                # Every DISCONNECT_POLL_S, whether tokens arrive or not (they come every decode step).
                if time.monotonic() - checked >= DISCONNECT_POLL_S:
                    checked = time.monotonic()
                    if await http.is_disconnected():
                        for req in reqs:
                            scheduler.cancel(req)
                        return JSONResponse({}, status_code=499)
                if event is None:
                    continue
                i = event[1]
                if event[0] == "text":
                    texts[i].append(event[2])
                    entries[i] += event[3]
                else:
                    finish[i], entries[i] = (event[2], event[3]), entries[i] + event[4]
                    if event[2] in ("error", "shutdown"):
                        break
        except asyncio.CancelledError:
            for req in reqs:
                scheduler.cancel(req)
            raise
        for reason, error in filter(None, finish):
            if reason in ("error", "shutdown"):
                for req in reqs:
                    scheduler.cancel(req)
                if reason == "error":
                    raise APIError(500, f"generation failed: {error}", type_="server_error")
                raise shutting_down()
        choices = []
        for i in range(n):
            content = "".join(texts[i])
            if kind == "chat":
                choices.append({"index": i, "message": {"role": "assistant", "content": content},
                                "logprobs": chat_logprobs(entries[i]) if logprobs is not None else None,
                                "finish_reason": finish[i][0]})
            else:
                choices.append({"index": i, "text": content, "finish_reason": finish[i][0],
                                "logprobs": completion_logprobs(entries[i], 0) if logprobs is not None else None})
        return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
                "created": int(time.time()), "model": model_name, "choices": choices, "usage": usage()}

    async def _stream(events: asyncio.Queue, reqs, rid: str, kind: str, usage, include_usage: bool, logprobs: bool,
                      echo: str):
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        offsets = [len(echo)] * len(reqs)

        def chunk(i: int, delta: str | None, finish: str | None, entries=(), first: bool = False) -> str:
            if kind == "chat":
                d = {"role": "assistant", "content": ""} if first else ({"content": delta} if delta is not None else {})
                choice = {"index": i, "delta": d, "logprobs": chat_logprobs(entries) if logprobs and entries else None,
                          "finish_reason": finish}
            else:
                lp = completion_logprobs(entries, offsets[i]) if logprobs and entries else None
                offsets[i] += len(delta or "")
                choice = {"index": i, "text": delta or "", "finish_reason": finish, "logprobs": lp}
            payload = {"id": rid, "object": obj, "created": int(time.time()), "model": model_name, "choices": [choice]}
            if include_usage:
                payload["usage"] = None
            return f"data: {json.dumps(payload)}\n\n"

        try:
            for i in range(len(reqs)):
                if kind == "chat":
                    yield chunk(i, None, None, first=True)
                elif echo:
                    offsets[i] = 0
                    yield chunk(i, echo, None)
            running, failed = len(reqs), False
            while running and not failed:
                arrived = [await events.get()]
                while not events.empty():  # behind the scheduler: what arrived meanwhile goes as one chunk
                    arrived.append(events.get_nowait())
                for event in coalesced(arrived):
                    if event[0] == "text":
                        yield chunk(event[1], event[2], None, event[3])
                        continue
                    i, reason, error, entries = event[1:]
                    if reason in ("error", "shutdown"):
                        e = shutting_down() if reason == "shutdown" else None
                        body = (error_body(e.message, e.type, code=e.code) if e else
                                error_body(f"generation failed: {error}", "server_error"))
                        yield f"data: {json.dumps(body)}\n\n"
                        failed = True
                        break
                    if entries:  # tokens whose text came with the last flush
                        yield chunk(i, "" if kind == "completion" else None, None, entries)
                    yield chunk(i, None, reason)
                    running -= 1
            if not failed:
                if include_usage:
                    yield f"data: {json.dumps({'id': rid, 'object': obj, 'created': int(time.time()), 'model': model_name, 'choices': [], 'usage': usage()})}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # the client went away mid-stream (or the stream ended): the slots are freed either way
            for req in reqs:
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
