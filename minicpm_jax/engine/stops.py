"""Per-row decode state and the stop rules, shared by plain decoding (one token a step) and speculative
rounds (up to A tokens a round): stop ids (the stop token is emitted), the token budget, a full cache."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from minicpm_jax.errors import MiniCPMError

FINISH_NONE, FINISH_STOP, FINISH_LENGTH = 0, 1, 2
FINISH_NAMES = {FINISH_STOP: "stop", FINISH_LENGTH: "length"}
MAX_STOP_IDS = 16  # static width of the per-row stop-id table


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


def stop_table(stop_ids: Sequence[Sequence[int]], batch_size: int) -> np.ndarray:
    """``int32[batch_size, MAX_STOP_IDS]``: each row's stop ids (deduplicated), -1 padded; MiniCPMError for
    more than ``MAX_STOP_IDS`` ids in a row."""
    table = np.full((batch_size, MAX_STOP_IDS), -1, np.int32)
    for row, ids in enumerate(stop_ids):
        ids = list(dict.fromkeys(ids))
        if len(ids) > MAX_STOP_IDS:
            raise MiniCPMError(f"at most {MAX_STOP_IDS} stop token ids per request, got {len(ids)}")
        table[row, : len(ids)] = ids
    return table


def apply_stops(ds: DecodeState, emitted: jax.Array, count: jax.Array, active: jax.Array, cache_lengths: jax.Array,
                max_length: int) -> tuple[DecodeState, jax.Array]:
    """Applies the stop rules to up to A new tokens per row.

    emitted ``int32[B, A]``: the row's new tokens in order, the first ``count[B]`` valid; active ``bool[B]``:
    rows that ran; cache_lengths ``int32[B]``: after the step. A row keeps its tokens up to and including
    the first stop id, within its budget; it is done on a stop id, on reaching ``max_new``, or with a full
    cache. Returns (updated state, ``keep bool[B, A]``: the tokens it emits)."""
    a = emitted.shape[1]
    levels = jnp.arange(a, dtype=jnp.int32)
    in_step = (levels[None, :] < count[:, None]) & active[:, None]
    budget = ds.n_gen[:, None] + levels[None, :] < ds.max_new[:, None]
    is_stop = jnp.any(emitted[:, :, None] == ds.stop_ids[:, None, :], axis=2) & in_step & budget
    first_stop = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1), a)
    keep = in_step & budget & (levels[None, :] <= first_stop[:, None])
    n_emit = jnp.sum(keep, axis=1, dtype=jnp.int32)
    n_gen = ds.n_gen + n_emit
    hit_stop = active & (first_stop < a)
    hit_len = active & ~hit_stop & ((n_gen >= ds.max_new) | (cache_lengths >= max_length))
    last = jnp.take_along_axis(emitted, jnp.maximum(n_emit - 1, 0)[:, None], axis=1)[:, 0]
    ds = dataclasses.replace(
        ds, tok=jnp.where(active, last, ds.tok), n_gen=n_gen, done=ds.done | hit_stop | hit_len,
        finish=jnp.where(hit_stop, FINISH_STOP, jnp.where(hit_len, FINISH_LENGTH, ds.finish)).astype(jnp.int32),
    )
    return ds, keep


def command_buffer_types() -> set[str]:
    """The kinds of work ``XLA_FLAGS`` name for XLA to record into CUDA graphs in this process
    (``--xla_gpu_enable_command_buffer``, the last one given; ``+KIND`` counts, ``-KIND`` does not):
    upper-case names such as ``WHILE``, ``CONDITIONAL``; empty when the flags name none."""
    values = re.findall(r"--xla_gpu_enable_command_buffer=(\S*)", os.environ.get("XLA_FLAGS", ""))
    kinds = [k.strip() for k in values[-1].split(",")] if values else []
    return {k.lstrip("+").upper() for k in kinds if k and not k.startswith("-")}


def loop_conditions_on_device(devices: int = 1) -> bool:
    """Whether a while loop's data-dependent condition inside a compiled decode block costs no host round
    trip: off the GPU (the host runs the program), or on one GPU whose XLA records while loops into CUDA
    graphs (``WHILE`` command buffers, which ``run``, the server and the benchmarks turn on:
    ``minicpm_jax.cli.system.enable_command_buffers``). XLA's GPU runtime otherwise copies the condition
    to the host before every iteration and waits for it; a block split over several GPUs (``devices`` > 1)
    may have XLA collectives inside (without a peer-memory workspace, or with logits too wide for its kernel,
    ``minicpm_jax.model.parallel``), which keep it out of the graphs, so it keeps the fixed trip count."""
    if jax.default_backend() != "gpu":
        return True
    return devices == 1 and "WHILE" in command_buffer_types()


def live_block(body, carry: tuple, iterations: int, check_each: bool = False) -> tuple:
    """Runs ``body(carry) -> carry`` up to ``iterations`` times while a row of the carry's
    :class:`DecodeState` (its third element) is not done; the carry's first element is the iteration
    counter, which ``body`` increments.

    ``check_each`` (where :func:`loop_conditions_on_device`): a while loop on "below ``iterations`` and a
    row is live", so a block stops computing when its last row finishes (a generation that ends inside a
    block wastes nothing: at 128K, the speculative benchmark's 64-token run computed 24 rounds for 21).
    Otherwise the iterations run as a fixed trip count behind one check at the block's start, and rows
    that finish inside the block run on masked to its end.

    Why not the while loop everywhere (as this was): XLA's GPU runtime runs a while loop whose trip count it
    cannot tell by copying the condition to the host before every iteration (unless its command buffers
    record the loop), so the host waits for the device to finish before it launches the next iteration,
    and the device idles while the launch starts. A 128K speculative round of the 8B shape (int4 +
    InfLLM-v2, tree 12; H200) took 7.75 ms that way and 7.02 ms in a loop of a known trip count. The one
    check at the start costs a copy a block instead of one an iteration (the same round: 2.351 ms/token
    with it, 2.302 with no check at all, best of 2, one process, no command buffers) and skips the block the
    engine queues before it reads the previous one when that one finished every row. (A conditional
    around each iteration instead of the while loop made XLA copy the cache every step.)

    One iteration runs without the check (the server's step): a block of one step whose rows are all done
    computes one step that changes nothing, and the host queues the next block while the device runs
    this one."""
    if iterations == 1:
        return body(carry)

    def live(c):
        return jnp.any(~c[2].done)

    if check_each:
        return jax.lax.while_loop(lambda c: (c[0] < iterations) & live(c), body, carry)

    def run(c):
        return jax.lax.fori_loop(0, iterations, lambda _, c_: body(c_), c)  # a known trip count: no copy

    return jax.lax.cond(live(carry), run, lambda c: c, carry)
