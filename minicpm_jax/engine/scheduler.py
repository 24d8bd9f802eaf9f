"""Continuous batching over an :class:`~minicpm_jax.engine.engine.Engine`'s static slots, for serving.

Requests wait in a bounded queue. The scheduler works in steps (a server runs them back to back): each
step admits queued requests into the free slots, prefills one chunk of the prompts waiting to start
under a token budget (a long prompt goes in pieces over several steps; its slot alone is computed, the
other rows keep their state) and samples the first token of the prompts it completes, then advances
every running row by one decode block on device. So a long prompt slows the running rows by a chunk per
step instead of stopping them until it is all read (vLLM's chunked prefill, llama.cpp's n_batch). A row
that finishes (stop id, token budget, full cache), is stopped by its consumer (a stop string) or is
cancelled (client gone) frees its slot for the next queued request at the next step.

Each row's numbers are independent of the other rows (per-row attention, sampling keys per request), so
a request gives the same tokens whether it runs alone or joins a busy batch (checked in the tests).
Callbacks run on the scheduler's thread.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from minicpm_jax.engine.engine import Engine, decode_row_counts
from minicpm_jax.engine.sampling import TOP_LOGPROBS, SamplingParams, sampling_kind
from minicpm_jax.engine.stops import FINISH_NAMES, DecodeState, stop_table
from minicpm_jax.errors import MiniCPMError

log = logging.getLogger(__name__)

# The sampling paths a scheduler's steps are compiled for (Scheduler._sampling picks one per step).
SERVED_SAMPLING = ("temperature", "filtered")


@jax.jit
def start_rows(mask: jax.Array, fresh: DecodeState, state: DecodeState) -> DecodeState:
    """``state`` with the rows ``mask bool[B]`` taken from ``fresh``. Jitted: an eager op on a state still
    being computed blocks the host on the CPU backend until the device queue drains."""
    return jax.tree.map(lambda new, old: jnp.where(mask.reshape((-1,) + (1,) * (new.ndim - 1)), new, old), fresh, state)


@jax.jit
def end_rows(mask: jax.Array, state: DecodeState) -> DecodeState:
    """``state`` with the rows ``mask bool[B]`` marked done (jitted, see :func:`start_rows`)."""
    return dataclasses.replace(state, done=state.done | mask)


@dataclasses.dataclass
class StepStats:
    """What the scheduler's steps did since it started (``/health`` reports it; a load benchmark differences
    two readings): where a server's time goes without a profiler.

    ``busy_s`` is the time inside :meth:`Scheduler.step`, ``device_wait_s`` the part of it the host spent
    waiting for the device's results (the block in flight, the first tokens). With the device always busy
    the wait is most of the step; a small wait means the host's work (scheduling, delivering tokens, the
    HTTP threads' share of the interpreter lock) paces the steps, not the device; ``dispatch_s`` is the
    part spent handing work to the device. ``cpu_s`` is the scheduler thread's CPU time in its steps: what
    is neither that nor the device wait was spent blocked otherwise, mostly waiting for the interpreter
    lock while other threads (the HTTP server's) held it."""

    steps: int = 0
    prefill_steps: int = 0  # steps that dispatched a prompt chunk
    prefill_tokens: int = 0  # prompt tokens those chunks carried
    decode_steps: int = 0  # steps that dispatched a decode block
    decode_rows: int = 0  # running rows those blocks advanced, summed over the blocks
    busy_s: float = 0.0
    device_wait_s: float = 0.0
    dispatch_s: float = 0.0  # host time in the engine's calls that queue device work (its arguments, launches)
    cpu_s: float = 0.0  # the scheduler thread's CPU time inside steps (time.thread_time)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class QueueFull(MiniCPMError):
    """The request queue is at its limit; retry later."""


class Draining(MiniCPMError):
    """The scheduler admits no more requests (the server is shutting down)."""


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request.

    on_tokens(new_ids) is called with each block of new token ids and may return True to stop the row
    (e.g. a stop string was matched). on_finish(finish_reason, error) is called once at the end:
    finish_reason is "stop", "length", "cancelled" (the client went away), "shutdown" (ended by
    :meth:`Scheduler.drain` / :meth:`Scheduler.cancel_all`) or "error" (with the engine's message).
    logprobs: None, or how many most likely alternatives (0..``TOP_LOGPROBS``) to report with each
    token's log-probability: ``on_logprobs(entries)`` is then called before each ``on_tokens`` with one
    ``(logprob, [(id, logprob), ...])`` per new token (computed on device from the logits the token was
    sampled from; plain decoding only).
    """

    prompt_ids: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    stop_ids: list[int]
    on_tokens: Callable[[list[int]], bool | None]
    on_finish: Callable[[str, str | None], None]
    output: list[int] = dataclasses.field(default_factory=list)
    cancelled: bool = False
    end_reason: str = "cancelled"  # the finish reason a cancelled request ends with
    logprobs: int | None = None
    on_logprobs: Callable[[list[tuple[float, list[tuple[int, float]]]]], None] | None = None
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (paged engines) when first admitted
    preemptions: int = 0  # times its pages were taken back; it resumed from its prompt and output so far
    # time.perf_counter() when it was queued (submit) and first given a slot; None before that
    submitted_at: float | None = None
    admitted_at: float | None = None


class Scheduler:
    """Schedules the engine's slots step by step, on its own thread: each step admits queued requests into
    free slots, runs one prefill chunk of the prompts waiting to start (at most ``prefill_budget`` prompt
    tokens, oldest first) and one decode block of the running rows.

    Args:
      engine: the engine whose batch slots, cache and compiled steps are used (owned by the scheduler
        from now on; do not call ``engine.generate`` concurrently).
      max_queue: requests allowed to wait for a slot; ``submit`` raises :class:`QueueFull` beyond it.
      prefill_budget: prompt tokens prefilled per step (default ``engine.chunk_length``). A longer prompt
        is fed in pieces of this many tokens (at most ``chunk_length``), one piece per step, so running
        rows advance a decode block between pieces instead of waiting for the whole prompt; shorter
        prompts share a step while their pieces fit the budget (and run in the same chunk width, at most
        :meth:`max_rows` of them).
        Piece boundaries depend on the prompt alone, so a prompt is computed the same way whatever else
        runs.
      overlap: dispatch each step's work before waiting for the decode block in flight, so the device
        always has the next block queued and never waits for the host between blocks (the host's
        scheduling, the tokens' delivery and the HTTP threads' share of the interpreter lock hide behind
        the device's work). A request then starts one block later and a freed slot is reused one block
        later. Worth it where a decode step is short against the host's work (a GPU); without it (the
        default) a step waits for the block in flight first, and the host's work between two blocks is
        device idle time.
    """

    def __init__(self, engine: Engine, max_queue: int = 64, prefill_budget: int | None = None,
                 overlap: bool = False):
        if max_queue < 0:
            raise MiniCPMError(f"max_queue must be >= 0, got {max_queue}")
        budget = engine.chunk_length if prefill_budget is None else prefill_budget
        if budget < 1:
            raise MiniCPMError(f"prefill_budget must be >= 1, got {budget}")
        self.engine = engine
        self.max_queue = max_queue
        self.prefill_budget = budget
        self.piece = min(budget, engine.chunk_length)  # tokens of one prompt per step
        self.overlap = overlap
        self.slots: list[Request | None] = [None] * engine.batch_size
        # What each slot feeds: its request's prompt (and, resuming after a preemption, the output so far),
        # how much of it is in the cache, and how long the output was when the slot took the request.
        self._seq: list[list[int]] = [[] for _ in range(engine.batch_size)]
        self._fed = [0] * engine.batch_size
        self._out0 = [0] * engine.batch_size
        self._admitted = [0] * engine.batch_size  # admission order (oldest prompt first)
        self._admissions = 0
        self._pending = None  # the decode block in flight: read during the next step
        self._queue: collections.deque[Request] = collections.deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._draining = False
        self._thread: threading.Thread | None = None
        self._ds = engine.decode_state([], [], [])  # every slot starts finished
        engine.reset()
        self.finished: collections.Counter[str] = collections.Counter()  # requests ended, by finish reason
        self.generated_tokens = 0
        # Speculative decoding: rounds by the tokens they emitted (0, 1, ..., A) since the start; else None.
        self.accept_counts: list[int] | None = None
        self.preempted = 0  # paged engines: requests whose pages were taken back (they resume later)
        self.stats = StepStats()

    # ------------------------------------------------------------------ client side (any thread)
    def check(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        """Raises MiniCPMError if the request can never run (empty, bad ids, longer than the context)."""
        eng = self.engine
        if not prompt_ids:
            raise MiniCPMError("empty prompt")
        if any(t < 0 or t >= eng.config.vocab_size for t in prompt_ids):
            raise MiniCPMError(f"prompt has token ids outside the vocabulary [0, {eng.config.vocab_size})")
        if len(prompt_ids) >= eng.max_length:
            raise MiniCPMError(f"the prompt has {len(prompt_ids)} tokens but the context is {eng.max_length} tokens")
        if max_new_tokens < 1:
            raise MiniCPMError(f"max_tokens must be >= 1, got {max_new_tokens}")
        if eng.paged and eng.books.pages_for(len(prompt_ids) + 1) > eng.books.pages.num_pages:
            raise MiniCPMError(f"the prompt has {len(prompt_ids)} tokens but the KV pool holds "
                               f"{eng.books.pages.num_pages * eng.books.page_size}")

    def submit(self, request: Request) -> None:
        """Queues ``request``; raises QueueFull when ``max_queue`` requests are already waiting."""
        self.check(request.prompt_ids, request.max_new_tokens)
        stop_table([request.stop_ids], 1)  # validates the stop-id count
        if request.logprobs is not None:
            if not 0 <= request.logprobs <= TOP_LOGPROBS:
                raise MiniCPMError(f"logprobs takes 0..{TOP_LOGPROBS} alternatives, got {request.logprobs}")
            if not self.engine.has_logprobs:
                raise MiniCPMError("log-probabilities are not available with speculative decoding")
        with self._cv:
            if self._stopping or self._draining:
                raise Draining("the server is shutting down")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"{len(self._queue)} requests are already waiting")
            request.submitted_at = time.perf_counter()
            self._queue.append(request)
            self._cv.notify()

    def cancel(self, request: Request, reason: str = "cancelled") -> None:
        """Stops ``request`` (queued or running) at the next block; its slot is freed and it finishes with
        ``reason`` (unless it already ended)."""
        with self._cv:
            if not request.cancelled:
                request.cancelled, request.end_reason = True, reason
            self._cv.notify()

    def drain(self) -> None:
        """Admits nothing more: ``submit`` raises :class:`Draining` from now on and queued requests end as
        "shutdown" at once (called from any thread); running requests go on to their end."""
        with self._cv:
            self._draining = True
            kept = collections.deque(r for r in self._queue if r.preemptions and not r.cancelled)  # started: run on
            for req in self._queue:
                if req not in kept:
                    self.finished["shutdown"] += 1
                    req.on_finish("shutdown", None)
            self._queue = kept
            self._cv.notify()

    def cancel_all(self, reason: str = "shutdown") -> None:
        """Ends every running and queued request at the next block with ``reason``."""
        with self._cv:
            for req in [*self.slots, *self._queue]:
                if req is not None and not req.cancelled:
                    req.cancelled, req.end_reason = True, reason
            self._cv.notify()

    @property
    def idle(self) -> bool:
        """Nothing running and nothing queued."""
        with self._cv:
            return not self._queue and self.active == 0

    @property
    def completed(self) -> int:
        """Requests that have ended, whatever the reason."""
        return sum(self.finished.values())

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def active(self) -> int:
        return sum(r is not None for r in self.slots)

    # ------------------------------------------------------------------ scheduler thread
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="minicpm-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Finishes nothing more: pending and running requests end as cancelled."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                if not self._queue and self.active == 0:
                    self._pending = None  # its rows have all ended
                while not self._stopping and not self._queue and self.active == 0:
                    self._cv.wait()
                if self._stopping:
                    break
            try:
                self.step()
            except Exception as e:  # an engine failure ends the running requests, not the server
                log.exception("scheduler step failed")
                self._fail_all(f"{type(e).__name__}: {e}")
        for slot, req in enumerate(self.slots):
            if req is not None:
                self._finish(slot, "cancelled")
        while self._queue:
            req = self._queue.popleft()
            req.on_finish("cancelled", None)

    def step(self) -> None:
        """One scheduling step: wait for the decode block in flight, admit into free slots, end cancelled
        requests, dispatch one prefill chunk (first tokens for the prompts it completes) and the next
        decode block of the running rows, then hand out the finished block's tokens and the new first
        tokens while the device runs the next block. A request that arrives during a block is prefilled
        right after it; a host-side stop (stop string, cancellation) takes effect a block later (the
        extra tokens are dropped). With ``overlap`` the wait is left to the delivery of the block in flight,
        after the next block is dispatched behind it: the same decisions, a block later."""
        t0, c0 = time.perf_counter(), time.thread_time()
        pending, self._pending = self._pending, None
        if pending is not None and not self.overlap:
            self._wait(jax.block_until_ready, pending[2])
        self._admit()
        self._drop_cancelled()
        started = self._prefill()
        decoding = self._room_for_block([slot for slot, req in enumerate(self.slots)
                                         if req is not None and self._fed[slot] == len(self._seq[slot])])
        if decoding:
            k = self._logprobs(decoding)
            t = time.perf_counter()
            self._ds, block, *lps = self.engine.decode(self._ds, sampling=self._sampling(decoding), logprobs=k,
                                                       rows=decoding)
            self.stats.dispatch_s += time.perf_counter() - t
            running = set(decoding)
            flags = [slot in running for slot in range(self.engine.batch_size)]
            self._pending = (list(self.slots), flags, block, self._ds.done, self._ds.finish, lps[0] if k else None,
                             self.engine.accept_counts())
            self.stats.decode_steps += 1
            self.stats.decode_rows += len(decoding)
        if pending is not None:
            self._deliver_block(pending)
        if started is not None:
            self._deliver_first(*started)
        self.stats.steps += 1
        self.stats.busy_s += time.perf_counter() - t0
        self.stats.cpu_s += time.thread_time() - c0

    def _wait(self, fetch, value):
        """``fetch(value)`` (a device-to-host read or a wait), its time counted as the device's."""
        t = time.perf_counter()
        out = fetch(value)
        self.stats.device_wait_s += time.perf_counter() - t
        return out

    def _admit(self) -> None:
        """Moves queued requests into free slots, oldest first. A paged engine admits by memory: while the
        pool has pages for the request's uncached prompt beside a page of headroom per running request
        (the first that does not fit waits, and the ones behind it), and it holds back a request whose next
        prompt page another slot is computing right now (it shares that page once published: the ``n``
        completions of one request, or many clients sending one system prompt at once)."""
        eng = self.engine
        with self._cv:
            free = [i for i, r in enumerate(self.slots) if r is None]
            taken: list[tuple[int, Request]] = []
            waiting: list[Request] = []
            headroom = self.active
            while free and self._queue:
                req = self._queue.popleft()
                if req.cancelled:
                    self.finished[req.end_reason] += 1
                    req.on_finish(req.end_reason, None)
                    continue
                if eng.paged:
                    seq = req.prompt_ids + req.output
                    if eng.books.pages_for(len(seq) + 1) > eng.books.pages.num_pages:  # outgrew the pool
                        self.finished["length"] += 1
                        req.on_finish("length", None)
                        continue
                    cached = eng.cached_tokens(seq)
                    if self._computing(seq, cached, [r.prompt_ids + r.output for _, r in taken]):
                        waiting.append(req)
                        continue
                    need = eng.books.pages_for(len(seq) - cached + 1) + headroom
                    if need > eng.available_pages() - eng.books.pages_for(cached):
                        self._queue.appendleft(req)
                        break
                    headroom += 1
                taken.append((free.pop(0), req))
            self._queue.extendleft(reversed(waiting))
        if not taken:
            return
        mask = np.zeros(eng.batch_size, bool)
        for slot, _ in taken:
            mask[slot] = True
        eng.reset(mask)
        for slot, req in taken:
            self.slots[slot], self._fed[slot] = req, 0
            if req.admitted_at is None:
                req.admitted_at = time.perf_counter()
            self._seq[slot], self._out0[slot] = req.prompt_ids + req.output, len(req.output)
            if eng.paged:
                self._fed[slot] = eng.admit(slot, self._seq[slot])
                if not req.preemptions:
                    req.cached_tokens = self._fed[slot]
            self._admissions += 1
            self._admitted[slot] = self._admissions

    def _computing(self, seq: list[int], cached: int, starting: list[list[int]]) -> bool:
        """Whether another request is computing the page of ``seq`` after its cached prefix: a slot that
        has not fed it yet, or one of ``starting`` (the sequences admitted in this step), with the same
        tokens from position 0."""
        end = cached + self.engine.books.page_size
        if end > len(seq):
            return False
        feeding = [self._seq[s] for s, req in enumerate(self.slots) if req is not None and self._fed[s] < end]
        return any(end <= len(other) and other[:end] == seq[:end] for other in feeding + starting)

    # ------------------------------------------------------------------ paged memory
    def _known(self, slot: int) -> list[int]:
        """The tokens whose K/V the slot's cache holds, from position 0: its fed prompt, then its output but
        the last token (sampled, not yet run)."""
        req, seq, fed = self.slots[slot], self._seq[slot], self._fed[slot]
        if fed < len(seq):
            return seq[:fed]
        full = req.prompt_ids + req.output
        return full[: max(len(seq), len(full) - 1)]

    def _preempt(self, slot: int) -> None:
        """Takes the slot's pages back (its full pages stay in the prefix cache) and queues its request
        first: it resumes from its prompt and output so far, drawing the same tokens (a token's sampling
        key depends only on the request's seed and the token's index), and none is lost or repeated."""
        req = self.slots[slot]
        self.engine.release(slot, self._known(slot))
        self.slots[slot] = None
        req.preemptions += 1
        self.preempted += 1
        self._mark_done([slot])
        with self._cv:
            self._queue.appendleft(req)
        log.info("preempted a request to free KV pages (%d pages available)", self.engine.available_pages())

    def _running(self) -> list[int]:
        return [slot for slot, req in enumerate(self.slots) if req is not None]

    def _room_for_block(self, decoding: list[int]) -> list[int]:
        """The decoding slots whose next block fits the pool: the youngest requests are preempted until it
        does. A request alone that outgrows the whole pool ends with ``length``."""
        eng = self.engine
        if not eng.paged:
            return decoding
        per_block = eng.steps.tokens_per_block
        while decoding and eng.pages_needed({s: per_block for s in decoding}) > eng.available_pages():
            running = self._running()
            victim = max(running, key=self._admitted.__getitem__)
            if len(running) == 1:
                log.warning("a request outgrew the KV pool (%d pages): ended as length", eng.books.pages.num_pages)
                self._finish(victim, "length")
                self._mark_done([victim])
            else:
                self._preempt(victim)
            decoding = [s for s in decoding if s != victim]
        return decoding

    def _prefill(self):
        """Dispatches one prefill chunk: the oldest waiting prompt's next piece, and the next pieces of
        younger ones that fit the budget and the same chunk width. Prompts it completes get their first
        token sampled; returns (their slots, the state holding those tokens), or None."""
        eng = self.engine
        waiting = sorted((slot for slot, req in enumerate(self.slots)
                          if req is not None and self._fed[slot] < len(self._seq[slot])), key=self._admitted.__getitem__)
        if not waiting:
            return None
        rows: list[list[int]] = [[] for _ in range(eng.batch_size)]
        width, used, count = None, 0, 0
        for slot in waiting:
            rest = self._seq[slot][self._fed[slot]:]
            n = min(self.piece, len(rest))
            if width is not None and (used + n > self.prefill_budget or eng.chunk_size(n) != width
                                      or count == self.max_rows(width)):
                continue
            width, used, count = eng.chunk_size(n), used + n, count + 1
            rows[slot] = rest
        if eng.paged and not self._room_for_pieces(rows):
            return None
        t = time.perf_counter()
        logits = eng.prefill_chunk(rows, self.piece)
        self.stats.dispatch_s += time.perf_counter() - t
        self.stats.prefill_steps += 1
        self.stats.prefill_tokens += sum(min(self.piece, len(r)) for r in rows)
        complete = []
        for slot, rest in enumerate(rows):
            if rest:
                self._fed[slot] += min(self.piece, len(rest))
                if eng.paged:  # other prompts with this prefix share its pages from now on
                    eng.publish(slot, self._seq[slot][: self._fed[slot]])
                if self._fed[slot] == len(self._seq[slot]):
                    complete.append(slot)
        if not complete:
            return None
        mask = np.zeros(eng.batch_size, bool)
        samplings = [SamplingParams()] * eng.batch_size
        budgets, stops = [1] * eng.batch_size, [[] for _ in range(eng.batch_size)]
        generated = [0] * eng.batch_size
        for slot in complete:
            req = self.slots[slot]
            mask[slot] = True
            samplings[slot], budgets[slot], stops[slot] = req.sampling, req.max_new_tokens, req.stop_ids
            generated[slot] = len(req.output)  # resuming after a preemption: draws go on from there
        m = jnp.asarray(mask)
        ds = start_rows(m, eng.decode_state(samplings, budgets, stops, generated), self._ds)
        k = self._logprobs(complete)
        kind = self._sampling(complete)
        t = time.perf_counter()
        self._ds, *lps = (eng.first_token(ds, logits, m, kind, logprobs=k) if k else (eng.first_token(ds, logits, m, kind),))
        eng.start(self._ds, m)
        self.stats.dispatch_s += time.perf_counter() - t
        return complete, (self._ds.tok, self._ds.done, self._ds.finish, lps[0] if k else None)

    def _room_for_pieces(self, rows: list[list[int]]) -> bool:
        """Makes the pool hold this step's prompt pieces (``rows``, edited in place): requests younger than
        every piece's are preempted first; then the youngest pieces wait for a later step. False if none
        is left."""
        eng = self.engine

        def need() -> int:
            return eng.pages_needed({s: min(self.piece, len(r)) for s, r in enumerate(rows) if r})

        while need() > eng.available_pages():
            pieces = [s for s, r in enumerate(rows) if r]
            if not pieces:
                return False
            oldest_piece = min(self._admitted[s] for s in pieces)
            younger = [s for s in self._running() if s not in pieces and self._admitted[s] > oldest_piece]
            if younger:
                self._preempt(max(younger, key=self._admitted.__getitem__))
            else:
                rows[max(pieces, key=self._admitted.__getitem__)] = []
        return any(rows)

    def max_rows(self, width: int) -> int:
        """Prompts one prefill step takes at chunk width ``width``: as many as ``width``-token pieces fit
        the budget, at most the engine's ``scratch_rows`` (so they run over their own rows, never every
        slot), at least one. This bounds the forward to about ``prefill_budget`` tokens however short the
        prompts, and the compiled shapes to :meth:`prefill_shapes`."""
        return max(1, min(self.prefill_budget // width, self.engine.scratch_rows))

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """Every (prompt rows, piece tokens) a prefill step of this scheduler can dispatch, one per compiled
        program of the engine (its chunk widths, and its :meth:`~Engine.prefill_row_count` buckets of up to
        :meth:`max_rows` rows): what a server compiles before it accepts requests."""
        eng = self.engine
        shapes = {}
        for n in range(1, self.piece + 1):
            width = eng.chunk_size(n)
            for live in range(1, min(self.max_rows(width), eng.batch_size) + 1):
                shapes.setdefault((eng.prefill_row_count(live), width), (live, min(width, self.piece)))
        return sorted(shapes.values())

    def compile_prefill(self, token: int = 0) -> None:
        """Runs a prefill step of every shape of :meth:`prefill_shapes` (prompts of ``token`` repeated) and
        forgets them: compiles what prompts will meet, so no request waits for a compilation (on a GPU one
        takes seconds and stalls every running stream). Only before :meth:`start`, with every slot idle."""
        if self._thread is not None or any(self.slots):
            raise MiniCPMError("compile_prefill runs before the scheduler starts, with every slot idle")
        for live, n in self.prefill_shapes():
            self.engine.prefill_chunk([[token] * (n + 1)] * live, n)
            if self.engine.paged:  # a small pool need not hold every shape's pages at once
                self.engine.reset()
        self.engine.reset()

    def compile_decode(self, sampling: tuple[str, ...] = SERVED_SAMPLING) -> None:
        """Compiles every decode program the steps may dispatch, so no request waits for one: the first token
        and a decode block on both sampling paths (:data:`SERVED_SAMPLING`), with and without
        log-probabilities (those run every slot); a paged engine decodes only its running rows, padded to a
        count of :func:`~minicpm_jax.engine.engine.decode_row_counts`, so each such count. Runs them on
        finished rows and keeps nothing. Only before :meth:`start`, with every slot idle.

        ``sampling``: the paths to compile (default both). Fewer is for servers that know their requests
        (a test's never ask for top-k / top-p): a request on a path left out compiles it when it comes."""
        eng = self.engine
        if self._thread is not None or any(self.slots):
            raise MiniCPMError("compile_decode runs before the scheduler starts, with every slot idle")
        if not set(sampling) <= set(SERVED_SAMPLING):
            raise MiniCPMError(f"compile_decode compiles the served sampling paths {SERVED_SAMPLING}, got {sampling}")
        counts = decode_row_counts(eng.batch_size) if eng.paged and eng.steps.decodes_rows else [None]
        logits = jnp.zeros((eng.batch_size, eng.config.vocab_size), jnp.float32)
        idle = jnp.zeros(eng.batch_size, bool)
        for kind in sampling:
            for lp in [0] + ([TOP_LOGPROBS] if eng.has_logprobs else []):
                eng.first_token(self._ds, logits, idle, kind, logprobs=lp)
            eng.start(self._ds)  # every slot finished (a speculative step set needs a started state)
            for n in counts:
                eng.decode(self._ds, sampling=kind, rows=None if n is None else list(range(n)))
                eng.reset()
            if eng.has_logprobs:  # steps with log-probabilities run every slot
                eng.decode(self._ds, sampling=kind, logprobs=TOP_LOGPROBS)
                eng.reset()

    def _sampling(self, slots: list[int]) -> str:
        """The static sampling path of a step over ``slots``: ``filtered`` if one of their requests asks for
        top-k / top-p, else ``temperature`` (greedy rows take their argmax on either path). Never ``auto``:
        its choice on device is a conditional, and on a GPU XLA reads a conditional's predicate on the
        host, so the host waited for each step's forward before it could launch the rest and queue the next
        step (8B on an H100: ~8-9 ms of host time a step around ~6.2 ms of kernels). Two compiled
        variants of each step (:data:`SERVED_SAMPLING`); ``greedy`` alone would save only the draw."""
        return "filtered" if sampling_kind([self.slots[s].sampling for s in slots]) == "filtered" else "temperature"

    def _logprobs(self, slots: list[int]) -> int:
        """The alternatives a step computes: ``TOP_LOGPROBS`` if a request of ``slots`` asks for any, else 0
        (two compiled variants of each step, not one per request)."""
        return TOP_LOGPROBS if any(self.slots[s].logprobs is not None for s in slots) else 0

    @staticmethod
    def _entries(req: Request, lps, slot: int, steps) -> list | None:
        """``req``'s log-probability entries for the tokens at ``steps`` of its row."""
        if lps is None or req.logprobs is None:
            return None
        lp, ids, top = lps
        return [(float(lp[slot][j]), [(int(i), float(v)) for i, v in zip(ids[slot][j][: req.logprobs],
                                                                         top[slot][j][: req.logprobs])])
                for j in steps]

    def _deliver_first(self, slots: list[int], state) -> None:
        tok, done, finish, lps = self._wait(jax.device_get, state)
        if lps is not None:
            lps = tuple(x[:, None] for x in lps)  # one step
        self._mark_done([slot for slot in slots if self.slots[slot] is not None and self._deliver(
            slot, self.slots[slot], [int(tok[slot])], bool(done[slot]), int(finish[slot]),
            self._entries(self.slots[slot], lps, slot, [0]))])

    def _deliver_block(self, pending) -> None:
        owners, decoding, block, done, finish, lps, accepted = pending
        block, done, finish, lps, accepted = self._wait(jax.device_get, (block, done, finish, lps, accepted))
        if accepted is not None:
            self.accept_counts = [int(x) for x in accepted]
        ended = []
        # Python ints once for the whole block (indexing NumPy arrays per row and token cost more than the
        # rest of a 64-row delivery).
        rows, done, finish = block.tolist(), done.tolist(), finish.tolist()
        for slot, req in enumerate(owners):
            # The slot's request when the block was dispatched, if it still runs (not ended by the host since).
            if req is None or not decoding[slot] or self.slots[slot] is not req:
                continue
            steps = [j for j, t in enumerate(rows[slot]) if t >= 0]
            if self._deliver(slot, req, [rows[slot][j] for j in steps], bool(done[slot]), finish[slot],
                             self._entries(req, lps, slot, steps)):
                ended.append(slot)
            elif self.engine.paged and self.slots[slot] is req:
                # Its length on the device now, plus the block dispatched behind this one (overlap).
                ahead = self.engine.steps.tokens_per_block if self._pending is not None and self._pending[1][slot] else 0
                self.engine.settle(slot, len(self._seq[slot]) + len(req.output) - self._out0[slot] - 1 + ahead)
        self._mark_done(ended)

    def _drop_cancelled(self) -> None:
        gone = [slot for slot, req in enumerate(self.slots) if req is not None and req.cancelled]
        for slot in gone:
            self._finish(slot, self.slots[slot].end_reason)
        self._mark_done(gone)

    def _deliver(self, slot: int, req: Request, toks: list[int], device_done: bool, finish: int,
                 entries: list | None = None) -> bool:
        """Hands a row's new tokens (and their log-probability ``entries``) to its consumer and ends the
        request if it is over. Returns True when the host ended it (cancelled, or the consumer asked to
        stop), so the row is marked done on device.

        A failing consumer cancels its own request only."""
        halt = False
        if toks and not req.cancelled:
            req.output.extend(toks)
            self.generated_tokens += len(toks)
            try:
                if entries is not None and req.on_logprobs is not None:
                    req.on_logprobs(entries)
                halt = bool(req.on_tokens(toks))
            except Exception:
                log.exception("on_tokens callback failed; cancelling that request")
                req.cancelled = True
        if req.cancelled:
            self._finish(slot, req.end_reason)
            return True
        if device_done:
            self._finish(slot, FINISH_NAMES.get(finish, "stop"))
            return False
        if halt:
            self._finish(slot, "stop")
        return halt

    def _mark_done(self, slots: list[int]) -> None:
        """Marks rows finished on device (host-side stops), so later blocks skip them."""
        if not slots:
            return
        mask = np.zeros(self.engine.batch_size, bool)
        mask[slots] = True
        self._ds = end_rows(jnp.asarray(mask), self._ds)

    def _finish(self, slot: int, reason: str, error: str | None = None) -> None:
        req = self.slots[slot]
        if self.engine.paged:  # its pages go back; the full ones stay cached (not after a failed step)
            self.engine.release(slot, None if error else self._known(slot))
        self.slots[slot] = None
        self.finished[reason] += 1
        try:
            req.on_finish(reason, error)
        except Exception:  # a consumer's failure must not stop the other rows
            log.exception("on_finish callback failed")

    def _fail_all(self, message: str) -> None:
        for slot, req in enumerate(self.slots):
            if req is not None:
                self._finish(slot, "error", message)
        self._pending = None
        self._ds = self.engine.decode_state([], [], [])
        self.engine.reset()
