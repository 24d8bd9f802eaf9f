"""Parameters from a checkpoint through its :class:`~minicpm_jax.io.names.CheckpointMap`: every name and
shape checked first (all problems reported in one error), then the arrays yielded one parameter at a time
(dense linears transposed to ``[in, out]`` and fused; int4 linears repacked into the engine layout), so
host memory peaks at about one copy of the weights.

A reader is :class:`~minicpm_jax.io.safetensors.TensorReader` or
:class:`~minicpm_jax.io.safetensors.ArrayReader` (``names``, ``shape``, ``get``, ``get_optional``).
"""

from __future__ import annotations

from typing import Iterator, Sequence

import jax
import jax.numpy as jnp

from minicpm_jax.errors import MiniCPMError
from minicpm_jax.io.int4_checkpoint import check_int4_tensors, engine_arrays, read_int4_linear
from minicpm_jax.io.names import CheckpointMap, Linear, ParamPath
from minicpm_jax.quant import CheckpointQuant, QuantSpec


def _int4_linears(cmap: CheckpointMap, quant: CheckpointQuant | None) -> list[Linear]:
    return [lin for lin in cmap.linears if quant is not None and lin.quantizable]


def checkpoint_problems(cmap: CheckpointMap, reader, quant: CheckpointQuant | None) -> list[str]:
    """Missing, mis-shaped and unexpected tensors of a checkpoint read as ``cmap`` (int4 linears as
    ``quant`` stores them, when given)."""
    names = reader.names
    int4 = _int4_linears(cmap, quant)
    problems, used = check_int4_tensors(int4, quant, reader.shape, names) if int4 else ([], set())
    used = set(used)
    wanted = [(n, s, False) for lin in cmap.linears if lin not in int4 for n, s in zip(lin.weight_names, lin.weight_shapes)]
    wanted += [(t.name, t.shape, t.optional) for t in cmap.tensors]
    for name, shape, optional in wanted:
        used.add(name)
        if name not in names:
            if not optional:
                problems.append(f"missing tensor {name} (expected shape {list(shape)})")
        elif reader.shape(name) != tuple(shape):
            problems.append(f"tensor {name} has shape {list(reader.shape(name))}, expected {list(shape)}")
    problems += [f"unexpected tensor {n}" for n in sorted(names - used) if not cmap.is_tolerated(n)]
    return problems


def report(problems: Sequence[str], heading: str) -> None:
    """One MiniCPMError, ``heading`` then ``problems`` (at most 25) one per line, if there are any."""
    if problems:
        shown = list(problems[:25]) + ([f"... and {len(problems) - 25} more"] if len(problems) > 25 else [])
        raise MiniCPMError(f"{heading}:\n  " + "\n  ".join(shown))


def read_params(cmap: CheckpointMap, reader, dtype, quant: CheckpointQuant | None = None,
                spec: QuantSpec | None = None) -> Iterator[tuple[ParamPath, jax.Array]]:
    """Yields ``(param path, array)`` for every parameter of ``cmap`` (check it first with
    :func:`checkpoint_problems`). Floating parameters come in ``dtype``; int4 linears (``quant``: the
    checkpoint's settings) are repacked for the model's ``spec`` (default ``quant.spec``), their scales in
    the model's scale dtype."""
    for t in cmap.tensors:
        value = reader.get_optional(t.name)
        if value is None:
            yield t.path, jnp.zeros(t.shape, dtype)
        else:
            yield t.path, jnp.asarray(value).astype(jnp.int32 if t.integer else dtype)
    int4 = _int4_linears(cmap, quant)
    for lin in cmap.linears:
        if lin in int4:
            w = read_int4_linear(lin, quant, reader.get_optional)
            for key, value in engine_arrays(w, spec or quant.spec, dtype).items():
                yield lin.path + (key,), jnp.asarray(value)
            continue
        parts = [jnp.asarray(reader.get(name)) for name in lin.weight_names]
        kernel = jnp.concatenate([p.T for p in parts], axis=1) if len(parts) > 1 else parts[0].T
        yield lin.path + ("kernel",), kernel.astype(dtype)
        del parts, kernel
