"""The device programs behind an :class:`~minicpm_jax.engine.engine.Engine`: a prompt chunk, the first
token, a decode block — pure functions of (params, cache, state) compiled ahead of time per shape — and
:class:`PlainSteps`, the set of them for plain decoding (one token a step). A speculative engine swaps in
its own set (:class:`~minicpm_jax.engine.speculative.engine.EagleSteps`) with the same methods.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from minicpm_jax.engine.sampling import sample, token_logprobs
from minicpm_jax.engine.stops import DecodeState, apply_stops, loop_conditions_on_device, live_block
from minicpm_jax.model.cache import KVCache
from minicpm_jax.model.causal_lm import MiniCPMForCausalLM
from minicpm_jax.model.parallel import REPLICATED, spmd


@dataclasses.dataclass
class PrefillChunk:
    """One chunk of prompt tokens for every row (host NumPy).

    tokens ``int32[B, C]``: row i's tokens ``[begin, begin + C)`` of its prompt, zero padded; num_valid
    ``int32[B]``: how many are real; next_tokens / next_valid: the same window one token later (the
    tokens that follow, which a speculative draft pairs with the target's features).
    """

    begin: int
    tokens: np.ndarray
    num_valid: np.ndarray
    next_tokens: np.ndarray
    next_valid: np.ndarray

    @classmethod
    def of(cls, rows: Sequence[Sequence[int]], begin: int, size: int, batch_size: int) -> "PrefillChunk":
        tokens = np.zeros((batch_size, size), np.int32)
        next_tokens = np.zeros((batch_size, size), np.int32)
        num_valid = np.zeros(batch_size, np.int32)
        next_valid = np.zeros(batch_size, np.int32)
        for i, r in enumerate(rows):
            piece, following = r[begin : begin + size], r[begin + 1 : begin + size + 1]
            tokens[i, : len(piece)] = piece
            next_tokens[i, : len(following)] = following
            num_valid[i], next_valid[i] = len(piece), len(following)
        return cls(begin, tokens, num_valid, next_tokens, next_valid)


# XLA options of the programs that run a few rows a step (decode blocks, speculative rounds) on a GPU: the exhaustive
# search over Triton GEMM tilings, whose tiles read one-row GEMMs faster than the default candidates' (MiniCPM4-8B
# bf16 split over 2 H200s, session 50: q/k/v's GEMM 8.74 → 8.14 µs, o's 8.30 → 7.53, decode 2.920 → 2.880 ms/token;
# int4's GEMMs are Pallas kernels, unchanged). Prefill programs keep the default search: their GEMMs are
# compute-bound, and the exhaustive one costs compile time. XLA keeps each fusion's tiling in the compilation cache
# directory: in session 50 a second process sharing the first's cache reused its tilings whatever its own options.
FEW_ROW_OPTIONS = {"xla_gpu_exhaustive_tiling_search": True}


class Compiled:
    """Jitted functions compiled ahead of time per argument shapes and static arguments, so compilation is
    timed apart from the work (``compile_time``, seconds over the object's life). compiler_options: XLA
    options for every compile (None: the process's ``XLA_FLAGS``); few_rows: the names that also compile
    with :data:`FEW_ROW_OPTIONS` on a GPU."""

    def __init__(self, jitted: dict, compiler_options: dict | None = None, few_rows: frozenset[str] = frozenset()):
        self.jitted = jitted
        self.compiler_options = compiler_options
        self.few_rows = few_rows
        self.executables: dict = {}
        self.compile_time = 0.0

    def with_options(self, compiler_options: dict, names: set[str]) -> "Compiled":
        """The same functions, those in ``names`` compiled again with ``compiler_options`` when next called;
        the others' executables shared with this one."""
        out = Compiled(self.jitted, compiler_options, self.few_rows)
        out.executables = {k: v for k, v in self.executables.items() if k[0] not in names}
        return out

    def options(self, name: str, backend: str | None = None) -> dict | None:
        """The XLA options ``name`` compiles with on ``backend`` (default: JAX's)."""
        if name not in self.few_rows or (backend or jax.default_backend()) != "gpu":
            return self.compiler_options
        return {**FEW_ROW_OPTIONS, **(self.compiler_options or {})}

    def __call__(self, name: str, key, *args, **static):
        """Runs ``name`` on ``args``; ``key`` names the shape variant (e.g. the chunk size)."""
        full_key = (name, key, tuple(sorted(static.items())))
        exe = self.executables.get(full_key)
        if exe is None:
            t = time.perf_counter()
            lowered = self.jitted[name].lower(*args, **static)
            exe = self.executables[full_key] = lowered.compile(self.options(name))
            self.compile_time += time.perf_counter() - t
        return exe(*args)


# ---------------------------------------------------------------------------------- the device programs
@jax.jit
def sum_rows(x: jax.Array) -> jax.Array:
    """``x`` summed over its first axis (jitted: an eager op on an array still being computed blocks the
    host on the CPU backend)."""
    return jnp.sum(x, axis=0)


def prefill_chunk(graphdef, state, cache: KVCache, tokens, num_valid, last_logits, *, mode: str = "dense"):
    """One prompt chunk ``tokens int32[B, C]`` into the cache; keeps the logits ``f32[B, V]`` of each row's
    last real token (rows without tokens keep ``last_logits``). Returns (cache, logits)."""
    model = nnx.merge(graphdef, state)
    hidden, cache = model.forward(tokens, cache, num_valid, mode)
    last = jnp.take_along_axis(hidden, jnp.maximum(num_valid - 1, 0)[:, None, None], axis=1)[:, 0]
    logits = model.logits(last)
    return cache, jnp.where((num_valid > 0)[:, None], logits, last_logits)


def prefill_rows(graphdef, state, cache: KVCache, idx, tokens, num_valid, *, mode: str = "dense"):
    """A prompt chunk ``tokens int32[b, C]`` for the slots ``idx int32[b]`` alone: their cache rows are
    taken out, run through :func:`prefill_chunk` and put back (the other slots are neither computed nor
    changed). Returns (cache, logits ``f32[B, V]`` of each row's last real token, zeros for the other
    slots)."""
    b = idx.shape[0]
    vocab = nnx.merge(graphdef, state).config.vocab_size
    rows, logits = prefill_chunk(graphdef, state, cache.take_rows(idx), tokens, num_valid,
                                 jnp.zeros((b, vocab), jnp.float32), mode=mode)
    full = jnp.zeros((cache.lengths.shape[0], vocab), jnp.float32).at[idx].set(logits)
    return cache.put_rows(idx, rows), full


def first_token(ds: DecodeState, logits, active, cache_lengths, *, max_length: int, sampling: str = "auto",
                logprobs: int = 0):
    """Samples each ``active`` row's first token from its prefill logits ``f32[B, V]``. With ``logprobs``
    (static) > 0 also returns the token's log-probability and the ``logprobs`` most likely tokens
    (:func:`~minicpm_jax.engine.sampling.token_logprobs`): (state, (f32[B], int32[B, K], f32[B, K]))."""
    tok = sample(logits, ds.keys, ds.n_gen, ds.temperature, ds.top_k, ds.top_p, sampling)
    ds, _ = apply_stops(ds, tok[:, None], active.astype(jnp.int32), active, cache_lengths, max_length)
    return (ds, token_logprobs(logits, tok, logprobs)) if logprobs else ds


def decode_steps(graphdef, state, cache: KVCache, ds: DecodeState, *, num_steps: int, mode: str = "dense",
                 sampling: str = "auto", logprobs: int = 0, check_each: bool = False):
    """Up to ``num_steps`` decode steps on device while a row is live (:func:`~minicpm_jax.engine.stops.live_block`
    with ``check_each``: checked before every step, or once at the block's start); returns (cache, state,
    tokens ``int32[B, num_steps]``, -1 = none). With ``logprobs`` (static) > 0 also each token's
    log-probability and the ``logprobs`` most likely tokens of its step, from the logits the step samples
    from: (cache, state, tokens, (f32[B, N], int32[B, N, K], f32[B, N, K]))."""
    model = nnx.merge(graphdef, state)
    b = ds.tok.shape[0]
    out = jnp.full((b, num_steps), -1, jnp.int32)
    lps = (jnp.zeros((b, num_steps), jnp.float32), jnp.zeros((b, num_steps, logprobs), jnp.int32),
           jnp.zeros((b, num_steps, logprobs), jnp.float32))

    def body(carry):
        i, cache, ds, out, lps = carry
        active = ~ds.done
        hidden, cache = model.forward(ds.tok[:, None], cache, active.astype(jnp.int32), mode)
        logits = model.logits(hidden[:, 0])
        new_tok = sample(logits, ds.keys, ds.n_gen, ds.temperature, ds.top_k, ds.top_p, sampling)
        out = out.at[:, i].set(jnp.where(active, new_tok, -1))
        if logprobs:
            lps = tuple(acc.at[:, i].set(x) for acc, x in zip(lps, token_logprobs(logits, new_tok, logprobs)))
        ds, _ = apply_stops(ds, new_tok[:, None], active.astype(jnp.int32), active, cache.lengths, cache.max_length)
        return i + 1, cache, ds, out, lps

    _, cache, ds, out, lps = live_block(body, (jnp.int32(0), cache, ds, out, lps), num_steps, check_each)
    return (cache, ds, out, lps) if logprobs else (cache, ds, out)


def decode_rows(graphdef, state, cache, ds: DecodeState, idx, *, num_steps: int, mode: str = "dense",
                sampling: str = "auto", logprobs: int = 0, check_each: bool = False):
    """:func:`decode_steps` over the slots ``idx int32[b]`` alone (distinct slots; the cache's view of them —
    free for a paged cache, whose rows are page-table rows — and their decode state); the other slots are
    neither computed nor changed. Returns what :func:`decode_steps` does, over every slot (tokens -1 and
    log-probabilities 0 for the others)."""
    b = ds.tok.shape[0]
    rows = jax.tree.map(lambda x: x[idx], ds)
    out = decode_steps(graphdef, state, cache.take_rows(idx), rows, num_steps=num_steps, mode=mode,
                       sampling=sampling, logprobs=logprobs, check_each=check_each)
    cache = cache.put_rows(idx, out[0])
    ds = jax.tree.map(lambda full, r: full.at[idx].set(r), ds, out[1])
    tokens = jnp.full((b, num_steps), -1, jnp.int32).at[idx].set(out[2])
    if not logprobs:
        return cache, ds, tokens
    lps = tuple(jnp.zeros((b, *x.shape[1:]), x.dtype).at[idx].set(x) for x in out[3])
    return cache, ds, tokens, lps


def on_flat_params(fn, graphdef, treedef, **bound):
    """``program(params, *args, **kwargs) = fn(graphdef, state, *args, **bound, **kwargs)`` with the model's nnx
    State rebuilt from ``params``, its leaves in ``treedef``'s order (a jitted program's parameters as a flat
    list of arrays). The program has ``fn``'s name, so its HLO module does (``jit_decode_steps``: what a profile
    tells programs apart by)."""
    def program(params: list, *args, **kwargs):
        return fn(graphdef, jax.tree.unflatten(treedef, params), *args, **bound, **kwargs)

    program.__name__ = program.__qualname__ = fn.__name__
    return program


# ------------------------------------------------------------------------------------------ plain decode
class PlainSteps:
    """Plain decoding's programs for ``model``: a prompt chunk, the first token, ``decode_block`` steps (a
    :class:`~minicpm_jax.engine.step_set.StepSet`)."""

    reuse_margin = 0
    has_logprobs = True
    decodes_rows = True

    def __init__(self, model: MiniCPMForCausalLM, *, decode_block: int, page_size: int | None = None):
        """page_size: the programs run over a paged cache of pages of this size (None: the contiguous one)."""
        self.model = model
        self.page_size = page_size
        self.graphdef, state = nnx.split(model)
        # The programs take the parameters as a flat list of arrays (``state``), rebuilt into the model's
        # nnx State inside the trace: a call then flattens a list in C++, where the State's Variables were
        # flattened in Python at every call (~195 of them, ~0.5 ms of the server's step on an H100 host).
        self.state, treedef = jax.tree.flatten(state)
        self.tokens_per_block = decode_block
        self._rows: tuple[np.ndarray, jax.Array] | None = None  # the last decode rows, and on the device
        # A model split over a mesh runs each program as one SPMD program (parameters and cache by their
        # specs, everything else replicated); the first token needs no model: a plain replicated jit.
        mesh, c, r = model.mesh, model.cache_specs(page_size), REPLICATED
        s = treedef.flatten_up_to(model.param_specs(state))
        model_fn = lambda fn, **kw: on_flat_params(fn, self.graphdef, treedef, **kw)  # noqa: E731
        prefill = spmd(mesh, model_fn(prefill_chunk), (s, c, r, r, r), (c, r))
        rows = spmd(mesh, model_fn(prefill_rows), (s, c, r, r, r), (c, r))
        outs = lambda logprobs=0, **_: (c, r, r, r) if logprobs else (c, r, r)  # noqa: E731
        block = dict(num_steps=decode_block, check_each=loop_conditions_on_device(1 if mesh is None else mesh.size))
        decode = spmd(mesh, model_fn(decode_steps, **block), (s, c, r), outs)
        subset = spmd(mesh, model_fn(decode_rows, **block), (s, c, r, r), outs)
        self.compiled = Compiled({
            "prefill": jax.jit(prefill, donate_argnums=1, static_argnames="mode"),
            "prefill_rows": jax.jit(rows, donate_argnums=1, static_argnames="mode"),
            "first": jax.jit(functools.partial(first_token, max_length=model.max_length),
                             static_argnames=("sampling", "logprobs")),
            "decode": jax.jit(decode, donate_argnums=1, static_argnames=("mode", "sampling", "logprobs")),
            "decode_rows": jax.jit(subset, donate_argnums=1, static_argnames=("mode", "sampling", "logprobs")),
        }, few_rows=frozenset({"decode", "decode_rows"}))

    @property
    def compile_time(self) -> float:
        return self.compiled.compile_time

    def reset(self, rows: np.ndarray | None = None) -> None:
        """Forgets the programs' own per-row state (plain decoding has none)."""

    def truncate(self, lengths: Sequence[int]) -> None:
        """The cache rows were cut to ``lengths`` (plain decoding keeps nothing beside the cache)."""

    def admitted(self, slot: int, length: int) -> None:
        """``slot`` starts on a shared cached prefix (plain decoding keeps nothing beside the cache)."""

    def prefill_chunk(self, cache: KVCache, chunk: PrefillChunk, logits: jax.Array, mode: str):
        """Runs ``chunk`` into ``cache``; returns (cache, last-token logits ``f32[B, V]``)."""
        args = (self.state, cache, chunk.tokens, chunk.num_valid, logits)
        return self.compiled("prefill", chunk.tokens.shape[1], *args, mode=mode)

    def prefill_rows(self, cache: KVCache, idx: np.ndarray, chunk: PrefillChunk, mode: str):
        """Runs the rows ``idx int32[b]`` of ``chunk`` over those slots' cache rows alone (the others are
        neither computed nor changed); returns (cache, last-token logits ``f32[B, V]``, zeros elsewhere)."""
        args = (self.state, cache, idx, chunk.tokens[idx], chunk.num_valid[idx])
        return self.compiled("prefill_rows", (len(idx), chunk.tokens.shape[1]), *args, mode=mode)

    def first_token(self, cache: KVCache, ds: DecodeState, logits: jax.Array, active: jax.Array,
                    sampling: str = "auto", logprobs: int = 0):
        """Samples the ``active`` rows' first tokens from their prefill logits (with their log-probabilities
        when ``logprobs`` > 0, see :func:`first_token`)."""
        args = (ds, logits, active, cache.lengths)
        return self.compiled("first", None, *args, sampling=sampling, logprobs=logprobs)

    def start(self, ds: DecodeState, rows: jax.Array | None = None) -> None:
        """Decoding begins from ``ds`` for every row, or for the rows ``bool[B]`` joining a running batch
        (plain decoding needs nothing)."""

    def decode_block(self, cache: KVCache, ds: DecodeState, mode: str, sampling: str = "auto", logprobs: int = 0,
                     rows: np.ndarray | None = None):
        """One decode block; returns (cache, state, tokens ``int32[B, decode_block]``, -1 = none), and the
        tokens' log-probabilities when ``logprobs`` > 0 (see :func:`decode_steps`). rows: only these slots
        (``int32[b]``, distinct) are computed (:func:`decode_rows`), the others keep their state."""
        if rows is not None:
            return self.compiled("decode_rows", len(rows), self.state, cache, ds, self._device_rows(rows), mode=mode,
                                 sampling=sampling, logprobs=logprobs)
        return self.compiled("decode", None, self.state, cache, ds, mode=mode, sampling=sampling, logprobs=logprobs)

    def _device_rows(self, rows: np.ndarray) -> jax.Array:
        """``rows`` as a device array, sent again only when they change. A host array passed to a program
        is copied to the device inside the call, and that copy waits for the work queued before it: the
        server's call for the next decode step returned only once the step before had (nearly) run (8B, 64
        rows, H100: 7.7 ms of host time a call, back to back, against 0.9 ms with the rows on the device),
        so the host's work for a step could not overlap the device's. The rows change only when a request
        joins or leaves the running batch."""
        rows = np.asarray(rows, np.int32)
        if self._rows is None or not np.array_equal(self._rows[0], rows):
            self._rows = (rows, jax.device_put(rows))
        return self._rows[1]

    def accepted(self) -> None:
        """Speculative statistics (none for plain decoding)."""
        return None

    def accept_counts(self) -> None:
        """Speculative statistics (none for plain decoding)."""
        return None
