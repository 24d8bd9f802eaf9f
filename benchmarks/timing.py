"""Timing of µs-scale device work: many calls inside one jit, so dispatch (~40 µs a call) is not timed.

Two clocks: :func:`device_loop_time` (wall time of the jitted loop: kernels and the gaps between them) and
:func:`loop_kernel_time` (the GPU kernels' own durations, from a ``jax.profiler`` trace of the same loop).
The second exists because a ``lax.fori_loop`` recorded as a CUDA graph runs short Pallas kernels with gaps
that the engine's decode loop does not show (docs/lab_notes, 2026-11-23 H200 session), so for chains of
µs-scale kernels the two can differ by machine.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import tempfile
import time

import jax
import jax.numpy as jnp
from jax import lax

from minicpm_jax.cli.system import COMMAND_BUFFER_FLAG


def device_loop_time(fn, args: tuple, *, iters: int, repeats: int = 2, chain: int = -1) -> list[float]:
    """Seconds per ``fn(*args)``, measured as ``iters`` calls in one ``lax.fori_loop``, for each of
    ``repeats`` timed runs (after one warm-up run).

    ``fn`` may return a pytree (e.g. a list of per-layer calls); all of it is kept live. Each call depends
    on the previous one (``args[chain]``, an integer array, is offset by a value that
    is 0 unless the previous output holds a NaN), so XLA can neither hoist the call out of the loop nor
    run the iterations concurrently.
    """
    return loop_time(device_loop(fn, args, iters=iters, chain=chain), args, iters=iters, repeats=repeats)


def carried_loop_time(fn, args: tuple, carry, *, iters: int, repeats: int = 2):
    """Seconds per ``carry = fn(*args, carry)``, measured as ``iters`` calls in one ``lax.fori_loop`` for
    each of ``repeats`` timed runs (after one warm-up run), and the final carry: ``(times, carry)``.

    For work that updates a buffer (a KV cache written by a forward): the carry is donated and passed from
    call to call, so the update happens in place, as in the engine's loop. :func:`device_loop_time` hands
    every call the same input, which XLA must then copy whole before writing into it (at 128K context a
    4.3 GB cache, ~3 ms on an H100, timed with the call). The ``carry`` passed in is consumed; ``fn`` keeps
    anything it computes live by folding it into the carry, and keeps the carry's shapes.
    """
    run = carried_loop(fn, iters=iters)
    carry = jax.block_until_ready(run(args, carry))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        carry = jax.block_until_ready(run(args, carry))
        times.append((time.perf_counter() - t) / iters)
    return times, carry


def carried_loop_kernels(fn, args: tuple, carry, *, iters: int, top: int = 12):
    """Where ``carry = fn(*args, carry)`` spends its GPU time, kernel by kernel: the loop of
    :func:`carried_loop_time` compiled without CUDA graphs (whose kernels a trace misses, :func:`recompiled`),
    warmed, then traced once. Returns (µs per call of the ``top`` kernel names by time, the others summed as
    ``rest``; a name is followed by the tail of its op path, e.g. ``loop_add_fusion_3 (layers/attention/add)``;
    empty without a GPU trace, the carry)."""
    run = carried_loop(fn, iters=iters).lower(args, carry).compile(NO_GRAPHS)
    carry = jax.block_until_ready(run(args, carry))
    carry, planes = traced(lambda: jax.block_until_ready(run(args, carry)))
    planes = planes or []
    paths = kernel_op_paths(planes)
    per = sorted(kernel_seconds(planes).items(), key=lambda kv: -kv[1])
    out = {_labelled(name, paths.get(name)): 1e6 * sec / iters for name, sec in per[:top]}
    if per[top:]:
        out["rest"] = 1e6 * sum(sec for _, sec in per[top:]) / iters
    return out, carry


def carried_loop(fn, *, iters: int):
    """The jitted loop :func:`carried_loop_time` runs: ``run(args, carry)`` applies ``carry = fn(*args,
    carry)`` ``iters`` times, the carry donated."""
    return jax.jit(lambda a, c: lax.fori_loop(0, iters, lambda _, x: fn(*a, x), c), donate_argnums=1)


def loop_time(run, args: tuple, *, iters: int, repeats: int = 2) -> list[float]:
    """:func:`device_loop_time` of an already built :func:`device_loop` ``run`` of ``iters`` calls."""
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


def loop_kernel_time(run, args: tuple, *, iters: int) -> float | None:
    """Seconds of GPU kernel time per call of a :func:`device_loop` ``run`` of ``iters`` calls: every
    kernel the loop runs (its own small fusions included), summed from a ``jax.profiler`` trace of one
    run and divided by ``iters``. None where the trace has no GPU kernels (the CPU)."""
    jax.block_until_ready(run(*args))
    _, planes = traced(lambda: jax.block_until_ready(run(*args)))
    per_kernel = kernel_seconds(planes) if planes else {}
    return sum(per_kernel.values()) / iters if per_kernel else None


def traced(fn):
    """``(fn(), planes)``: the planes (``ProfileData.planes``, as a list: the attribute is an iterator) of a
    ``jax.profiler`` trace of the call, or None where the trace wrote no file."""
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        try:
            result = fn()
        finally:
            jax.profiler.stop_trace()
        files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        return result, (list(jax.profiler.ProfileData.from_file(files[0]).planes) if files else None)


# XLA's option that lists what it records as CUDA graphs (command buffers): none; or what the engine's runs record
# (minicpm_jax.cli.system.COMMAND_BUFFER_FLAG) but loops and conditionals.
NO_GRAPHS = {"xla_gpu_enable_command_buffer": ""}
NO_LOOP_GRAPHS = {"xla_gpu_enable_command_buffer": ",".join(
    k for k in COMMAND_BUFFER_FLAG.split("=", 1)[1].split(",") if k not in ("WHILE", "CONDITIONAL"))}


@contextlib.contextmanager
def recompiled(steps, names: set[str], options: dict):
    """While inside, the programs ``names`` of ``steps.compiled`` (an engine's ``Steps``, whose ``Compiled``
    has ``with_options``) run compiled with ``options``, for a trace: :data:`NO_GRAPHS` where kernels need
    their op paths (a graph's kernels reach the trace without them, a WHILE graph's mostly not at all: H200,
    2026-11-30, 149 of ~906 kernel events of a decode; launched one by one, the gaps between them are not the
    graph's), :data:`NO_LOOP_GRAPHS` where their names suffice."""
    graphs = steps.compiled
    steps.compiled = graphs.with_options(options, names)
    try:
        yield
    finally:
        steps.compiled = graphs


def _kernel_events(planes, device: int | None = None):
    """``(kernel name, event)`` of every event on the GPU planes' stream lines of a profile (``device``: only
    that GPU's plane), the ``__N`` suffix XLA gives each launch site of one kernel dropped from the name."""
    for plane in planes:
        if not plane.name.startswith("/device:GPU" if device is None else f"/device:GPU:{device}"):
            continue
        for line in plane.lines:
            if "Stream" in line.name:
                for event in line.events:
                    yield re.sub(r"__\d+$", "", event.name), event


def kernel_seconds(planes, device: int | None = None) -> dict[str, float]:
    """Seconds by kernel name of the events on the GPU planes' stream lines of a profile (``ProfileData
    .planes``; ``device``: only that GPU's plane); the ``__N`` suffix XLA gives each launch site of one
    kernel is dropped."""
    out: dict[str, float] = {}
    for name, event in _kernel_events(planes, device):
        out[name] = out.get(name, 0.0) + event.duration_ns * 1e-9
    return out


def kernel_op_paths(planes) -> dict[str, str]:
    """Each GPU kernel name of a profile (as :func:`kernel_seconds` names them) → the op path its events
    carry (the ``name`` stat, e.g. ``jit(f)/while/body/attention/dot_general``; the first one seen), for kernels
    launched outside CUDA graphs."""
    out: dict[str, str] = {}
    for name, event in _kernel_events(planes):
        path = out.get(name) or dict(event.stats).get("name")
        if path:
            out[name] = str(path)
    return out


def _labelled(name: str, path: str | None) -> str:
    """A kernel's name with the last three parts of its op path (the scopes and the op), where known."""
    return f"{name} ({'/'.join(path.split('/')[-3:])})" if path else name


def gpu_timeline(planes, device: int = 0, gap_ns: int = 3000) -> dict[str, float]:
    """Where one GPU's time went in a profile (``ProfileData.planes``): ``span_s`` from its first kernel's
    start to its last kernel's end, ``busy_s`` the union of its kernels' intervals (overlapping streams
    counted once), ``kernels`` the launches, and ``gaps_s`` / ``gaps`` the idle stretches longer than
    ``gap_ns`` (host launches the device waits for, host round trips). Zeros without kernels."""
    spans = []
    for plane in planes:
        if not plane.name.startswith(f"/device:GPU:{device}"):
            continue
        for line in plane.lines:
            if "Stream" in line.name:
                spans += [(e.start_ns, e.start_ns + e.duration_ns) for e in line.events]
    span, busy, gaps, n_gaps = _union(spans, gap_ns)
    return {"span_s": span * 1e-9, "busy_s": busy * 1e-9, "kernels": len(spans), "gaps_s": gaps * 1e-9,
            "gaps": n_gaps}


def _union(spans: list, gap_ns: float = 0) -> tuple[float, float, float, int]:
    """Intervals ``(start, end, ...)`` in ns: (span from the first start to the last end, busy = their union,
    idle stretches longer than ``gap_ns`` summed and counted); zeros without intervals."""
    if not spans:
        return 0.0, 0.0, 0.0, 0
    spans = sorted(spans)
    busy = gaps = 0.0
    n_gaps = 0
    lo, hi = spans[0][:2]
    for s, e, *_ in spans[1:]:
        if s > hi:
            busy += hi - lo
            if s - hi > gap_ns:
                gaps += s - hi
                n_gaps += 1
            lo, hi = s, e
        else:
            hi = max(hi, e)
    busy += hi - lo
    return hi - spans[0][0], busy, gaps, n_gaps


def hlo_op_paths(hlo_text: str) -> dict[str, str]:
    """Each instruction of an optimized HLO module's text → its op path (``metadata op_name``, e.g.
    ``jit(decode)/while/body/spec_verify/dot_general``): what a CPU trace's events lack (a GPU kernel's
    event carries its path in its ``name`` stat)."""
    return dict(_OP_PATH.findall(hlo_text))


_OP_PATH = re.compile(r'^\s*(?:ROOT\s+)?%?([^\s=]+) = [^\n]*?op_name="([^"]*)"', re.M)


def scoped_seconds(planes, modules: set[str], scopes: tuple[str, ...], *, op_paths: dict[str, str] | None = None,
                   device: int = 0) -> dict[str, float]:
    """Where the programs ``modules`` (HLO module names, e.g. ``jit_decode``) spent one device's time in a
    profile (``ProfileData.planes``), seconds by ``jax.named_scope``: each kernel counts for the first of
    ``scopes`` (in their order) found on its op path, or for ``other`` (kernels outside every scope, and fusions
    whose path stops above them: a GPU trace gave a fusion of ops from two scopes their common prefix).
    ``idle``: the time between the programs' first kernel's start and their last one's end that none of their
    kernels covers (launch gaps, host round trips), so on one stream the scopes, ``other`` and ``idle`` sum to
    ``span``. ``kernels``: how many were counted.

    A GPU's kernels are the events of its stream lines, all of them (a stream's kernels can overlap by a little:
    their parts may then sum to more than the span). Without a GPU plane (the CPU backend) they are the
    host's XLA events, leaves only (a loop's event holds its body's), each mapped to its path through
    ``op_paths`` (``hlo_op`` → path, :func:`hlo_op_paths`)."""
    planes = list(planes)  # ProfileData.planes is an iterator
    gpu = [p for p in planes if p.name == f"/device:GPU:{device}"]
    spans = []  # (start, end, op path)
    for plane in gpu or [p for p in planes if p.name == "/host:CPU"]:
        for line in plane.lines:
            if gpu and "Stream" not in line.name:
                continue
            found = []
            for event in line.events:
                stats = dict(event.stats)
                if stats.get("hlo_module") not in modules or "hlo_op" not in stats:
                    continue
                path = stats.get("name") or (op_paths or {}).get(str(stats["hlo_op"]), "")
                found.append((event.start_ns, event.start_ns + event.duration_ns, str(path)))
            found.sort()
            if gpu:  # kernels of one stream may overlap by a little (launch timestamps): all of them count
                spans += found
            else:  # the host's leaves: an event that holds the next one's start (a loop around its body) is not
                spans += [f for f, nxt in zip(found, found[1:] + [None]) if nxt is None or nxt[0] >= f[1]]
    out = {s: 0.0 for s in (*scopes, "other", "idle")}
    for start, end, path in spans:
        parts = path.split("/")
        out[next((s for s in scopes if s in parts), "other")] += (end - start) * 1e-9
    span, busy, _, _ = _union(spans)
    out["idle"] = (span - busy) * 1e-9
    return {**out, "span": span * 1e-9, "kernels": len(spans)}
