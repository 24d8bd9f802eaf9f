"""Generation: chunked prefill into the static cache, then a device-side decode loop.

Data path: prompt ids → ``prefill`` runs fixed-size chunks (one compiled shape; the last chunk padded)
→ the first token is sampled on device → ``decode`` runs up to ``decode_block`` steps per host round
trip inside one jit (``lax.while_loop``, cache donated), stopping rows on stop ids / token budget /
full cache on device → the host receives each block, streams it and dispatches the next block before
reading the current one, so host work overlaps device work.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minicpm_jax.cache import KVCache
from minicpm_jax.errors import MiniCPMError
from minicpm_jax.model import MiniCPMForCausalLM
from minicpm_jax.sampling import SamplingParams, row_key, sample, sampling_kind
from minicpm_jax.sparse import attention_mode

FINISH_NONE, FINISH_STOP, FINISH_LENGTH = 0, 1, 2
FINISH_NAMES = {FINISH_STOP: "stop", FINISH_LENGTH: "length"}
MAX_STOP_IDS = 16  # static width of the per-row stop-id table
MIN_CHUNK = 32  # smallest prefill chunk shape


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """Per-row decode state, all ``[B]`` unless noted; lives on device between blocks.

    tok: last sampled token (not yet in the cache). done / finish: finished flag and reason.
    n_gen: tokens generated so far. max_new: token budget. keys ``uint32[B, 2]``: sampling keys.
    stop_ids ``int32[B, MAX_STOP_IDS]`` (-1 padded).
    """

    tok: jax.Array
    done: jax.Array
    finish: jax.Array
    n_gen: jax.Array
    max_new: jax.Array
    keys: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    stop_ids: jax.Array


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


def _check_stops(ds: DecodeState, new_tok, active, cache_lengths, max_length) -> DecodeState:
    """Updates tok / n_gen / done / finish after ``new_tok`` was drawn for the ``active`` rows."""
    n_gen = ds.n_gen + active.astype(jnp.int32)
    hit_stop = active & jnp.any(new_tok[:, None] == ds.stop_ids, axis=-1)
    hit_len = active & ~hit_stop & ((n_gen >= ds.max_new) | (cache_lengths >= max_length))
    finish = jnp.where(hit_stop, FINISH_STOP, jnp.where(hit_len, FINISH_LENGTH, ds.finish))
    return dataclasses.replace(
        ds,
        tok=jnp.where(active, new_tok, ds.tok),
        n_gen=n_gen,
        done=ds.done | hit_stop | hit_len,
        finish=finish.astype(jnp.int32),
    )


def _prefill_chunk(graphdef, state, cache: KVCache, tokens, num_valid, last_logits, *, mode: str = "dense"):
    """One prompt chunk ``tokens int32[B, C]``; keeps the logits of each row's last real token."""
    model = nnx.merge(graphdef, state)
    hidden, cache = model.forward(tokens, cache, num_valid, mode)
    last = jnp.take_along_axis(hidden, jnp.maximum(num_valid - 1, 0)[:, None, None], axis=1)[:, 0]
    logits = model.logits(last)
    return cache, jnp.where((num_valid > 0)[:, None], logits, last_logits)


def _first_token(ds: DecodeState, logits, active, cache_lengths, *, max_length: int, sampling: str = "auto"):
    """Samples each active row's first token from its prefill logits."""
    tok = sample(logits, ds.keys, ds.n_gen, ds.temperature, ds.top_k, ds.top_p, sampling)
    return _check_stops(ds, tok, active, cache_lengths, max_length)


def _decode_block(graphdef, state, cache: KVCache, ds: DecodeState, *, num_steps: int, mode: str = "dense",
                  sampling: str = "auto"):
    """Up to ``num_steps`` decode steps on device; returns (cache, state, tokens ``int32[B, num_steps]``, -1 = none)."""
    model = nnx.merge(graphdef, state)
    out = jnp.full((ds.tok.shape[0], num_steps), -1, jnp.int32)

    def cond(carry):
        i, _, ds, _ = carry
        return (i < num_steps) & jnp.any(~ds.done)

    def body(carry):
        i, cache, ds, out = carry
        active = ~ds.done
        hidden, cache = model.forward(ds.tok[:, None], cache, active.astype(jnp.int32), mode)
        logits = model.logits(hidden[:, 0])
        new_tok = sample(logits, ds.keys, ds.n_gen, ds.temperature, ds.top_k, ds.top_p, sampling)
        out = out.at[:, i].set(jnp.where(active, new_tok, -1))
        ds = _check_stops(ds, new_tok, active, cache.lengths, cache.max_length)
        return i + 1, cache, ds, out

    _, cache, ds, out = jax.lax.while_loop(cond, body, (jnp.int32(0), cache, ds, out))
    return cache, ds, out


class Engine:
    """Batched generation over one model and one static cache.

    Args:
      model: a loaded :class:`MiniCPMForCausalLM` (its ``max_length`` sizes the cache).
      batch_size: static number of sequence slots.
      chunk_length: prefill chunk size (one compiled shape).
      decode_block: decode steps per host round trip.
    """

    def __init__(
        self, model: MiniCPMForCausalLM, *, batch_size: int = 1, chunk_length: int = 256, decode_block: int = 16
    ):
        if batch_size < 1 or chunk_length < 1 or decode_block < 1:
            raise MiniCPMError("batch_size, chunk_length and decode_block must be positive")
        self.model = model
        self.config = model.config
        self.max_length = model.max_length
        self.batch_size = batch_size
        self.chunk_length = min(chunk_length, self.max_length)
        self.decode_block = decode_block
        self.graphdef, self.state = nnx.split(model)
        self.cache = model.new_cache(batch_size)
        self.history: list[list[int]] = [[] for _ in range(batch_size)]  # tokens whose KV each row holds
        # Jitted steps with the static parts bound; compiled ahead of time per shape (see _executable) so
        # compilation is timed apart from prefill and decode.
        self._jitted = {
            "prefill": jax.jit(functools.partial(_prefill_chunk, self.graphdef), donate_argnums=1,
                               static_argnames="mode"),
            "first": jax.jit(functools.partial(_first_token, max_length=self.max_length), static_argnames="sampling"),
            "decode": jax.jit(functools.partial(_decode_block, self.graphdef, num_steps=decode_block), donate_argnums=1,
                              static_argnames=("mode", "sampling")),
        }
        self._executables: dict = {}
        self.sampling = "auto"  # static sampling path of the current generate call (see sampling_kind)
        self.compile_time = 0.0  # seconds spent compiling, over the engine's life

    # ---------------------------------------------------------------- helpers
    def cache_lengths(self) -> list[int]:
        return [int(x) for x in jax.device_get(self.cache.lengths)]

    def reset(self) -> None:
        """Forgets every cached sequence."""
        self.cache = self.cache.reset()
        self.history = [[] for _ in range(self.batch_size)]

    def _stop_table(self, stop_ids: Sequence[Sequence[int]]) -> np.ndarray:
        table = np.full((self.batch_size, MAX_STOP_IDS), -1, np.int32)
        for row, ids in enumerate(stop_ids):
            ids = list(dict.fromkeys(ids))
            if len(ids) > MAX_STOP_IDS:
                raise MiniCPMError(f"at most {MAX_STOP_IDS} stop token ids per request, got {len(ids)}")
            table[row, : len(ids)] = ids
        return table

    def _initial_state(self, samplings: list[SamplingParams], budgets: list[int], stops: list[list[int]]) -> DecodeState:
        """Decode state for the first ``len(samplings)`` rows; the remaining slots start finished."""
        n, pad = len(samplings), self.batch_size - len(samplings)
        samplings = samplings + [SamplingParams()] * pad
        return DecodeState(
            tok=jnp.zeros(self.batch_size, jnp.int32),
            done=jnp.asarray(np.arange(self.batch_size) >= n),
            finish=jnp.zeros(self.batch_size, jnp.int32),
            n_gen=jnp.zeros(self.batch_size, jnp.int32),
            max_new=jnp.asarray(list(budgets) + [1] * pad, jnp.int32),
            keys=jnp.stack([row_key(s.seed) for s in samplings]),
            temperature=jnp.asarray([s.temperature for s in samplings], jnp.float32),
            top_k=jnp.asarray([s.top_k for s in samplings], jnp.int32),
            top_p=jnp.asarray([s.top_p for s in samplings], jnp.float32),
            stop_ids=jnp.asarray(self._stop_table(stops)),
        )

    def _executable(self, name: str, key, *args, **static):
        """The compiled ``name`` step for these argument shapes (``key`` names the shape variant) and
        static arguments (the attention ``mode``)."""
        full_key = (name, key, tuple(sorted(static.items())))
        exe = self._executables.get(full_key)
        if exe is None:
            t = time.perf_counter()
            exe = self._executables[full_key] = self._jitted[name].lower(*args, **static).compile()
            self.compile_time += time.perf_counter() - t
        return exe

    def attention_mode(self, lo: int, hi: int) -> str:
        """Static attention mode for a step whose relevant rows reach ``lo``..``hi`` tokens."""
        if not self.model.sparse_active:
            return "dense"
        return attention_mode(self.model.sparse.dense_len, lo, hi)

    def block_mode(self, cache: KVCache, ds: DecodeState, new_tokens: int) -> str:
        """Attention mode of a decode block adding up to ``new_tokens`` per live row, from the lengths on
        device (one sync when sparse)."""
        if not self.model.sparse_active:
            return "dense"
        lengths, done = jax.device_get((cache.lengths, ds.done))
        live = [int(n) for n, d in zip(lengths, done) if not d] or [0]
        return self.attention_mode(min(live) + 1, max(live) + new_tokens)

    def chunk_mode(self, start: list[int] | None, begin: int, num_valid) -> str:
        """Attention mode of the prefill chunk at prompt offset ``begin`` with ``num_valid[i]`` tokens of
        row i; ``start``: the rows' cached lengths before the prompt (None when not sparse)."""
        if start is None:
            return "dense"
        reach = [start[i] + begin + int(n) for i, n in enumerate(num_valid) if n]
        return self.attention_mode(min(reach), max(reach))

    def _decode(self, state, cache, ds, mode: str | None = None, sampling: str = "auto"):
        """One decode block. Without ``mode``, it is chosen from the lengths on device (one sync).
        ``sampling``: the static sampling path (:func:`~minicpm_jax.sampling.sampling_kind`)."""
        if mode is None:
            mode = self.block_mode(cache, ds, self.decode_block)
        return self._executable("decode", None, state, cache, ds, mode=mode, sampling=sampling)(state, cache, ds)

    def compiled_decode_hlo(self, mode: str = "dense") -> str:
        """Optimized HLO of the decode block (for performance work)."""
        return self._executable("decode", None, self.state, self.cache, self._initial_state([], [], []),
                                mode=mode).as_text()

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
        if reuse_prefix:
            self._truncate(start + [0] * (self.batch_size - n))
        rows_new = [r[s:] for r, s in zip(rows, start)]

        stats = GenerationStats(prefill_tokens=sum(len(r) for r in rows_new))
        compile0 = self.compile_time
        t0 = time.perf_counter()
        logits = self._run_prefill(rows_new, on_prefill)
        ds = self._initial_state(samplings, budgets, stops)
        first_args = (ds, logits, ~ds.done, self.cache.lengths)
        self.sampling = sampling_kind(samplings)
        ds = self._executable("first", None, *first_args, sampling=self.sampling)(*first_args)
        first, done = jax.device_get((ds.tok, ds.done))
        compile1 = self.compile_time
        stats.prefill_time = time.perf_counter() - t0 - (compile1 - compile0)

        outputs: list[list[int]] = [[int(first[i])] for i in range(n)]
        host_done = [bool(done[i]) for i in range(n)]
        ds = self._emit(on_tokens, [[t[0]] for t in outputs], host_done, ds)
        t1 = time.perf_counter()
        ds = self._decode_loop(ds, outputs, host_done, on_tokens)
        stats.decode_time = time.perf_counter() - t1 - (self.compile_time - compile1)
        stats.compile_time = self.compile_time - compile0
        stats.decode_tokens = sum(len(o) - 1 for o in outputs)

        finish = jax.device_get(ds.finish)
        results = [
            GenerationResult(outputs[i], FINISH_NAMES.get(int(finish[i]), "stop"), len(rows[i])) for i in range(n)
        ]
        # The last sampled token is never cached; rows stopped by the host may have run ahead on device.
        self.history[:n] = [r + o[:-1] for r, o in zip(rows, outputs)]
        self._truncate([len(h) for h in self.history])
        return results, stats

    def _common_prefix(self, row: int, ids: list[int]) -> int:
        """Length of the cached prefix of ``row`` reusable for ``ids`` (at least one token is left to run)."""
        cached = self.history[row]
        n = 0
        limit = min(len(cached), len(ids) - 1)
        while n < limit and cached[n] == ids[n]:
            n += 1
        return n

    def _truncate(self, lengths: list[int]) -> None:
        """Sets each row's valid cache length (stale KV past it is ignored and later overwritten)."""
        self.history = [h[:length] for h, length in zip(self.history, lengths)]
        self.cache = dataclasses.replace(self.cache, lengths=jnp.asarray(lengths, jnp.int32))

    def _run_prefill(self, rows: list[list[int]], on_prefill) -> jax.Array:
        """Runs all prompt rows through the cache chunk by chunk; returns the last-token logits ``f32[B, V]``."""
        total = max(len(r) for r in rows)
        start = [int(n) for n in jax.device_get(self.cache.lengths)] if self.model.sparse_active else None
        # Short prompts run in a smaller power-of-two chunk (few compiled shapes, little padding).
        c = min(self.chunk_length, max(MIN_CHUNK, 1 << (total - 1).bit_length()))
        logits = jnp.zeros((self.batch_size, self.config.vocab_size), jnp.float32)
        for begin in range(0, total, c):
            tokens = np.zeros((self.batch_size, c), np.int32)
            num_valid = np.zeros(self.batch_size, np.int32)
            for i, r in enumerate(rows):
                piece = r[begin : begin + c]
                tokens[i, : len(piece)] = piece
                num_valid[i] = len(piece)
            args = (self.state, self.cache, tokens, num_valid, logits)
            mode = self.chunk_mode(start, begin, num_valid)
            self.cache, logits = self._executable("prefill", c, *args, mode=mode)(*args)
            if on_prefill is not None:
                logits.block_until_ready()
                on_prefill(min(begin + c, total), total)
        return logits

    def _decode_loop(self, ds: DecodeState, outputs, host_done, on_tokens) -> DecodeState:
        """Dispatches block k+1 before reading block k, so the host's streaming overlaps device work."""
        pending = None  # (tokens, done flags) of the block in flight
        start = [int(n) for n in jax.device_get(self.cache.lengths)] if self.model.sparse_active else None
        dispatched = 0
        while not all(host_done):
            mode = "dense"
            if start is not None:  # bounds from host bookkeeping: no sync, block k+1 still overlaps block k
                live = [i for i in range(len(outputs)) if not host_done[i]]
                lo = min(start[i] + len(outputs[i]) for i in live)  # kv length at the block's first step, at least
                hi = max(start[i] for i in live) + dispatched + self.decode_block
                mode = self.attention_mode(lo, hi)
            self.cache, ds, block = self._decode(self.state, self.cache, ds, mode, self.sampling)
            dispatched += self.decode_block
            if pending is not None:
                ds = self._consume(pending, outputs, host_done, on_tokens, ds)
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
