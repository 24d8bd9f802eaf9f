"""Timing of µs-scale device work: many calls inside one jit, so dispatch (~40 µs a call) is not timed."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from jax import lax


def device_loop_time(fn, args: tuple, *, iters: int, repeats: int = 2, chain: int = -1) -> list[float]:
    """Seconds per ``fn(*args)``, measured as ``iters`` calls in one ``lax.fori_loop``, for each of
    ``repeats`` timed runs (after one warm-up run).

    ``fn`` may return a pytree (e.g. a list of per-layer calls); all of it is kept live. Each call depends
    on the previous one (``args[chain]``, an integer array, is offset by a value that
    is 0 unless the previous output holds a NaN), so XLA can neither hoist the call out of the loop nor
    run the iterations concurrently.
    """
    run = device_loop(fn, args, iters=iters, chain=chain)
    jax.block_until_ready(run(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(run(*args))
        times.append((time.perf_counter() - t) / iters)
    return times


def device_loop(fn, args: tuple, *, iters: int, chain: int = -1):
    """The jitted loop :func:`device_loop_time` runs: ``iters`` chained calls of ``fn(*args)``."""
    chain = chain % len(args)

    def loop(*a):
        def body(_, carry):
            a_i = list(a)
            a_i[chain] = a[chain] + carry
            out = fn(*a_i)
            # One element of every output leaf, so no call in fn is dead code.
            probe = sum(jnp.ravel(leaf)[0].astype(jnp.float32) for leaf in jax.tree.leaves(out))
            return jnp.where(jnp.isnan(probe), 1, 0).astype(a[chain].dtype)

        return lax.fori_loop(0, iters, body, jnp.zeros((), a[chain].dtype))

    return jax.jit(loop)
