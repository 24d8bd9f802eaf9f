"""Continuous batching over an :class:`~minicpm_jax.engine.engine.Engine`'s static slots, for serving.

Requests wait in a bounded queue. Between decode blocks, queued requests are admitted into free slots:
their prompts are prefilled (the other rows are untouched: their chunk tokens are masked out) and their
first token sampled, then every active row advances together by one decode block on device. A row that
finishes (stop id, token budget, full cache), is stopped by its consumer (a stop string) or is cancelled
(client gone) frees its slot for the next queued request at once.

Each row's numbers are independent of the other rows (per-row attention, sampling keys per request), so
a request gives the same tokens whether it runs alone or joins a busy batch (checked in the tests).
Callbacks run on the scheduler's thread.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from minicpm_jax.engine.engine import Engine
from minicpm_jax.engine.sampling import SamplingParams
from minicpm_jax.engine.stops import FINISH_NAMES, stop_table
from minicpm_jax.errors import MiniCPMError

log = logging.getLogger(__name__)


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


class Scheduler:
    """Admits queued requests into the engine's free slots between decode blocks (on its own thread).

    Args:
      engine: the engine whose batch slots, cache and compiled steps are used (owned by the scheduler
        from now on; do not call ``engine.generate`` concurrently).
      max_queue: requests allowed to wait for a slot; ``submit`` raises :class:`QueueFull` beyond it.
    """

    def __init__(self, engine: Engine, max_queue: int = 64):
        if max_queue < 0:
            raise MiniCPMError(f"max_queue must be >= 0, got {max_queue}")
        self.engine = engine
        self.max_queue = max_queue
        self.slots: list[Request | None] = [None] * engine.batch_size
        self._queue: collections.deque[Request] = collections.deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._draining = False
        self._thread: threading.Thread | None = None
        self._ds = engine.decode_state([], [], [])  # every slot starts finished
        engine.reset()
        self.finished: collections.Counter[str] = collections.Counter()  # requests ended, by finish reason
        self.generated_tokens = 0

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

    def submit(self, request: Request) -> None:
        """Queues ``request``; raises QueueFull when ``max_queue`` requests are already waiting."""
        self.check(request.prompt_ids, request.max_new_tokens)
        stop_table([request.stop_ids], 1)  # validates the stop-id count
        with self._cv:
            if self._stopping or self._draining:
                raise Draining("the server is shutting down")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"{len(self._queue)} requests are already waiting")
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
            while self._queue:
                req = self._queue.popleft()
                self.finished["shutdown"] += 1
                req.on_finish("shutdown", None)
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
        """Admits what fits, then runs one decode block for the active rows."""
        self._admit()
        self._drop_cancelled()
        if self.active:
            self._decode()

    def _admit(self) -> None:
        eng = self.engine
        with self._cv:
            free = [i for i, r in enumerate(self.slots) if r is None]
            taken: list[tuple[int, Request]] = []
            while free and self._queue:
                req = self._queue.popleft()
                if req.cancelled:
                    self.finished[req.end_reason] += 1
                    req.on_finish(req.end_reason, None)
                    continue
                taken.append((free.pop(0), req))
        if not taken:
            return
        mask = np.zeros(eng.batch_size, bool)
        rows: list[list[int]] = [[] for _ in range(eng.batch_size)]
        samplings = [SamplingParams()] * eng.batch_size
        budgets, stops = [1] * eng.batch_size, [[] for _ in range(eng.batch_size)]
        for slot, req in taken:
            mask[slot] = True
            rows[slot] = req.prompt_ids
            samplings[slot], budgets[slot], stops[slot] = req.sampling, req.max_new_tokens, req.stop_ids
            self.slots[slot] = req
        m = jnp.asarray(mask)
        eng.reset(mask)
        logits = eng.prefill(rows)
        fresh = eng.decode_state(samplings, budgets, stops)
        ds = jax.tree.map(lambda new, old: jnp.where(m.reshape((-1,) + (1,) * (new.ndim - 1)), new, old), fresh, self._ds)
        self._ds = eng.first_token(ds, logits, m)
        tok, done, finish = jax.device_get((self._ds.tok, self._ds.done, self._ds.finish))
        self._mark_done([slot for slot, req in taken
                         if self._deliver(slot, req, [int(tok[slot])], bool(done[slot]), int(finish[slot]))])

    def _drop_cancelled(self) -> None:
        gone = [slot for slot, req in enumerate(self.slots) if req is not None and req.cancelled]
        for slot in gone:
            self._finish(slot, self.slots[slot].end_reason)
        self._mark_done(gone)

    def _decode(self) -> None:
        self._ds, block = self.engine.decode(self._ds)
        block, done, finish = jax.device_get((block, self._ds.done, self._ds.finish))
        self._mark_done([slot for slot, req in enumerate(self.slots) if req is not None and self._deliver(
            slot, req, [int(t) for t in block[slot] if t >= 0], bool(done[slot]), int(finish[slot]))])

    def _deliver(self, slot: int, req: Request, toks: list[int], device_done: bool, finish: int) -> bool:
        """Hands a row's new tokens to its consumer and ends the request if it is over. Returns True when
        the host ended it (cancelled, or the consumer asked to stop), so the row is marked done on device.

        A failing consumer cancels its own request only."""
        halt = False
        if toks and not req.cancelled:
            req.output.extend(toks)
            self.generated_tokens += len(toks)
            try:
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
        self._ds = dataclasses.replace(self._ds, done=self._ds.done | jnp.asarray(mask))

    def _finish(self, slot: int, reason: str, error: str | None = None) -> None:
        req = self.slots[slot]
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
        self._ds = self.engine.decode_state([], [], [])
        self.engine.reset()
