"""Device memory of what a benchmark compiled, from XLA's buffer assignment."""

from __future__ import annotations


def program_memory(compiled) -> dict[str, int]:
    """What each program an engine compiled needs on the device while it runs, bytes: its arguments
    (weights, cache, state) + outputs not donated into them + temporaries, from XLA's buffer assignment
    (``memory_analysis``). The largest is the run's peak with nothing else live, free of the allocator's
    history (the device's own peak counter cannot be reset and keeps the weights' random init)."""
    out = {}
    for (name, key, static), exe in compiled.executables.items():
        m = exe.memory_analysis()
        if m is None:
            continue
        label = "/".join(str(p) for p in (name, key, *(f"{k}={v}" for k, v in static)) if p is not None)
        out[label] = int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                         + m.temp_size_in_bytes)
    return out
