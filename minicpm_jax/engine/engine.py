"""Generation over one model and one static cache: chunked prefill, the first token, on-device decode
blocks, and ``generate`` on top of them.

Data path: prompt ids → :meth:`Engine.prefill` runs fixed-size chunks (one compiled shape; the last chunk
padded) → :meth:`Engine.first_token` samples on device → :meth:`Engine.decode` runs a block of steps per
host round trip inside one jit (``lax.while_loop``, cache donated), stopping rows on stop ids / token
budget / full cache on device. :meth:`Engine.generate` streams each block to the caller and dispatches the
next block before reading the current one, so host work overlaps device work. The device programs are a
step set (:class:`~minicpm_jax.engine.steps.PlainSteps`, or a speculative one); the scheduler drives the
same public methods.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from minicpm_jax.engine.paging import OutOfPages, PagedBooks, Paging
from minicpm_jax.engine.sampling import SamplingParams, row_key, sampling_kind
from minicpm_jax.engine.steps import PlainSteps, PrefillChunk
from minicpm_jax.engine.stops import FINISH_NAMES, FINISH_STOP, DecodeState, stop_table
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.infllm.policy import attention_mode
from minicpm_jax.model.cache import KVCache
from minicpm_jax.model.causal_lm import MiniCPMForCausalLM
from minicpm_jax.model.loading import shard_model
from minicpm_jax.model.paged_cache import PagedKVCache

MIN_CHUNK = 32  # smallest prefill chunk shape
DECODE_PAGES_AHEAD = 3  # pages a decoding row takes beyond the one it needs, while free ones last


@dataclasses.dataclass
class GenerationResult:
    """One sequence's output: generated ids (stop token included) and why it ended ('stop'/'length')."""

    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int


@dataclasses.dataclass
class GenerationStats:
    """Timings of one ``generate`` call (seconds; token counts summed over the batch)."""

    prefill_tokens: int = 0
    prefill_time: float = 0.0
    decode_tokens: int = 0
    decode_time: float = 0.0
    compile_time: float = 0.0  # spent compiling new shapes during the call (not in the times above)
    spec_accepted: list[int] | None = None  # speculative decoding: rounds that emitted 0, 1, 2 ... tokens

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_time if self.prefill_time > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_time if self.decode_time > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "prefill_tokens": self.prefill_tokens,
            "prefill_time_s": self.prefill_time,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_tokens": self.decode_tokens,
            "decode_time_s": self.decode_time,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "compile_time_s": self.compile_time,
            **(self.spec_summary() if self.spec_accepted is not None else {}),
        }

    def spec_summary(self) -> dict:
        """Speculative rounds, mean accept length (tokens per round) and per-depth acceptance (fraction of
        rounds whose draft was right at depth 1, 2, ...)."""
        counts = np.asarray(self.spec_accepted, np.int64)
        rounds = int(counts.sum())
        lengths = np.arange(len(counts))
        return {
            "spec_rounds": rounds,
            "mean_accept_length": float((counts * lengths).sum() / rounds) if rounds else 0.0,
            "depth_acceptance": [float(counts[d + 1 :].sum() / rounds) if rounds else 0.0 for d in range(1, len(counts) - 1)],
        }


def split_over(model: MiniCPMForCausalLM, mesh: Mesh | None) -> MiniCPMForCausalLM:
    """``model`` split over ``mesh`` (tensor parallelism; :func:`~minicpm_jax.model.loading.shard_model`)
    unless it already is, or ``model`` itself without a mesh."""
    if mesh is None or model.mesh is mesh:
        return model
    if model.mesh is not None:
        raise MiniCPMError("the model is already split over another mesh")
    return shard_model(model, mesh)


def allocate_cache(model: MiniCPMForCausalLM, batch_size: int, paging: Paging | None = None) -> KVCache | PagedKVCache:
    """``model.new_cache(batch_size)`` (or the paged pool of ``paging``), with an accelerator out-of-memory
    error turned into one line that names the cache's size (a Python API user who skipped
    :mod:`minicpm_jax.engine.memory`'s check)."""
    try:  # dispatch is asynchronous: an out-of-memory shows when the buffers are waited for
        if paging is not None:
            return jax.block_until_ready(model.new_paged_cache(num_pages=paging.num_pages, page_size=paging.page_size,
                                                               batch_size=batch_size))
        return jax.block_until_ready(model.new_cache(batch_size))
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        if paging is not None:
            size = PagedKVCache.nbytes(model.config, paging.num_pages, paging.page_size, batch_size, model.dtype,
                                       sparse=model.sparse if model.sparse_active else None)
            what, fix = f"{paging.num_pages} pages of {paging.page_size} tokens", "fewer pages"
        else:
            size = KVCache.nbytes(model.config, batch_size, model.max_length, model.dtype,
                                  model.sparse if model.sparse_active else None)
            what, fix = f"{model.max_length} tokens × {batch_size} rows", "lower max_length or the batch size"
        raise MiniCPMError(f"the KV cache ({what}, {size / (1 << 30):.2f} GiB) does not fit in the accelerator's "
                           f"memory: {fix}") from None


@jax.jit
def set_lengths(lengths: jax.Array, idx: jax.Array, values: jax.Array) -> jax.Array:
    """``lengths`` with the slots ``idx`` set to ``values`` (jitted: eager ops on arrays still being
    computed block the host on the CPU backend)."""
    return lengths.at[idx].set(values)


def power_of_2_rows(live: int, limit: int) -> int:
    """The rows a program over ``live`` rows computes: the next power of two, or ``limit`` (every row)."""
    return min(1 << (max(live, 1) - 1).bit_length(), limit)


def decode_row_counts(batch_size: int) -> list[int]:
    """The row counts a paged engine's decode blocks run at: powers of four, and every slot. A decode step
    reads every weight whatever its rows, so 16 rows cost about what 5 do; coarse steps keep the compiled
    programs few (each takes seconds to compile at 8B)."""
    counts, n = [], 1
    while n < batch_size:
        counts.append(n)
        n *= 4
    return counts + [batch_size]


class Engine:
    """Batched generation over one model and one static cache.

    Args:
      model: a loaded :class:`MiniCPMForCausalLM` (its ``max_length`` sizes the cache).
      batch_size: static number of sequence slots.
      chunk_length: prefill chunk size (one compiled shape).
      decode_block: decode steps per host round trip.
      steps: the device programs (default :class:`~minicpm_jax.engine.steps.PlainSteps` of ``model``); a
        speculative engine passes its own (see :class:`~minicpm_jax.engine.speculative.engine.SpeculativeEngine`).
      mesh: split ``model`` over this mesh (tensor parallelism, ``minicpm_jax.model.parallel.make_mesh``)
        unless it already is; a model loaded with ``load_model(..., mesh=)`` needs none.
      scratch_rows: cache rows a prompt piece (:meth:`prefill_chunk`) may copy out to run over them alone, a
        power of two; sizing the memory, count them beside ``batch_size`` (the server does). A paged cache
        copies nothing (its rows are page-table rows): every slot may run alone.
      paging: keep the KV in a pool of pages shared by the slots (:class:`~minicpm_jax.engine.paging.Paging`;
        ``batch_size`` then bounds the sequences of a step, not the memory), with the paged step API
        (:meth:`admit`, :meth:`grow`, :meth:`publish`, :meth:`release`, ...); None: one ``max_length`` row
        per slot.
    """

    def __init__(self, model: MiniCPMForCausalLM, *, batch_size: int = 1, chunk_length: int = 256,
                 decode_block: int = 16, steps=None, mesh: Mesh | None = None, scratch_rows: int = 1,
                 paging: Paging | None = None):
        if batch_size < 1 or chunk_length < 1 or decode_block < 1 or scratch_rows < 1:
            raise MiniCPMError("batch_size, chunk_length, decode_block and scratch_rows must be positive")
        if scratch_rows & (scratch_rows - 1):
            raise MiniCPMError(f"scratch_rows must be a power of two, got {scratch_rows}")
        model = split_over(model, mesh)
        if steps is not None and steps.model is not model:
            raise MiniCPMError("the step set runs another model than the engine's")
        self.model = model
        self.config = model.config
        self.max_length = model.max_length
        self.batch_size = batch_size
        self.chunk_length = min(chunk_length, self.max_length)
        self.decode_block = decode_block
        # Cache rows a prompt piece may copy out to run over them alone (prefill_chunk); whoever sizes the
        # memory leaves room for them beside the batch_size rows. Paged rows are free to take.
        self.scratch_rows = batch_size if paging is not None else scratch_rows
        page_size = None if paging is None else paging.page_size
        self.steps = steps or PlainSteps(model, decode_block=decode_block, page_size=page_size)
        if self.steps.page_size != page_size:
            raise MiniCPMError("the step set was built for another cache layout than the engine's paging")
        self.paging = paging
        self.books = None if paging is None else PagedBooks(paging, batch_size=batch_size, max_length=self.max_length,
                                                            reuse_margin=self.steps.reuse_margin)
        self.cache = allocate_cache(model, batch_size, paging)
        self.history: list[list[int]] = [[] for _ in range(batch_size)]  # tokens whose KV each row holds
        self.sampling = "auto"  # static sampling path of the current generate call (see sampling_kind)

    @property
    def compile_time(self) -> float:
        """Seconds spent compiling, over the engine's life."""
        return self.steps.compile_time

    # ---------------------------------------------------------------- the step API
    def cache_lengths(self) -> list[int]:
        return [int(x) for x in jax.device_get(self.cache.lengths)]

    def reset(self, rows: Sequence[bool] | np.ndarray | None = None) -> None:
        """Forgets every cached sequence, or those of the slots where ``rows[B]`` is True (buffers are not
        cleared)."""
        if rows is None:
            # A step interrupted between launch and return (Ctrl-C) can leave the cache pointing at donated
            # buffers: start from a fresh one then.
            self.cache = allocate_cache(self.model, self.batch_size, self.paging) if self.cache.is_deleted() \
                else self.cache.reset()
            self.history = [[] for _ in range(self.batch_size)]
            if self.books is not None:
                self.books.pages.dirty = True  # a fresh pool's view has an empty table
        else:
            rows = np.asarray(rows, bool)
            self.cache = self.cache.reset(jnp.asarray(rows))
            self.history = [[] if r else h for h, r in zip(self.history, rows)]
        if self.books is not None:
            for slot in range(self.batch_size) if rows is None else np.flatnonzero(rows):
                self.books.release(int(slot))
        self.steps.reset(rows)

    # ---------------------------------------------------------------- the paged step API
    @property
    def paged(self) -> bool:
        """Whether the KV lives in a pool of pages (``paging``)."""
        return self.books is not None

    def _paged_books(self) -> PagedBooks:
        if self.books is None:
            raise MiniCPMError("this engine's cache is not paged (Engine(paging=...))")
        return self.books

    def admit(self, slot: int, tokens: Sequence[int]) -> int:
        """Starts the empty ``slot`` (after :meth:`reset` or :meth:`release`) on a prompt: the pages of its
        longest cached prefix are shared into the slot (but those holding its last ``steps.reuse_margin``
        tokens), whose length becomes that prefix's; returns its tokens (whole pages, at least one prompt
        token left to compute)."""
        cached = self._paged_books().admit(slot, tokens)
        if cached:
            self.cache = self.cache.with_lengths(set_lengths(self.cache.lengths, np.int32(slot), np.int32(cached)))
            self.steps.admitted(slot, cached)
        return cached

    def cached_tokens(self, tokens: Sequence[int]) -> int:
        """Tokens of a prompt :meth:`admit` would find cached now (nothing changes)."""
        return self._paged_books().cached(tokens)

    def pages_needed(self, tokens: dict[int, int]) -> int:
        """New pages that ``tokens[slot]`` more positions of each slot need (a prompt piece; a decode block
        is ``tokens_per_block`` each)."""
        return self._paged_books().pages_needed(tokens)

    def settle(self, slot: int, length: int) -> None:
        """``slot``'s length on the device is at most ``length`` now (its tokens came back): the next
        decode block reserves from there."""
        self._paged_books().settle(slot, length)

    def publish(self, slot: int, tokens: Sequence[int]) -> None:
        """``tokens`` (from position 0) are in ``slot``'s cache: their full pages enter the prefix cache,
        for other prompts starting with them (also while this one runs)."""
        self._paged_books().publish(slot, tokens)

    def release(self, slot: int, tokens: Sequence[int] | None = None) -> None:
        """Ends ``slot``'s sequence: publishes ``tokens`` first (when given), frees its pages (full ones
        stay cached) and empties the slot."""
        self._paged_books().release(slot, tokens)
        mask = np.zeros(self.batch_size, bool)
        mask[slot] = True
        self.reset(mask)

    def page_stats(self) -> dict:
        """The pool's counters (:meth:`~minicpm_jax.engine.pages.PageManager.stats`)."""
        return self._paged_books().stats()

    def available_pages(self) -> int:
        return self._paged_books().available()

    def decode_state(self, samplings: list[SamplingParams], budgets: list[int], stops: list[list[int]],
                     generated: list[int] | None = None) -> DecodeState:
        """Decode state for the first ``len(samplings)`` slots (their sampling, token budget and stop ids);
        the remaining slots start finished. generated: tokens each slot's request already produced (a
        preempted request resuming: its draws and budget go on from there), default none."""
        n, pad = len(samplings), self.batch_size - len(samplings)
        samplings = samplings + [SamplingParams()] * pad
        host = DecodeState(
            tok=np.zeros(self.batch_size, np.int32),
            done=np.arange(self.batch_size) >= n,
            finish=np.zeros(self.batch_size, np.int32),
            n_gen=np.asarray(list(generated or [0] * n) + [0] * pad, np.int32),
            max_new=np.asarray(list(budgets) + [1] * pad, np.int32),
            keys=np.stack([row_key(s.seed) for s in samplings]),
            temperature=np.asarray([s.temperature for s in samplings], np.float32),
            top_k=np.asarray([s.top_k for s in samplings], np.int32),
            top_p=np.asarray([s.top_p for s in samplings], np.float32),
            stop_ids=stop_table(stops, self.batch_size),
        )
        # Built on the host and sent in one transfer. One small transfer per field and per row's key (138
        # at 128 slots) made the host wait for the device's queue: an H100 server spent 30-120 ms here
        # for each step that started a request (the prompt's whole prefill when it was queued behind).
        return jax.device_put(host)

    def prefill(self, rows: Sequence[Sequence[int]], on_progress: Callable[[int, int], None] | None = None) -> jax.Array:
        """Appends ``rows[i]`` to slot i's cached tokens (empty rows are left as they are), chunk by chunk;
        returns each slot's last-token logits ``f32[B, V]`` (zeros for empty rows).
        ``on_progress(done_tokens, total_tokens)`` is called after each chunk (it synchronises)."""
        rows = list(rows) + [[]] * (self.batch_size - len(rows))
        total = max(len(r) for r in rows)
        start = self.cache_lengths() if self.model.sparse_active else None
        self._reserve({i: len(r) for i, r in enumerate(rows) if r})
        # Short prompts run in a smaller power-of-two chunk (few compiled shapes, little padding).
        c = min(self.chunk_length, max(MIN_CHUNK, 1 << (total - 1).bit_length()))
        logits = jnp.zeros((self.batch_size, self.config.vocab_size), jnp.float32)
        for begin in range(0, total, c):
            chunk = PrefillChunk.of(rows, begin, c, self.batch_size)
            self.cache, logits = self.steps.prefill_chunk(self.cache, chunk, logits, self.chunk_mode(start, chunk))
            if on_progress is not None:
                logits.block_until_ready()
                on_progress(min(begin + c, total), total)
        return logits

    def chunk_size(self, tokens: int) -> int:
        """The compiled chunk width a prefill of ``tokens`` tokens per row runs in: the next power of two,
        at least ``MIN_CHUNK`` (few compiled shapes, little padding), at most ``chunk_length``."""
        return min(self.chunk_length, max(MIN_CHUNK, 1 << (max(tokens, 1) - 1).bit_length()))

    def prefill_row_count(self, live: int) -> int:
        """The rows a prefill step with ``live`` prompt rows computes: the next power of two if that fits
        ``scratch_rows`` (and is fewer than every slot), else every slot (``batch_size``)."""
        rows = power_of_2_rows(live, self.batch_size)
        return rows if rows <= self.scratch_rows else self.batch_size

    def _reserve(self, tokens: dict[int, int], ahead_pages: int = 0) -> None:
        """Paged cache: pages for ``tokens[slot]`` more positions of each slot, all reserved before a
        program writes them (OutOfPages naming the slots that did not get theirs); then the device's view
        gets the page table. ``ahead_pages``: a slot that needs a page takes that many more while the pool
        has them (:meth:`PagedBooks.reserve_many`). Nothing for a contiguous cache."""
        if self.books is None:
            return
        failed = self.books.reserve_many(tokens, ahead_pages * self.books.page_size)
        if failed:
            raise OutOfPages(f"the KV pool has no free pages for slots {failed} ({self.books.available()} left): "
                             "fewer or shorter sequences at once, or more pages")
        self.cache = self.books.sync(self.cache)

    def prefill_chunk(self, rows: Sequence[Sequence[int]], size: int) -> jax.Array:
        """One prefill step: appends the first ``min(size, len(rows[i]))`` tokens of ``rows[i]`` to slot
        i's cached tokens (empty rows are left as they are), in one forward of
        ``chunk_size(longest piece)`` tokens per row; ``size`` is at most ``chunk_length``.

        rows: what is left of each slot's prompt; past the piece it is only read as lookahead (the token
        after the piece, which a speculative draft pairs with the piece's last feature), so a prompt fed
        as consecutive pieces (``rows[i][size:]`` next time) caches what :meth:`prefill` of the whole
        prompt would. Up to ``scratch_rows`` non-empty rows run alone (their cache rows copied out and put
        back, padded to :meth:`prefill_row_count` rows with empty ones: the cost of those rows, not of
        ``batch_size``); more run over every slot, the empty ones masked, as :meth:`prefill` does. This is how a server interleaves a long prompt with the decode steps of
        running rows. Returns each slot's last-piece-token logits ``f32[B, V]`` (zeros for empty rows)."""
        if not 1 <= size <= self.chunk_length:
            raise MiniCPMError(f"a prefill piece takes 1..{self.chunk_length} tokens (chunk_length), got {size}")
        rows = [list(r) for r in rows] + [[]] * (self.batch_size - len(rows))
        take = [min(size, len(r)) for r in rows]
        live = [i for i, n in enumerate(take) if n]
        if not live:
            return jnp.zeros((self.batch_size, self.config.vocab_size), jnp.float32)
        self._reserve({i: take[i] for i in live})
        c = self.chunk_size(max(take))
        pieces = PrefillChunk.of([r[:n] for r, n in zip(rows, take)], 0, c, self.batch_size)
        following = PrefillChunk.of([r[1 : n + 1] for r, n in zip(rows, take)], 0, c, self.batch_size)
        chunk = dataclasses.replace(pieces, next_tokens=following.tokens, next_valid=following.num_valid)
        mode = self.chunk_mode(self.cache_lengths() if self.model.sparse_active else None, chunk)
        # A few prompts among many slots run over copies of those rows' caches (a speculative step set takes
        # its draft's rows with them), padded to a power-of-two row count with idle rows (few compiled
        # shapes). Computing every slot costs batch_size / len(live) times the work: on an H100 with 32 slots
        # of the 8B shape, running streams waited up to ~130 ms (gap p99) while short prompts were read so.
        rows_run = self.prefill_row_count(len(live))
        if rows_run < self.batch_size:
            idle = [i for i in range(self.batch_size) if not take[i]]
            idx = np.asarray(sorted(live + idle[: rows_run - len(live)]), np.int32)
            self.cache, logits = self.steps.prefill_rows(self.cache, idx, chunk, mode)
            return logits
        self.cache, logits = self.steps.prefill_chunk(
            self.cache, chunk, jnp.zeros((self.batch_size, self.config.vocab_size), jnp.float32), mode)
        return logits

    def first_token(self, ds: DecodeState, logits: jax.Array, active: jax.Array, sampling: str = "auto",
                    logprobs: int = 0):
        """Samples each ``active`` slot's first token from its prefill ``logits``; ``sampling``: the static
        sampling path (:func:`~minicpm_jax.engine.sampling.sampling_kind`). With ``logprobs`` > 0 (plain
        steps only) returns (state, (the token's log-probability ``f32[B]``, the ``logprobs`` most likely
        ids ``int32[B, K]`` and their log-probabilities ``f32[B, K]``)), computed from the same logits."""
        self._check_logprobs(logprobs)
        if logprobs:
            return self.steps.first_token(self.cache, ds, logits, active, sampling, logprobs=logprobs)
        return self.steps.first_token(self.cache, ds, logits, active, sampling)

    def decode(self, ds: DecodeState, mode: str | None = None, sampling: str = "auto", logprobs: int = 0,
               rows: Sequence[int] | None = None):
        """One decode block for the live slots; returns (state, tokens ``int32[B, N]``, -1 = none). Without
        ``mode`` the attention mode comes from the lengths on device (one sync, sparse models only). With
        ``logprobs`` > 0 (plain steps only) also each token's log-probability and its step's ``logprobs``
        most likely tokens, from the logits the step sampled from: (state, tokens, (f32[B, N],
        int32[B, N, K], f32[B, N, K])).

        rows: the slots that may be decoding (default: every slot). A paged cache reserves a block's pages
        for each of them first (OutOfPages if the pool cannot: :meth:`pages_needed` says how many a block
        needs) and computes only them, padded with idle slots to a count of :func:`decode_row_counts` (finished
        rows are masked either way)."""
        self._check_logprobs(logprobs)
        if mode is None:
            mode = self.block_mode(ds)
        idx = None
        if self.books is not None:
            slots = list(range(self.batch_size)) if rows is None else [int(s) for s in rows]
            # Decoding rows cross a page every page_size tokens: at 64 rows of 64-token pages one did at
            # almost every step, and each crossing sent the whole page table to the device (a host-to-device
            # copy on the step's host side). Taking DECODE_PAGES_AHEAD more at a crossing sends it a
            # quarter as often, for at most that many unused pages a row (freed with the row).
            self._reserve({s: self.steps.tokens_per_block for s in slots}, DECODE_PAGES_AHEAD)
            # The fewest rows of decode_row_counts that hold them (every slot with log-probabilities: that
            # variant is compiled once, for the whole batch).
            n = self.batch_size if logprobs else min(c for c in decode_row_counts(self.batch_size) if c >= len(slots))
            if n < self.batch_size and self.steps.decodes_rows:
                taken = set(slots)
                idle = [s for s in range(self.batch_size) if s not in taken]
                idx = np.asarray(sorted(slots + idle[: n - len(slots)]), np.int32)
        out = self.steps.decode_block(self.cache, ds, mode, sampling, logprobs=logprobs, rows=idx)
        self.cache, ds = out[0], out[1]
        return (ds, out[2], out[3]) if logprobs else (ds, out[2])

    def start(self, ds: DecodeState, rows: jax.Array | None = None) -> None:
        """Decoding begins from ``ds`` (after :meth:`first_token`): for every slot, or only for the slots
        ``rows bool[B]`` that join a batch already decoding (a speculative step set then queues those rows'
        first (feature, token) pair for its draft and keeps the other rows' state)."""
        self.steps.start(ds, rows)

    def accept_counts(self) -> jax.Array | None:
        """Speculative decoding: rounds by the tokens they emitted (0, 1, ..., A), summed over the slots
        since decoding began, as a new device array ``int32[A + 1]`` (later steps do not donate it; read it
        when convenient); None for plain decoding or before the first round."""
        return self.steps.accept_counts()

    @property
    def has_logprobs(self) -> bool:
        """Whether the steps return log-probabilities (plain decoding; a speculative round does not)."""
        return self.steps.has_logprobs

    def _check_logprobs(self, logprobs: int) -> None:
        if logprobs and not self.has_logprobs:
            raise MiniCPMError("log-probabilities come from plain decoding steps; this engine's steps "
                               f"({type(self.steps).__name__}) do not return them")

    # ---------------------------------------------------------------- attention modes (sparse models)
    def attention_mode(self, lo: int, hi: int) -> str:
        """Static attention mode for a step whose relevant rows reach ``lo``..``hi`` tokens."""
        if not self.model.sparse_active:
            return "dense"
        return attention_mode(self.model.sparse.dense_len, lo, hi)

    def block_mode(self, ds: DecodeState) -> str:
        """Attention mode of a decode block, from the lengths on device (one sync when sparse)."""
        if not self.model.sparse_active:
            return "dense"
        lengths, done = jax.device_get((self.cache.lengths, ds.done))
        live = [int(n) for n, d in zip(lengths, done) if not d] or [0]
        return self.attention_mode(min(live) + 1, max(live) + self.steps.tokens_per_block)

    def chunk_mode(self, start: list[int] | None, chunk: PrefillChunk) -> str:
        """Attention mode of a prefill chunk; ``start``: the rows' cached lengths before the prompt (None
        when not sparse)."""
        if start is None:
            return "dense"
        reach = [start[i] + chunk.begin + int(n) for i, n in enumerate(chunk.num_valid) if n]
        return self.attention_mode(min(reach), max(reach))

    # ---------------------------------------------------------------- generate
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
        max_new_tokens: int | Sequence[int] = 256,
        stop_token_ids: Sequence[int] | Sequence[Sequence[int]] = (),
        reuse_prefix: bool = False,
        on_tokens: Callable[[list[list[int]]], Sequence[int] | None] | None = None,
        on_prefill: Callable[[int, int], None] | None = None,
    ) -> tuple[list[GenerationResult], GenerationStats]:
        """Generates a continuation of every prompt (one row each; at most ``batch_size``).

        prompts: the full token ids per row. reuse_prefix: keep the cached KV of the longest common
        prefix of each prompt with what the row already holds (multi-turn chat re-sends the whole
        conversation; only the new tail is prefilled). stop_token_ids: shared list, or one list per row.
        on_tokens(new_ids_per_row): called with each block of new tokens (list per row, maybe empty);
        returning a list of row indices to stop early (e.g. a stop string matched) is allowed.
        on_prefill(done_tokens, total_tokens): prefill progress (synchronises after each chunk).
        Returns per-row results and the timing stats.
        """
        n = len(prompts)
        if not 1 <= n <= self.batch_size:
            raise MiniCPMError(f"generate takes 1..{self.batch_size} prompts (the engine's batch size), got {n}")
        samplings = [sampling] * n if isinstance(sampling, SamplingParams) else list(sampling)
        budgets = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if stop_token_ids and not isinstance(stop_token_ids[0], (list, tuple)):
            stops = [list(stop_token_ids)] * n
        else:
            stops = [list(s) for s in stop_token_ids] or [[]] * n
        if not (len(samplings) == len(budgets) == len(stops) == n):
            raise MiniCPMError("sampling, max_new_tokens and stop_token_ids need one entry per prompt")
        if any(b < 1 for b in budgets):
            raise MiniCPMError(f"max_new_tokens must be >= 1, got {min(budgets)}")

        if not reuse_prefix:
            self.reset()
        rows, start = [], []
        for i, p in enumerate(prompts):
            ids = [int(t) for t in p]
            if not ids:
                raise MiniCPMError("empty prompt: give at least one token")
            if any(t < 0 or t >= self.config.vocab_size for t in ids):
                raise MiniCPMError(f"prompt {i} has token ids outside the vocabulary [0, {self.config.vocab_size})")
            if len(ids) >= self.max_length:
                raise MiniCPMError(
                    f"prompt {i} has {len(ids)} tokens but max_length is {self.max_length} (prompt plus generated "
                    "tokens must fit); shorten the prompt or raise --max_length"
                )
            rows.append(ids)
            start.append(self._common_prefix(i, ids))
        if self.books is not None and reuse_prefix:
            # The rows' pages went to the prefix cache at the end of the last call: every prompt starts on
            # its longest cached prefix, whichever row computed it.
            self.reset()
            start = [self.admit(i, r) for i, r in enumerate(rows)]
        elif reuse_prefix:
            self._truncate(start + [0] * (self.batch_size - n))
        rows_new = [r[s:] for r, s in zip(rows, start)]

        stats = GenerationStats(prefill_tokens=sum(len(r) for r in rows_new))
        compile0 = self.compile_time
        t0 = time.perf_counter()
        logits = self.prefill(rows_new, on_prefill)
        ds = self.decode_state(samplings, budgets, stops)
        self.sampling = sampling_kind(samplings)
        ds = self.first_token(ds, logits, ~ds.done, self.sampling)
        first, done = jax.device_get((ds.tok, ds.done))
        compile1 = self.compile_time
        stats.prefill_time = time.perf_counter() - t0 - (compile1 - compile0)

        outputs: list[list[int]] = [[int(first[i])] for i in range(n)]
        host_done = [bool(done[i]) for i in range(n)]
        ds = self._emit(on_tokens, [[t[0]] for t in outputs], host_done, ds)
        t1 = time.perf_counter()
        ds = self._decode_loop(ds, outputs, host_done, on_tokens, [len(r) for r in rows])
        stats.decode_time = time.perf_counter() - t1 - (self.compile_time - compile1)
        stats.compile_time = self.compile_time - compile0
        stats.decode_tokens = sum(len(o) - 1 for o in outputs)
        accepted = self.steps.accepted()
        stats.spec_accepted = None if accepted is None else [int(x) for x in accepted]

        finish = jax.device_get(ds.finish)
        results = [
            GenerationResult(outputs[i], FINISH_NAMES.get(int(finish[i]), "stop"), len(rows[i])) for i in range(n)
        ]
        # The last sampled token is never cached; rows stopped by the host may have run ahead on device.
        self.history[:n] = [r + o[:-1] for r, o in zip(rows, outputs)]
        if self.books is not None:
            for i in range(n):
                self.books.publish(i, self.history[i])
        self._truncate([len(h) for h in self.history])
        return results, stats

    def _common_prefix(self, row: int, ids: list[int]) -> int:
        """Length of the cached prefix of ``row`` reusable for ``ids`` (at least one token is left to run,
        and the step set's ``reuse_margin`` more)."""
        cached = self.history[row]
        n = 0
        limit = min(len(cached), len(ids) - 1)
        while n < limit and cached[n] == ids[n]:
            n += 1
        return max(0, n - self.steps.reuse_margin)

    def _truncate(self, lengths: list[int]) -> None:
        """Sets each row's valid cache length (stale KV past it is ignored and later overwritten); a paged
        row keeps its pages up to it (a little less where it ends inside a shared page)."""
        if self.books is not None:
            lengths = [self.books.truncate(i, n) for i, n in enumerate(lengths)]
        self.history = [h[:length] for h, length in zip(self.history, lengths)]
        self.cache = self.cache.with_lengths(lengths)
        self.steps.truncate(lengths)

    def _decode_loop(self, ds: DecodeState, outputs, host_done, on_tokens, prompt_lengths: list[int]) -> DecodeState:
        """Dispatches block k+1 before reading block k, so the host's streaming overlaps device work."""
        self.steps.start(ds)
        pending = None  # (tokens, done flags) of the block in flight
        start = self.cache_lengths() if self.model.sparse_active else None
        per_block = self.steps.tokens_per_block
        dispatched = 0
        while not all(host_done):
            mode = "dense"
            if start is not None:  # bounds from host bookkeeping: no sync, block k+1 still overlaps block k
                live = [i for i in range(len(outputs)) if not host_done[i]]
                lo = min(start[i] + len(outputs[i]) for i in live)  # kv length at the block's first step, at least
                hi = max(start[i] for i in live) + dispatched + per_block
                mode = self.attention_mode(lo, hi)
            ds, block = self.decode(ds, mode, self.sampling, rows=[i for i, d in enumerate(host_done) if not d])
            dispatched += per_block
            if pending is not None:
                ds = self._consume(pending, outputs, host_done, on_tokens, ds)
                if self.books is not None:  # the block in flight may add per_block more
                    for i, o in enumerate(outputs):
                        self.books.settle(i, prompt_lengths[i] + len(o) - 1 + per_block)
            pending = (block, ds.done)
        return ds

    def _consume(self, pending, outputs, host_done, on_tokens, ds: DecodeState) -> DecodeState:
        block, done = jax.device_get(pending)
        new = [[] for _ in outputs]
        for i in range(len(outputs)):
            if host_done[i]:
                continue
            toks = [int(t) for t in block[i] if t >= 0]
            outputs[i].extend(toks)
            new[i] = toks
            host_done[i] = bool(done[i])
        return self._emit(on_tokens, new, host_done, ds)

    def _emit(self, on_tokens, new, host_done, ds: DecodeState) -> DecodeState:
        if on_tokens is None:
            return ds
        stop_rows = on_tokens(new) or []
        if not stop_rows:
            return ds
        for i in stop_rows:
            host_done[i] = True
        mask = np.zeros(self.batch_size, bool)
        mask[list(stop_rows)] = True
        m = jnp.asarray(mask)
        return dataclasses.replace(ds, done=ds.done | m, finish=jnp.where(m, FINISH_STOP, ds.finish))
