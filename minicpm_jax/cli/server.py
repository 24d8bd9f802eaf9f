"""OpenAI-compatible HTTP server: ``python -m minicpm_jax.server --model_path DIR --port 8000``.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with ``stream`` as server-sent
events ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /health``. Requests are validated by
pydantic schemas (FastAPI); errors come back as OpenAI-style ``{"error": {...}}`` objects with 400
(invalid request), 401 (API key), 404, 413 (body too large) or 429 (queue full, with Retry-After).
Generation runs on the continuous-batching :class:`~minicpm_jax.engine.scheduler.Scheduler`: requests share the
engine's ``--max_batch_size`` slots and a finished or disconnected request frees its slot at once. The routes
are in :mod:`minicpm_jax.cli.server_app`, the API's schemas and middleware in :mod:`minicpm_jax.cli.openai_api`;
this module is the process: flags, loading, warm-up, the listening socket and the draining shutdown.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time

import uvicorn
from absl import app, flags

from minicpm_jax.cli.flags import (
    apply_system_flags, fail, load_from_flags, make_engine, paged_kv_from_flags, sparse_description,
    speculative_description, validate_model_flags, weights_description,
)
from minicpm_jax.cli.openai_api import access_log
from minicpm_jax.errors import MiniCPMError

FLAGS = flags.FLAGS
_H = "server"
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0 for every interface).", module_name=_H)
flags.DEFINE_integer("port", 8000, "TCP port.", module_name=_H)
flags.DEFINE_integer("max_batch_size", 8, "Sequences generated together (the engine's slots: with a paged KV cache a "
                     "bound on a step's sequences, not a memory reservation).", module_name=_H)
flags.DEFINE_enum("kv_cache", "auto", ["auto", "paged", "contiguous"],
                  "KV memory: paged = one pool of pages shared by every request, with prefix caching (a request "
                  "holds the pages its tokens fill; prompts starting alike share them); contiguous = a whole "
                  "--max_length row per slot; auto = paged (an InfLLM-v2 model's when its blocks are --page_size "
                  "tokens, a page each).",
                  module_name=_H)
flags.DEFINE_integer("page_size", 64, "Paged KV cache: tokens per page (a power of two >= 16; an InfLLM-v2 model's "
                     "sparse block size, 64 for MiniCPM4).", module_name=_H)
flags.DEFINE_integer("kv_pages", 0, "Paged KV cache: pages in the pool; 0 = auto: on an accelerator every page "
                     "that fits --memory_limit once the weights are loaded, on a CPU --max_batch_size sequences of "
                     "--max_length.", module_name=_H)
flags.DEFINE_boolean("prefix_caching", True, "Paged KV cache: keep full pages of finished and running requests for "
                     "later prompts that start with the same tokens (evicted least recently used first).",
                     module_name=_H)
flags.DEFINE_integer("max_queue", 64, "Requests that may wait for a slot; more get 429.", module_name=_H)
flags.DEFINE_string("api_key", None, "If set, requests need 'Authorization: Bearer KEY' (401 otherwise).",
                    module_name=_H)
flags.DEFINE_string("served_model_name", None, "Model id in the API (default: the model directory's name).",
                    module_name=_H)
flags.DEFINE_integer("max_body_bytes", 1 << 20, "Largest request body accepted (413 beyond).", module_name=_H)
flags.DEFINE_float("shutdown_grace_s", 25.0, "On SIGTERM / Ctrl-C: seconds running requests may take to finish "
                   "before they are ended (new and queued requests get 503 at once).", module_name=_H)
flags.DEFINE_integer("prefill_budget", 0, "Prompt tokens prefilled per scheduler step (a longer prompt is read in "
                     "pieces of this size, a decode step of the running requests between pieces); 0 = auto: 64 on a "
                     "CPU, 256 on an accelerator, at most --chunk_length.", module_name=_H)
flags.DEFINE_boolean("warm_up", True, "Compile every prefill shape and decode program before listening, so no "
                     "request meets a compilation; --nowarm_up listens at once and compiles each program when a "
                     "request first needs it (development: the first requests of a shape stall every stream).",
                     module_name=_H)
# The scheduler's SERVED_SAMPLING, written out: the flags are defined before jax is imported.
WARM_UP_SAMPLING_PATHS = ["temperature", "filtered"]
flags.DEFINE_multi_enum("warm_up_sampling", WARM_UP_SAMPLING_PATHS, WARM_UP_SAMPLING_PATHS,
                        "Sampling paths whose decode programs the warm-up compiles (repeatable): temperature "
                        "(greedy and temperature-only requests), filtered (top-k / top-p). Leaving one out is "
                        "for servers whose requests never take it (tests): such a request would compile it.",
                        module_name=_H)
flags.DEFINE_enum("log_level", "info", ["debug", "info", "warning", "error"],
                  "Server log level; info writes an access line per request to stderr.", module_name=_H)

_LEVELS = ("debug", "info", "warning", "error")
# The server's --decode_block when the flag is not given (run's is 16): one decode step between scheduling
# decisions, so a new request is admitted within a step and streams get each token as it is made.
SERVER_DECODE_BLOCK = 1
# --prefill_budget auto. On a CPU a prompt token costs about what a decode row does: 64 tokens take about
# one decode step of 8 rows at 2K context (a long prompt at most doubles the streams' gaps) and a chat
# prompt fits one piece (its TTFT among 8 busy clients is then ~1.3x its TTFT alone). An accelerator reads
# the weights once for the whole chunk, so a larger piece costs little more than a decode step.
AUTO_PREFILL_BUDGET = {"cpu": 64}
ACCELERATOR_PREFILL_BUDGET = 256


def scratch_rows(slots: int) -> int:
    """Cache rows the server's prompt pieces may copy out (:class:`~minicpm_jax.engine.engine.Engine`'s
    ``scratch_rows``): the largest power of two at most an eighth of the slots, at least one. So a
    step reads up to that many short prompts over their own rows (not every slot), for at most an eighth
    more K/V memory: 4 rows at 32 slots, 1 at 8 or fewer."""
    return 1 << (max(1, slots // 8).bit_length() - 1)


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
    import jax

    from minicpm_jax.cli.server_app import create_app
    from minicpm_jax.engine.scheduler import Scheduler
    from minicpm_jax.tokenizer import sampling_defaults, stop_token_ids

    validate_model_flags()
    if not FLAGS.shutdown_grace_s >= 0:
        raise MiniCPMError(f"--shutdown_grace_s must be >= 0, got {FLAGS.shutdown_grace_s}")
    if FLAGS.prefill_budget < 0:
        raise MiniCPMError(f"--prefill_budget must be >= 0 (0 = auto), got {FLAGS.prefill_budget}")
    for name in ("max_batch_size", "max_body_bytes"):
        if getattr(FLAGS, name) < 1:
            raise MiniCPMError(f"--{name} must be >= 1, got {getattr(FLAGS, name)}")
    if FLAGS.max_queue < 0 or not 0 < FLAGS.port < 65536:
        raise MiniCPMError("--max_queue must be >= 0 and --port in 1..65535")
    if FLAGS.kv_pages < 0:
        raise MiniCPMError(f"--kv_pages must be >= 0 (0 = auto), got {FLAGS.kv_pages}")
    from minicpm_jax.engine.paging import Paging

    Paging(num_pages=max(FLAGS.kv_pages, 1), page_size=FLAGS.page_size)  # checks --page_size before loading
    sock = listening_socket(FLAGS.host, FLAGS.port)  # before the model loads: a busy port fails at once
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    access_log.addHandler(handler)
    access_log.setLevel(FLAGS.log_level.upper())
    access_log.propagate = False
    apply_system_flags()
    if jax.process_count() > 1:
        raise MiniCPMError("the server runs in one process (its scheduler decides every step): use --tensor_parallel "
                           "over this host's devices, or several hosts with `python -m minicpm_jax.run`")
    paged = paged_kv_from_flags(FLAGS.kv_cache, FLAGS.page_size)
    # A contiguous cache is sized for the slots and the scratch rows: prompt pieces run in copies of their
    # slots' K/V (Engine.prefill_chunk), which the memory plan must leave room for (--max_length auto).
    scratch = 1 if paged else scratch_rows(FLAGS.max_batch_size)
    model_path, model, tokenizer, load_s = load_from_flags(progress=True, batch_size=FLAGS.max_batch_size + scratch,
                                                           paged=paged)
    if not FLAGS["decode_block"].present:
        FLAGS.decode_block = SERVER_DECODE_BLOCK  # make_engine reads it (with a draft: rounds per block)
    budget = FLAGS.prefill_budget or AUTO_PREFILL_BUDGET.get(jax.default_backend(), ACCELERATOR_PREFILL_BUDGET)
    paging = Paging(num_pages=FLAGS.kv_pages or auto_pool_pages(model, budget), page_size=FLAGS.page_size,
                    prefix_caching=FLAGS.prefix_caching) if paged else None
    engine = make_engine(model, batch_size=FLAGS.max_batch_size, scratch_rows=scratch, paging=paging)
    # On an accelerator a decode step (a few ms) is short against the host's scheduling and the HTTP
    # threads' share of the interpreter lock: dispatch the next block before waiting for the one in flight.
    scheduler = Scheduler(engine, max_queue=FLAGS.max_queue, prefill_budget=min(budget, engine.chunk_length),
                          overlap=jax.default_backend() != "cpu")
    stops = stop_token_ids(model.config, tokenizer, model_path)
    t = time.perf_counter()
    if FLAGS.warm_up:
        _warm_up(scheduler, tokenizer, stops)
    name = FLAGS.served_model_name or os.path.basename(os.path.normpath(model_path))
    compiled = f"compiled in {time.perf_counter() - t:.1f} s" if FLAGS.warm_up else "not compiled (--nowarm_up)"
    print(f"minicpm-jax: {name} loaded in {load_s:.1f} s, {compiled}; "
          f"{FLAGS.max_batch_size} slots × {model.max_length} tokens, {kv_description(engine)} ({model.attention_impl} attention, "
          f"{weights_description(model)} weights, sparse attention {sparse_description(model)}, speculative "
          f"{speculative_description(engine)}; prefill {scheduler.prefill_budget} tokens a step, decode blocks of "
          f"{engine.decode_block}); serving on http://{FLAGS.host}:{FLAGS.port}", file=sys.stderr, flush=True)
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


def auto_pool_pages(model, prefill_budget: int) -> int:
    """``--kv_pages 0``: on an accelerator the pages that fit ``--memory_limit`` beside the loaded weights and
    the step workspaces; on a CPU (tests, development) as many as ``--max_batch_size`` whole sequences take,
    what the contiguous cache would hold."""
    import jax

    from minicpm_jax.engine import memory

    if jax.default_backend() == "cpu":
        return FLAGS.max_batch_size * -(-model.max_length // FLAGS.page_size)
    return memory.pool_pages(model.config, budget=memory.device_budget(FLAGS.memory_limit), dtype=model.dtype,
                             page_size=FLAGS.page_size, batch_size=FLAGS.max_batch_size,
                             prefill_tokens=2 * max(prefill_budget, FLAGS.chunk_length),
                             tensor_parallel=FLAGS.tensor_parallel,
                             sparse=model.sparse if model.sparse_active else None)


def kv_description(engine) -> str:
    """The KV cache in a few words, for the startup line."""
    if not engine.paged:
        return "contiguous KV cache"
    p = engine.paging
    caching = "prefix caching" if p.prefix_caching else "no prefix caching"
    return f"paged KV cache of {p.num_pages} pages × {p.page_size} tokens ({p.num_pages * p.page_size} tokens, {caching})"


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
    """Compiles what requests meet before the first arrives: every prefill shape the scheduler can
    dispatch (:meth:`~minicpm_jax.engine.scheduler.Scheduler.compile_prefill`) and every first-token and
    decode program (:meth:`~minicpm_jax.engine.scheduler.Scheduler.compile_decode`, on the sampling paths
    of ``--warm_up_sampling``); then a few requests, with and without log-probabilities, check generation
    end to end before the server listens."""
    from minicpm_jax.engine.sampling import SamplingParams
    from minicpm_jax.engine.scheduler import Request
    from minicpm_jax.tokenizer import encode_prompt

    ids = encode_prompt(tokenizer, "Hello", use_chat_template=False) or [0]
    scheduler.compile_prefill(ids[0])
    scheduler.compile_decode(tuple(FLAGS.warm_up_sampling))
    long = (ids * scheduler.piece)[: min(scheduler.piece, scheduler.engine.max_length - 3)]
    short = long[: max(1, len(long) // 2)]
    errors = []
    # The second round also compiles the steps that return log-probabilities (requests asking for them).
    logprobs = 0 if scheduler.engine.has_logprobs else None
    rounds = [[(long, None)]] + ([[(short, logprobs), (short, None)]] if scheduler.engine.batch_size > 1 else [])
    for prompts in rounds:
        done = []
        for prompt, lp in prompts:
            scheduler.submit(Request(prompt, SamplingParams(), 2, stops, lambda _: False,
                                     lambda reason, error: done.append(error), logprobs=lp))
        while len(done) < len(prompts):
            scheduler.step()
        errors += [e for e in done if e]
    if errors:
        raise MiniCPMError(f"warm-up generation failed: {errors[0]}")


def run() -> None:
    app.run(main)


if __name__ == "__main__":
    run()
